"""``RecentWork``: the decayed work a router sent each replica (exact values, tiny fleets)."""

from __future__ import annotations

import pytest

from router.recent_work import RESCALE_AT, RecentWork


def test_a_score_halves_for_every_half_life_of_work_routed_per_replica() -> None:
    work = RecentWork(half_life_tokens=100)
    work.record("a", 50, replicas=2)
    assert work.score("a") == pytest.approx(50)  # new work is counted whole
    work.record("b", 200, replicas=2)  # one half-life of 2 replicas' work
    assert work.score("a") == pytest.approx(25)
    assert work.score("b") == pytest.approx(200)
    work.record("a", 100, replicas=4)  # half a half-life of 4 replicas' work
    assert work.score("b") == pytest.approx(200 * 0.5**0.25)
    assert work.score("never") == 0.0
    work.check()


def test_the_same_work_later_weighs_more_and_columns_compare_like_scores() -> None:
    work = RecentWork(half_life_tokens=10)
    for rid in ("a", "b", "c"):
        work.record(rid, 30, replicas=3)
    column = work.column(["c", "b", "a", "new"]).tolist()
    assert column == sorted(column, reverse=True) and column[-1] == 0.0
    assert [work.score(r) for r in "abc"] == sorted(work.score(r) for r in "abc")


def test_rescaling_keeps_every_score_and_forgets_the_long_gone() -> None:
    work = RecentWork(half_life_tokens=1)
    work.record("gone", 1_000, replicas=1)
    steps = 0
    while work.scores._scale * 2.0**64 <= RESCALE_AT:  # up to just below a rescale
        work.record("live", 64, replicas=1)
        steps += 1
    before = work.score("live")
    work.record("live", 64, replicas=1)  # this one rescales
    assert work.scores._scale < 2.0**65 and steps > 0
    assert work.score("live") == pytest.approx(before * 2.0**-64 + 64)
    assert "gone" not in work.scores  # decayed to nothing: dropped, not kept forever
    work.check()


def test_nothing_routed_changes_nothing_and_a_half_life_must_be_positive() -> None:
    work = RecentWork()
    work.record("a", 0, replicas=4)
    assert work.score("a") == 0.0 and work.scores._scale == 1.0
    with pytest.raises(ValueError):
        RecentWork(half_life_tokens=0)
