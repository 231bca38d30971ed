"""Real clusters and Redis servers for the tests and the experiments."""
