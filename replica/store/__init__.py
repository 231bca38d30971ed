"""The second cache tier: a node-shared store of evicted KV blocks, and disk behind it.

``layout`` (the shared-memory format), ``node_store`` (the set-associative store),
``files`` (opening and sweeping a node's store files), ``disk`` (the disk tier), ``tier``
(what an engine does with them: spill, restore), ``config`` (``store:`` in the config),
``build`` (a replica's tier from its config).
"""
