"""The vLLM engine backend (``EngineConfig.backend: vllm``): vLLM's async engine in the
replica's process, its KV cache events re-keyed into the index by our hash chain.

``bridge.py`` translates vLLM's events (no vLLM import: tested without it), ``events.py``
subscribes to them and resyncs after a gap, ``engine.py`` runs vLLM and speaks our
``EngineRequest`` / ``RequestOutput``. The deployment is ``replica.vllm_replica``.
"""
