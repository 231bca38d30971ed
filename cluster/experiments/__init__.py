"""Experiments: ``python -m cluster.experiments <name> --out PATH``; each prints its JSON last."""
