"""The engine room: one replica's paged engine, scheduling and memory, without the model.

``engine.py`` (``Engine``: requests in, outputs out, one step at a time, handed its runner)
drives the rest: ``scheduler.py`` picks each step's work within a token budget
(``step.py``: the batch record and the ``Runner`` that executes it), ``block_manager.py``
gives sequences their KV blocks through ``block_allocator.py`` (ref counts) and
``prefix_cache.py`` (verified hits by block hash), ``sequence.py`` is one request's state,
``choices.py`` forks ``n`` choices from one prefill, ``limits.py`` says what a request may
ask, ``audit.py`` recounts the blocks from scratch and ``stats.py`` the counters. The model
(``replica.model``) and the second tier (``replica.store``) stand on this room; it sees
the tier through ``tier.py``'s protocol.
"""
