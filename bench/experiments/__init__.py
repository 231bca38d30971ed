"""One module per experiment of ``python -m bench``."""
