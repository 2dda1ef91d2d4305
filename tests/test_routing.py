"""Unit tests for the next-hop router."""

from __future__ import annotations

import random

from node.routing import Router


def _router(**kw: float) -> Router:
    return Router(rng=random.Random(0), **kw)  # type: ignore[arg-type]


def test_prefers_the_faster_peer_and_spreads_load() -> None:
    r = _router(jitter=0.0)
    r.succeeded("fast", 0.1, now=0)
    r.succeeded("slow", 1.0, now=0)
    assert r.choose(["fast", "slow"], now=0) == "fast"
    for _ in range(8):  # queueing on the fast peer eventually makes the slow one cheaper
        r.started("fast")
    assert r.choose(["fast", "slow"], now=0) == "slow"


def test_jitter_spreads_ties() -> None:
    r = _router(jitter=0.5)
    picks = {r.choose(["a", "b", "c"], now=0) for _ in range(100)}
    assert picks == {"a", "b", "c"}


def test_failures_ban_with_doubling_backoff_and_success_resets() -> None:
    r = _router(jitter=0.0, ban_base_s=1.0, ban_max_s=5.0)
    assert [r.failed("a", now=0) for _ in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert r.choose(["a", "b"], now=4.9) == "b"
    assert r.choose(["a"], now=4.9) is None
    assert r.choose(["a"], now=5.1) == "a"
    r.succeeded("a", 0.2, now=0)
    assert r.failed("a", now=10) == 1.0


def test_exclude_and_forget() -> None:
    r = _router(jitter=0.0)
    assert r.choose(["a", "b"], now=0, exclude={"a"}) == "b"
    r.started("a")
    r.started("b")
    r.forget({"b"})
    assert set(r.peers) == {"b"}


def test_a_new_peer_is_tried_next_to_a_fast_measured_one() -> None:
    """A replica that just joined is assumed as fast as the fastest known peer, so it
    gets traffic (and a measurement) instead of starving behind a busy fast peer."""
    r = Router(jitter=0.0)
    r.started("fast")
    r.succeeded("fast", 0.05, now=0)  # far faster than the prior
    r.started("fast")
    r.started("fast")  # two in flight
    assert r.choose(["fast", "new"], now=0.0) == "new"


def test_a_peer_measured_slow_once_is_retried_when_its_estimate_ages() -> None:
    """One slow first reply (a cold joiner) must not starve a replica for good: its
    estimate drifts back to the fastest peer's while it goes unmeasured."""
    r = Router(jitter=0.0, stale_half_life_s=10.0)
    for _ in range(5):  # cold start: 8x the survivor
        r.started("joiner")
        r.succeeded("joiner", 1.8, now=0.0)
    for t in range(1, 8):
        r.started("survivor")
        r.succeeded("survivor", 0.22, now=float(t))
    r.started("survivor")  # one in flight: the freshly measured survivor still wins
    assert r.choose(["survivor", "joiner"], now=8.0) == "survivor"
    r.started("survivor")
    r.started("survivor")  # three in flight, as a stage-0 node keeps them
    assert r.choose(["survivor", "joiner"], now=40.0) == "joiner"
    # a fresh measurement counts in full again
    r.started("joiner")
    r.succeeded("joiner", 1.8, now=40.0)
    assert r.seconds_per_item("joiner", now=40.0) > 1.0
