"""Whether Serve has begun stopping this replica (scale-in, redeploy, ``serve shutdown``).

Serve gives a replica no call when it starts to stop it: it stops routing to it, waits for
its ongoing requests (polling every ``graceful_shutdown_wait_loop_s``) and only then calls
``__del__``. A replica that wants to move its streams instead of waiting reads the flag its
own Serve replica object sets first (``_shutting_down``), found once through the worker's
actor table. Ray's internals, pinned with Ray (``tests/test_moves.py`` fails if they
change): where the flag cannot be found, ``stopping`` answers False and the replica drains
as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("ray.serve")


def stop_flag() -> Callable[[], bool] | None:
    """A cheap check of this replica's stop flag (None: not in a Serve replica, or Ray's
    layout changed)."""
    try:
        import ray

        actors = ray._private.worker.global_worker.actors
    except Exception:
        return None
    for actor in list(actors.values()):
        impl = getattr(actor, "_replica_impl", None)
        if impl is not None and isinstance(getattr(impl, "_shutting_down", None), bool):
            return lambda impl=impl: bool(impl._shutting_down)  # type: ignore[misc]
    log.warning("Serve's stop flag not found: this replica drains instead of moving streams")
    return None
