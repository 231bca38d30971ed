"""The cross-replica block index: the contract between the replicas that publish their
cached blocks and the routers that read it, with no engine and no Ray in it.

``hashing.py`` is the one block hash (engine, ingress, router and index all use it);
``records.py`` the records the index answers and books; ``config.py`` where Redis is and
how long anyone waits; ``scripts.py`` the Lua that keeps the key layout (``keys`` in
``config.py``); ``writer.py`` what a replica does (register, publish, heartbeat,
deregister); ``reader.py`` what a router does (query, book, release, with a breaker).
"""
