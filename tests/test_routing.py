"""Unit tests for the next-hop router."""

from __future__ import annotations

import dataclasses
import random

import pytest

from node.p2p.inproc import FaultPlan, InProcessNetwork
from node.peer_view import PeerView, proof_s
from node.routing import Router
from protocol.control import PeerInfo, RunInfo


def _router(**kw: float) -> Router:
    """A seeded router; deterministic choices (no exploration) unless `explore` is given."""
    return Router(rng=random.Random(0), **{"explore": 0.0, **kw})  # type: ignore[arg-type]


def test_prefers_the_faster_peer_and_spreads_load() -> None:
    r = _router(jitter=0.0)
    r.succeeded("fast", 0.1, now=0)
    r.succeeded("slow", 1.0, now=0)
    assert r.choose(["fast", "slow"], now=0) == "fast"
    for _ in range(10):  # queueing on the fast peer eventually makes the slow one cheaper
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
    r = Router(jitter=0.0, explore=0.0)
    r.started("fast")
    r.succeeded("fast", 0.05, now=0)  # far faster than the prior
    r.started("fast")
    r.started("fast")  # two in flight
    assert r.choose(["fast", "new"], now=0.0) == "new"


def test_a_replica_seen_with_another_before_either_answered_is_still_tried() -> None:
    """Two replicas enter the router before either is measured; one answers fast. With
    one micro-batch in flight at a time the other must still win choices: it stands at
    the fastest measured estimate until it is measured itself."""
    r = _router(jitter=0.2)
    picks = {"a": 0, "b": 0}
    for i in range(200):
        peer = r.choose(["a", "b"], now=float(i))
        assert peer is not None
        picks[peer] += 1
        r.started(peer)
        r.succeeded(peer, 0.04, now=float(i))
    assert r.seconds_per_item("b", 0.0) == pytest.approx(r.seconds_per_item("a", 0.0))
    assert min(picks.values()) >= 50, picks


def test_a_replica_rated_slow_by_one_bad_reply_is_measured_again_soon() -> None:
    """One reply 50 x slower than the other replica's (a stall at the peer):
    exploration sends it a micro-batch within a few dozen choices, long before ageing
    alone (10 s half-life) brings it back, and its fast reply restores its share."""
    r = _router(explore=0.05)
    for peer, secs in (("a", 0.02), ("b", 0.02), ("b", 1.0)):
        r.started(peer)
        r.succeeded(peer, secs, now=0.0)
    picks = {"a": 0, "b": 0}
    for i in range(400):  # 4 s of 10 ms choices, one micro-batch in flight
        now = i * 0.01
        peer = r.choose(["a", "b"], now=now)
        assert peer is not None
        picks[peer] += 1
        r.started(peer)
        r.succeeded(peer, 0.02, now=now)
    assert picks["b"] >= 50, picks  # without exploration: 0 in these 4 s


def test_a_peer_measured_slow_once_is_retried_when_its_estimate_ages() -> None:
    """One slow first reply (a cold joiner) must not starve a replica for good: its
    estimate drifts back to the fastest peer's while it goes unmeasured."""
    r = Router(jitter=0.0, explore=0.0, stale_half_life_s=10.0)
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
    # a fresh slow measurement counts again, from the aged estimate
    r.started("joiner")
    aged = r.seconds_per_item("joiner", now=40.0)
    r.succeeded("joiner", 1.8, now=40.0)
    assert r.seconds_per_item("joiner", now=40.0) == pytest.approx(aged * (1.8 / aged) ** r.ema)


def test_a_fast_reply_after_the_gap_keeps_the_replica_rated_fast() -> None:
    """The first reply after the estimate aged updates the aged estimate. Updating the
    stored one set a replica that answered in 0.2 s back from 0.31 s/item (aged) to 1.17,
    five times the survivor's, and it starved again until that aged away."""
    r = Router(jitter=0.0, explore=0.0)
    for _ in range(5):  # cold start
        r.started("joiner")
        r.succeeded("joiner", 1.8, now=0.0)
    for t in range(1, 41):
        r.started("survivor")
        r.succeeded("survivor", 0.22, now=float(t))
    for _ in range(3):
        r.started("survivor")
    assert r.choose(["survivor", "joiner"], now=40.0) == "joiner"
    r.started("joiner")
    r.succeeded("joiner", 0.2, now=40.0)  # it is fast now
    assert r.seconds_per_item("joiner", now=40.0) < 0.3
    assert r.choose(["survivor", "joiner"], now=40.5) == "joiner"


def test_an_unreachable_peer_stays_down_until_a_late_enough_view_lists_it() -> None:
    r = _router(jitter=0.0, ban_base_s=1.0)
    r.succeeded("a", 0.1, now=0)
    r.succeeded("b", 1.0, now=0)
    r.failed("a", now=5, unreachable=True)
    # its ban lapsed long ago, and it is the faster peer: still not chosen while b is up
    assert r.is_down("a") and r.choose(["a", "b"], now=100) == "b"
    assert r.usable(["a", "b"], now=100) == ["b"]
    r.failed("b", now=100)  # b times out: banned, not down; a stays out all the same
    assert r.choose(["a", "b"], now=100.5) is None
    assert r.listed(["a", "b"], failed_before=4.9) == []  # asked too soon after the failure
    assert r.is_down("a")
    assert r.listed(["a", "b"], failed_before=5.0) == ["a"]
    assert not r.is_down("a") and r.choose(["a", "b"], now=100.5) == "a"  # ban lifted too


def test_a_timeout_or_bad_reply_keeps_the_lapsing_ban() -> None:
    r = _router(jitter=0.0, ban_base_s=1.0)
    r.succeeded("a", 0.1, now=0)
    r.succeeded("b", 1.0, now=0)
    r.failed("a", now=0)
    assert not r.is_down("a") and r.choose(["a", "b"], now=0.5) == "b"
    assert r.choose(["a", "b"], now=1.5) == "a"


def test_when_every_candidate_is_down_they_are_tried_once_their_bans_lapse() -> None:
    r = _router(jitter=0.0, ban_base_s=1.0)
    r.failed("a", now=0, unreachable=True)
    r.failed("b", now=0, unreachable=True)
    assert r.choose(["a", "b"], now=0.5) is None
    assert r.choose(["a", "b"], now=1.5) in {"a", "b"}
    assert r.choose(["a", "b"], now=1.5, exclude={"a"}) == "b"


def test_the_view_revives_a_down_peer_that_rejoined_with_new_addresses() -> None:
    network = InProcessNetwork(FaultPlan())
    me, other = network.transport("me"), "peer-a"
    router = _router(jitter=0.0)
    view = PeerView(me, router, stage=0)

    def info(addrs: list[str]) -> dict[str, PeerInfo]:
        return {other: PeerInfo(peer_id=other, stage=1, addrs=addrs, device="cpu", throughput=0)}

    view.update(1, info(["/ip4/127.0.0.1/tcp/4001"]))
    router.failed(other, now=0, unreachable=True)
    view.update(2, info(["/ip4/127.0.0.1/tcp/4001"]))  # the same entry: no evidence
    assert router.is_down(other)
    view.update(3, info(["/ip4/127.0.0.1/tcp/4002"]))  # a new process listens elsewhere
    assert not router.is_down(other)
    router.failed(other, now=1, unreachable=True)
    view.update(4, {})  # it left the view: forgotten, fresh if it comes back
    assert other not in router.peers


def test_proof_covers_the_peer_ttl_a_sweep_and_a_heartbeat() -> None:
    run = RunInfo(
        run_id="r", model_preset="tiny", n_stages=2, codec="c", seed=0,
        heartbeat_interval_s=1.0, lease_ttl_s=5.0, dataset_name="d", dataset_hash="h",
        shards=1, data_epoch=0, sweep_interval_s=0.5,
    )  # fmt: skip
    assert proof_s(run) == 6.5
    # a coordinator that does not say its sweep interval: assume the longest it may be
    assert proof_s(dataclasses.replace(run, sweep_interval_s=0.0)) == 11.0


def test_affinity_keeps_a_preferred_peer_until_it_is_far_slower() -> None:
    r = _router(jitter=0.0, affinity=3.0)
    r.succeeded("fast", 0.1, now=0)
    r.succeeded("paired", 0.25, now=0)
    assert r.choose(["fast", "paired"], now=0) == "fast"  # no preference given
    assert r.choose(["fast", "paired"], now=0, prefer=["paired"]) == "paired"
    r.succeeded("paired2", 0.2, now=0)  # of two paired peers, the sooner one
    assert r.choose(["fast", "paired", "paired2"], now=0, prefer=["paired", "paired2"]) == (
        "paired2"
    )
    for _ in range(2):  # queued work counts: 3 x 0.25 s against 0.1 s is past 3 x
        r.started("paired")
    assert r.choose(["fast", "paired"], now=0, prefer=["paired"]) == "fast"
    # banned, down or excluded, the preferred peer is not chosen
    assert r.choose(["fast", "paired"], now=0, exclude={"paired"}, prefer=["paired"]) == "fast"
    r.failed("fast", now=0, unreachable=True)
    assert r.choose(["fast", "paired"], now=0, prefer=["paired"]) == "paired"
    off = _router(jitter=0.0)
    off.succeeded("fast", 0.1, now=0)
    off.succeeded("paired", 0.25, now=0)
    assert off.choose(["fast", "paired"], now=0, prefer=["paired"]) == "fast"
