"""The Serve adapter: everything of ``router/`` that knows Ray Serve, and nothing else.

``router.py`` is the ``RequestRouter`` Serve builds in the ingress's process (it calls the
routing core, ``router.core``, the simulator's too), ``ranking.py`` reads Serve's request and
hands back its ranking, ``queue_lengths.py`` reads Serve's queue-length cache as a column, and
``link.py`` is the ingress's line to that router (and names the calls it makes, so the
router can tell them apart). Every use of Serve's private modules is in this room
(``tests/test_architecture.py`` holds it); the decision itself has no Ray in it.
"""
