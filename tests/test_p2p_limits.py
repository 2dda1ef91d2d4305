"""Unit tests of node.p2p.limits with a fake clock (no sockets, no sleeps)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.p2p import metrics
from node.p2p.limits import BanList, LimitsConfig, PeerLimits, Refusal, TokenBucket


def _count(counter: object, **labels: str) -> float:
    c = counter.labels(**labels) if labels else counter  # type: ignore[attr-defined]
    return float(c._value.get())


def test_token_bucket_refills_at_its_rate_up_to_capacity() -> None:
    b = TokenBucket(rate=2.0, capacity=3.0, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.wait_time(0.0) == pytest.approx(0.5)
    assert b.take(0.5) and not b.take(0.5)
    assert b.is_full(100.0) and b.tokens == 3.0


@given(st.lists(st.tuples(st.floats(0, 10), st.booleans()), max_size=50))
def test_token_bucket_never_exceeds_capacity_or_goes_negative(
    steps: list[tuple[float, bool]],
) -> None:
    b = TokenBucket(rate=5.0, capacity=4.0, now=0.0)
    now = 0.0
    for dt, take in steps:
        now += dt
        if take:
            b.take(now)
        assert 0.0 <= b.tokens <= 4.0


def test_stream_cap_is_per_peer_and_released() -> None:
    lim = PeerLimits(LimitsConfig(max_streams_per_peer=2, rate_per_s=1e6, burst=1e6))
    before = _count(metrics.REFUSED, reason="streams")
    assert lim.admit_stream("a", 0.0) is None
    assert lim.admit_stream("a", 0.0) is None
    assert lim.admit_stream("a", 0.0) is Refusal.STREAMS
    assert lim.admit_stream("b", 0.0) is None  # another peer is unaffected
    assert _count(metrics.REFUSED, reason="streams") == before + 1
    lim.release_stream("a", 0.0)
    assert lim.streams("a") == 1
    assert lim.admit_stream("a", 0.0) is None


def test_rate_limit_refuses_then_recovers() -> None:
    lim = PeerLimits(LimitsConfig(rate_per_s=10.0, burst=2.0))
    assert lim.admit_stream("a", 0.0) is None
    assert lim.admit_request("a", 0.0) is None
    assert lim.admit_request("a", 0.0) is Refusal.RATE
    assert lim.retry_after("a", 0.0) == pytest.approx(0.1)
    assert lim.admit_request("a", 0.1) is None


def test_bytes_in_flight_cap() -> None:
    lim = PeerLimits(LimitsConfig(max_bytes_in_flight_per_peer=100))
    assert lim.admit_stream("a", 0.0) is None
    assert lim.reserve_bytes("a", 60)
    assert not lim.reserve_bytes("a", 41)
    lim.release_bytes("a", 60)
    assert lim.reserve_bytes("a", 100)
    assert lim.bytes_in_flight("a") == 100
    assert not lim.reserve_bytes("never-admitted", 1)


def test_bytes_in_flight_are_capped_for_all_peers_together() -> None:
    lim = PeerLimits(LimitsConfig(max_bytes_in_flight_per_peer=100, max_bytes_in_flight_total=250))
    for peer in "abc":
        assert lim.admit_stream(peer, 0.0) is None
    assert lim.reserve_bytes("a", 100) and lim.reserve_bytes("b", 100)
    assert not lim.reserve_bytes("c", 51)  # under c's own cap, over the total
    assert lim.reserve_bytes("c", 50) and lim.total_bytes_in_flight == 250
    lim.release_bytes("a", 100)
    lim.release_bytes("a", 100)  # a second release of the same bytes frees nothing
    assert lim.total_bytes_in_flight == 150 and lim.reserve_bytes("c", 50)
    with pytest.raises(ValueError, match="total"):
        LimitsConfig(max_bytes_in_flight_per_peer=100, max_bytes_in_flight_total=99)


def test_membership_filter_refuses_non_members_and_can_change() -> None:
    members = {"a"}
    lim = PeerLimits(LimitsConfig(), allow=lambda p: p in members)
    before = _count(metrics.REFUSED, reason="not_member")
    assert lim.admit_stream("x", 0.0) is Refusal.NOT_MEMBER
    assert lim.admit_stream("a", 0.0) is None
    members.discard("a")
    assert lim.admit_request("a", 0.0) is Refusal.NOT_MEMBER  # checked per request too
    assert _count(metrics.REFUSED, reason="not_member") == before + 2
    lim.set_membership(lambda p: True)
    assert lim.admit_stream("x", 0.0) is None


def test_ban_backs_off_exponentially_and_caps() -> None:
    cfg = LimitsConfig(ban_base_s=10.0, ban_max_s=35.0, strike_forget_s=1000.0)
    lim = PeerLimits(cfg)
    bans_before = _count(metrics.BANS)
    assert lim.strike("a", 0.0) == 10.0
    assert lim.admit_stream("a", 5.0) is Refusal.BANNED
    assert lim.retry_after("a", 5.0) == pytest.approx(5.0)
    assert lim.admit_stream("a", 10.0) is None  # ban expired
    lim.release_stream("a", 10.0)
    assert lim.strike("a", 11.0) == 20.0
    assert lim.strike("a", 12.0) == 35.0  # capped (would be 40)
    assert lim.admit_stream("a", 46.9) is Refusal.BANNED
    assert _count(metrics.BANS) == bans_before + 3
    assert lim.strike("a", 5000.0) == 10.0  # a clean stretch forgets the strikes


def test_idle_peers_are_forgotten_and_ban_list_is_bounded() -> None:
    cfg = LimitsConfig(max_tracked_peers=3, rate_per_s=1.0, burst=1.0, strike_forget_s=1.0)
    lim = PeerLimits(cfg)
    for i in range(10):
        assert lim.admit_stream(f"p{i}", float(i)) is None
        lim.release_stream(f"p{i}", float(i) + 2.0)  # bucket full again: state dropped
    assert lim.tracked_peers == 0
    bans = BanList(cfg)
    for i in range(10):
        bans.ban(f"p{i}", float(i))
    assert len(bans) <= 3
    assert bans.banned_for("p9", 9.0) > 0  # the newest ban is kept


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_streams_per_peer": 0},
        {"rate_per_s": 0.0},
        {"burst": 0.5},
        {"ban_base_s": 100.0, "ban_max_s": 10.0},
        {"max_tracked_peers": 0},
    ],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LimitsConfig(**kwargs)  # type: ignore[arg-type]
