"""Measurement, outside the product: ``python -m bench <experiment>`` (``__main__.py``).

``experiments/`` holds one module per experiment; ``workloads.py`` and ``loadgen.py`` make and
send traffic, ``report.py`` writes tables and plots; ``harness/`` starts real clusters and
Redis servers (the tests use it too); ``sim/`` is the simulator (the real engine and the real
routing core over a cost model) with the peers' routing rules; ``peers/`` runs transformers,
vLLM and Ray's router beside ours. Not part of the wheel.
"""
