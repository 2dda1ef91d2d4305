"""Pure pieces of the coordinator's edge: source keys, buckets, per-source connection
counts, the buffer budget, the size bound of a member entry, and membership pages."""

from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.edge import ByteBudget, HostConnections, RateLimiter, host_key
from coordinator.journal import Journal
from coordinator.membership import Membership, Peer
from protocol import control as c
from protocol.addrs import MAX_ADDRS, MAX_CHARS, cap, fit
from protocol.codec import encode


def test_sources_are_ipv4_addresses_or_ipv6_slash_64s() -> None:
    assert host_key("10.1.2.3") == "10.1.2.3"
    assert host_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert (
        host_key("2001:db8:1:2:aaaa::1") == host_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    )
    assert host_key("2001:db8:1:3::1") != host_key("2001:db8:1:2::1")
    assert host_key("") == ""


def test_buckets_connections_and_the_buffer_budget() -> None:
    lim = RateLimiter(10.0, 3.0)
    assert [lim.allow("h", 0.0) for _ in range(4)] == [True, True, True, False]
    assert lim.allow("h", 0.1)  # one token back after 0.1 s at 10/s
    assert lim.allow("other", 0.1)
    lim.prune(10.0)
    assert len(lim) == 0
    off = RateLimiter(0.0, 1.0)
    assert all(off.allow("h", 0.0) for _ in range(1000)) and len(off) == 0

    conns = HostConnections(2)
    assert conns.enter("a") and conns.enter("a") and not conns.enter("a") and conns.enter("b")
    conns.leave("a")
    assert conns.count("a") == 1 and conns.enter("a")

    budget = ByteBudget(100)
    assert budget.resize(0, 60) and not budget.resize(0, 50) and budget.total == 60
    assert budget.resize(60, 80) and budget.resize(0, 20) and budget.total == 100
    assert budget.resize(80, 0) and budget.total == 20


def test_the_largest_member_entry_fits_its_bound_and_addresses_are_capped() -> None:
    addr = "/dns4/" + "a" * (MAX_CHARS - 15) + "/tcp/4001"
    assert len(addr) == MAX_CHARS
    peer = c.PeerInfo(
        peer_id="Q" * c.PEER_ID_LEN, stage=2**31, addrs=[addr] * MAX_ADDRS,
        dht_addrs=[addr] * MAX_ADDRS, device="d" * 64, throughput=1e12, deadline=2e9,
        observer=True,
    )  # fmt: skip
    assert len(encode(peer)) <= c.MAX_PEER_INFO_BYTES
    assert cap(["x" * (MAX_CHARS + 1)] + [addr] * 20) == [addr] * MAX_ADDRS
    good = "/ip4/10.0.0.1/tcp/4001"
    assert fit(["garbage", good] + [good] * 20) == [good] * MAX_ADDRS


def test_a_page_that_cannot_fit_the_reply_frame_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match="membership_page_peers"):
        CoordinatorConfig(max_frame_bytes=1 << 20, membership_page_peers=512)
    CoordinatorConfig(
        max_frame_bytes=1 << 20,
        max_request_bytes=1 << 16,
        membership_page_peers=200,
        shard_tokens=1 << 16,
    )


def _peer(i: int) -> Peer:
    return Peer(f"p{i:04d}", b"", i % 2, [], [], "cpu", 1.0, None, None, None, False, 0.0, 100.0)


def _follow(
    m: Membership, version: int, peers: dict[str, c.PeerInfo], page: int
) -> tuple[int, int]:
    """The client's paging rule on a pure Membership; returns (version, pages)."""
    pages = 0
    reply = m.delta(version, page=page)
    while True:
        pages += 1
        if reply.full:
            base, fresh = reply.version, {p.peer_id: p for p in reply.peers}
            while reply.more:
                reply = m.delta(0, after=reply.cursor, page=page)
                pages += 1
                fresh.update((p.peer_id, p) for p in reply.peers)
            peers.clear()
            peers.update(fresh)
            version = base
            if reply.version == base:
                return version, pages
        else:
            for p in reply.peers:
                peers[p.peer_id] = p
            for pid in reply.left:
                peers.pop(pid, None)
            version = reply.version
            if not reply.more:
                return version, pages
        reply = m.delta(version, page=page)


def test_membership_pages_add_up_to_the_view_even_when_it_changes_between_pages() -> None:
    m = Membership(n_stages=2, stage_costs=[1.0, 1.0], ttl_s=10.0, journal=Journal())
    for i in range(0, 100):
        m.join(_peer(i))
    first = m.delta(0, page=30)
    assert first.full and first.more and len(first.peers) == 30 and first.cursor == "p0029"
    # changes while the client reads the full view's pages: a join before the cursor, a
    # leave of one already read and of one not yet read
    m.join(_peer(5000))
    m.remove("p0003", "left")
    m.remove("p0090", "left")
    m.join(Peer("a-first", b"", 0, [], [], "cpu", 1.0, None, None, None, False, 0.0, 1.0))
    peers: dict[str, c.PeerInfo] = {}
    version, pages = _follow(m, 0, peers, 30)
    assert set(peers) == set(m.live) and version == m.version and pages >= 4
    for i in range(100, 180):
        m.join(_peer(i))
    m.remove("p0004", "left")
    delta = m.delta(version, page=30)
    assert not delta.full and delta.more and len(delta.peers) + len(delta.left) == 30
    version, pages = _follow(m, version, peers, 30)
    assert set(peers) == set(m.live) and version == m.version and pages == 3
    assert m.delta(version, page=30).peers == []
