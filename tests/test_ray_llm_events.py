"""The hub that shows Ray Serve LLM's lifecycle reports to our drop-in router
(``cluster.ray_llm_events``), on a stand-in for Ray's tracker: only its one method, which the
hub wraps (the whole path, with Ray's real tracker, is ``tests/test_ray_llm_dropin.py``)."""

from __future__ import annotations

import asyncio
import gc

from cluster.ray_llm_events import listen


class Tracker:
    """Ray's ``KVTokenTracker`` as the hub sees it: ``on_lifecycle_events`` and nothing else."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, tuple[object, ...]]] = []

    async def on_lifecycle_events(self, events: list[tuple[str, tuple[object, ...]]]) -> None:
        self.applied.extend(events)


class Listener:
    def __init__(self, fail: bool = False) -> None:
        self.heard: list[tuple[str, str]] = []
        self.fail = fail

    def prefill_reported(self, request_id: str) -> None:
        self.heard.append(("prefill", request_id))
        if self.fail:
            raise RuntimeError("a defect in one router")

    def end_reported(self, request_id: str) -> None:
        self.heard.append(("end", request_id))


BATCH = [
    ("on_prefill_complete", ("a",)),
    ("on_decode_progress", ("a", 3)),
    ("on_request_completed", ("a",)),
    ("on_request_completed", ("b",)),
]


def test_every_listener_hears_the_batch_in_order_and_the_tracker_still_applies_it() -> None:
    tracker = Tracker()
    first, second = Listener(), Listener(fail=True)
    assert listen(first, tracker) and listen(second, tracker)
    asyncio.run(tracker.on_lifecycle_events(BATCH))
    heard = [("prefill", "a"), ("end", "a"), ("end", "b")]
    assert first.heard == heard
    assert second.heard == heard  # its failure on "a" cost nobody an event
    assert tracker.applied == BATCH  # Ray's own tracker gets every event, decode progress too


def test_the_hub_is_installed_once_and_holds_routers_weakly() -> None:
    tracker = Tracker()
    kept, dropped = Listener(), Listener()
    listen(kept, tracker)
    listen(dropped, tracker)
    hub_method = tracker.on_lifecycle_events
    listen(kept, tracker)  # again: neither a second wrapper nor a second delivery
    assert tracker.on_lifecycle_events == hub_method
    del dropped  # a rebuilt handle's router replaces it; nobody unregisters the old one
    gc.collect()
    asyncio.run(tracker.on_lifecycle_events(BATCH[:1]))
    assert kept.heard == [("prefill", "a")]
    assert tracker.applied == BATCH[:1]


def test_without_a_tracker_in_the_process_there_is_nothing_to_hear() -> None:
    assert listen(Listener()) is False  # not behind Ray Serve LLM's KV-aware ingress
