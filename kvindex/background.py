"""A loop on a daemon thread of its own, until stopped: the shape of the background Redis
clients (``kvindex.mirror``'s follower, the ingress's metrics share), written once."""

from __future__ import annotations

import threading
from typing import Self

JOIN_S = 5.0  # a stop waits this long for the loop's current pass, then goes on


class Background:
    """Runs ``_run`` on a daemon thread named ``thread_name`` from ``start()``; ``_run``
    loops until ``_stop`` is set (waiting on it between passes, so a stop is heard at once);
    ``_halt()`` sets it and waits for the thread. Subclasses call ``super().__init__()``."""

    thread_name = "background"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(JOIN_S)

    def _run(self) -> None:
        raise NotImplementedError
