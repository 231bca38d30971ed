"""Ray Serve LLM's request lifecycle events, heard by our router in the same ingress process.

On the path where Ray Serve LLM's ingress hands a router the prompt's token ids (direct
streaming), it picks a replica with ``choose_replica(_reserve=False)`` and sends the request
through HAProxy: Serve never tells the request router that a request was routed, that it
produced its first token, or that it ended (``on_request_routed`` and
``on_request_completed`` are called only on the reserving path). Ray's own ``KVAwareRouter``
learns all three another way: every vLLM replica reports ``on_prefill_complete`` and
``on_request_completed`` (by Serve request id) to every ingress replica, whose
``KVTokenTracker.on_lifecycle_events`` applies them to Dynamo's selection service.

``listen`` puts a hub in front of that one method of this process's tracker: each batch is
shown to the registered routers, then applied by the tracker as before (it still works, and
idles as before where ``ai-dynamo`` is missing). The hub is installed once per tracker;
routers are held weakly, so a rebuilt handle's router replaces its predecessor without
anyone unregistering.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker import (
    KVTokenTracker,
    get_kv_token_tracker,
)

log = logging.getLogger("ray.serve")
Events = Sequence[tuple[str, tuple[object, ...]]]  # (hook name, its arguments), in order
HEARD: Mapping[str, str] = {  # the tracker's hooks a listener hears -> its method
    "on_prefill_complete": "prefill_reported",
    "on_request_completed": "end_reported",
}


class LifecycleListener(Protocol):
    """What a router hears (called on the ingress's loop: hop to your own)."""

    def prefill_reported(self, request_id: str) -> None:
        """A replica produced the request's first token."""

    def end_reported(self, request_id: str) -> None:
        """A replica finished the request (done, failed or cancelled)."""


class LifecycleHub:
    """The tracker's ``on_lifecycle_events``, shown first to every live listener."""

    def __init__(self, apply: Callable[[Events], Awaitable[None]]) -> None:
        self._apply = apply
        self._listeners: weakref.WeakSet[LifecycleListener] = weakref.WeakSet()

    def add(self, listener: LifecycleListener) -> None:
        self._listeners.add(listener)

    async def on_lifecycle_events(self, events: Events) -> None:
        for hook, args in events:
            if hook not in HEARD or not args or not isinstance(args[0], str):
                continue
            for listener in list(self._listeners):
                try:
                    getattr(listener, HEARD[hook])(args[0])
                except Exception:  # one listener's defect must not cost the tracker its events
                    log.exception("a router failed on lifecycle event %s", hook)
        await self._apply(events)


def listen(listener: LifecycleListener, tracker: KVTokenTracker | None = None) -> bool:
    """Show ``listener`` every lifecycle event this process's tracker receives; False when
    there is no tracker (not behind a KV-aware Ray Serve LLM ingress, or not yet built)."""
    tracker = tracker if tracker is not None else get_kv_token_tracker()
    if tracker is None:
        return False
    hub = getattr(tracker, "_prefix_serve_hub", None)
    if not isinstance(hub, LifecycleHub):
        hub = LifecycleHub(tracker.on_lifecycle_events)
        tracker._prefix_serve_hub = hub  # type: ignore[attr-defined]
        tracker.on_lifecycle_events = hub.on_lifecycle_events  # type: ignore[method-assign]
    hub.add(listener)
    return True
