"""The multiaddr check at the coordinator's edge: a strict subset of what py-multiaddr
parses, never an exception, and a join or heartbeat carrying a bad address refused.
Then the rules of what is announced across hosts: wildcard listen addresses expanded
per interface, and what the coordinator keeps given the source IP it observed (also
through a real `Membership` and a real transport listening on 0.0.0.0)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multiaddr import Multiaddr

from coordinator.journal import Journal
from coordinator.membership import Membership, Peer
from protocol.addrs import (
    MAX_ADDRS,
    MAX_CHARS,
    announce_problem,
    expand_wildcards,
    is_loopback,
    is_wildcard,
    multiaddr_problem,
    observed,
    owner_problem,
)
from protocol.control import HeartbeatRequest, JoinRequest
from protocol.errors import ProtocolError
from protocol.identity import NodeKey, is_libp2p_private_key, libp2p_peer_id

PEER = NodeKey.generate().peer_id
GOOD = [
    f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}",
    "/ip4/10.0.0.7/tcp/0",
    "/ip6/::1/tcp/4001",
    "/dns4/node-3.example.org/tcp/443/wss",
    "/ip4/1.2.3.4/udp/4001/quic-v1",
    f"/ip4/1.2.3.4/tcp/4001/p2p/{PEER}/p2p-circuit/p2p/{PEER}",
    "/ip4/127.0.0.1/tcp/40000/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
]
BAD = [
    "garbage",
    "",
    "/",
    "/ip4/999.1.1.1/tcp/1",
    "/ip4/01.2.3.4/tcp/1",
    "/ip4/1.2.3.4/tcp/65536",
    "/ip4/1.2.3.4/tcp/-1",
    "/ip4/1.2.3.4/tcp",
    "/ip4/1.2.3.4/tcp/1/",
    "/ip6/fe80::1%eth0/tcp/1",
    "/dns4/-bad-.example/tcp/1",
    "/unix/tmp/sock",
    "/ip4/1.2.3.4/tcp/1/p2p/0OIl",
    "/ip4/1.2.3.4" + "/tcp/1" * 20,
    "/dns/" + "a" * MAX_CHARS,
]


@pytest.mark.parametrize("addr", GOOD)
def test_good_addresses_pass_and_py_multiaddr_agrees(addr: str) -> None:
    assert multiaddr_problem(addr) is None
    Multiaddr(addr)


@pytest.mark.parametrize("addr", BAD)
def test_bad_addresses_are_refused_with_a_reason(addr: str) -> None:
    problem = multiaddr_problem(addr)
    assert isinstance(problem, str) and problem


COMPONENT = st.one_of(
    st.sampled_from(["ip4", "ip6", "dns4", "tcp", "udp", "p2p", "quic-v1", "ws", "p2p-circuit",
                     "unix", "onion", ""]),
    st.text(alphabet="0123456789abcdef.:-%", max_size=12),
    st.sampled_from(["127.0.0.1", "::1", "4001", "65536", PEER, "example.org", "999.0.0.1"]),
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(COMPONENT, max_size=10))
def test_whatever_passes_parses_in_py_multiaddr(parts: list[str]) -> None:
    addr = "/" + "/".join(parts)
    if multiaddr_problem(addr) is None:
        Multiaddr(addr)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=600), st.binary(max_size=64), st.integers(), st.none()))
def test_any_input_gives_a_verdict_never_an_exception(value: object) -> None:
    assert multiaddr_problem(value) is None or isinstance(multiaddr_problem(value), str)


def test_dht_addresses_must_name_their_member() -> None:
    """A member's outer loop runs under its key: every DHT address it announces ends in
    its own peer id, relayed ones included; another peer's, or none, is refused."""
    other = NodeKey.generate().peer_id
    relayed = f"/ip4/203.0.113.7/tcp/4001/p2p/{other}/p2p-circuit/p2p/{PEER}"
    assert owner_problem([f"/ip4/10.0.0.1/tcp/1/p2p/{PEER}", relayed], PEER) is None
    assert owner_problem([], PEER) is None
    for bad in (f"/ip4/10.0.0.1/tcp/1/p2p/{other}", "/ip4/10.0.0.1/tcp/1",
                f"/ip4/203.0.113.7/tcp/4001/p2p/{PEER}/p2p-circuit/p2p/{other}"):  # fmt: skip
        assert multiaddr_problem(bad) is None
        assert "does not end in /p2p/" in (owner_problem([bad], PEER) or ""), bad


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=80), max_size=4))
def test_owner_problem_gives_a_verdict_never_an_exception(addrs: list[str]) -> None:
    assert owner_problem(addrs, PEER) is None or isinstance(owner_problem(addrs, PEER), str)


def test_the_libp2p_key_of_a_node_names_its_peer_id() -> None:
    key = NodeKey.generate()
    raw = key.libp2p_private_key()
    assert is_libp2p_private_key(raw) and libp2p_peer_id(raw) == key.peer_id
    assert raw[4:36] == key.seed  # the daemon's Ed25519 key: seed, then public key
    for bad in (raw[:-1], b"\x08\x02" + raw[2:], b""):
        assert not is_libp2p_private_key(bad)
        with pytest.raises(ProtocolError):
            libp2p_peer_id(bad)


@pytest.mark.parametrize(
    "addr", ["/ip4/203.0.113.7/tcp/4001", "/ip6/2001:db8::1/tcp/9", "/dns4/node.example/tcp/80"]
)
def test_an_announced_address_is_a_dialable_tcp_address(addr: str) -> None:
    assert announce_problem(addr) is None


@pytest.mark.parametrize(
    "addr",
    [
        "/ip4/0.0.0.0/tcp/4001",  # a wildcard cannot be dialled
        "/ip4/203.0.113.7/tcp/0",  # port 0 is a listen request, not an address
        "/ip4/203.0.113.7/udp/4001",
        "/ip4/203.0.113.7/tcp/4001/p2p/" + PEER,
        "/ip4/203.0.113.7",
        "203.0.113.7:4001",
    ],
)
def test_an_address_that_cannot_be_dialled_is_not_announced(addr: str) -> None:
    assert announce_problem(addr) is not None


@given(st.one_of(st.text(max_size=80), st.integers(), st.none()))
def test_announce_problem_gives_a_verdict_never_an_exception(value: object) -> None:
    assert announce_problem(value) is None or isinstance(announce_problem(value), str)


def test_a_join_or_heartbeat_with_a_bad_address_does_not_decode() -> None:
    ok = JoinRequest(addrs=[GOOD[0]], dht_addrs=[GOOD[6]])
    assert JoinRequest.from_wire(ok.to_wire()) == ok
    for field in ("addrs", "dht_addrs"):
        wire = {**ok.to_wire(), field: [GOOD[0], "garbage"]}
        with pytest.raises(ProtocolError, match=rf"{field}\[1\].*garbage"):
            JoinRequest.from_wire(wire)
    wire = {**HeartbeatRequest(dht_addrs=[GOOD[1]]).to_wire(), "dht_addrs": ["/ip4/1.2.3.4"]}
    assert HeartbeatRequest.from_wire(wire).dht_addrs == ["/ip4/1.2.3.4"]
    wire["dht_addrs"] = ["/nope"]
    with pytest.raises(ProtocolError, match="unsupported protocol"):
        HeartbeatRequest.from_wire(wire)


# --- across hosts ---------------------------------------------------------------------------

P2P = f"/p2p/{PEER}"
CIRCUIT = f"/ip4/10.1.0.1/tcp/4001/p2p/{NodeKey.generate().peer_id}/p2p-circuit{P2P}"


def test_a_wildcard_listen_address_becomes_one_per_interface() -> None:
    ips = ["127.0.0.1", "10.1.0.5", "192.168.7.2", "::1", "fd00::2", "fe80::1"]
    assert expand_wildcards([f"/ip4/0.0.0.0/tcp/4001{P2P}"], ips) == [
        f"/ip4/10.1.0.5/tcp/4001{P2P}",
        f"/ip4/192.168.7.2/tcp/4001{P2P}",
    ]
    assert expand_wildcards(["/ip6/::/tcp/9"], ips) == ["/ip6/fd00::2/tcp/9"]  # no link-local
    # a host with loopback only announces loopback (one machine, no network)
    assert expand_wildcards(["/ip4/0.0.0.0/tcp/9"], ["127.0.0.1", "::1"]) == [
        "/ip4/127.0.0.1/tcp/9"
    ]
    # concrete addresses stay, duplicates go; no interface of the family: nothing
    assert expand_wildcards(["/ip4/10.1.0.5/tcp/9", "/ip4/0.0.0.0/tcp/9"], ips[:2]) == [
        "/ip4/10.1.0.5/tcp/9"
    ]
    assert expand_wildcards(["/ip6/::/tcp/9"], ["10.0.0.1"]) == []


def test_the_coordinator_keeps_what_other_hosts_can_dial() -> None:
    announced = [
        f"/ip4/0.0.0.0/tcp/4001{P2P}",
        f"/ip4/127.0.0.1/tcp/4001{P2P}",
        f"/ip4/10.1.0.5/tcp/4001{P2P}",
        f"/ip6/::1/tcp/4002{P2P}",
        CIRCUIT,
    ]
    # from another host: no wildcard, no loopback, the observed IP (with the port) first
    assert observed(announced, "203.0.113.9") == [
        f"/ip4/203.0.113.9/tcp/4001{P2P}",
        f"/ip4/10.1.0.5/tcp/4001{P2P}",
        CIRCUIT,
    ]
    # from the coordinator's own host: loopback is how the others reach it
    assert observed(announced, "127.0.0.1") == announced[1:]
    # an IPv4-mapped source is its IPv4 address; an address already announced is kept once
    assert observed([f"/ip4/10.1.0.5/tcp/4001{P2P}"], "::ffff:10.1.0.5") == [
        f"/ip4/10.1.0.5/tcp/4001{P2P}"
    ]
    # unknown source (an observer): only the wildcard goes
    assert observed(announced, None) == announced[1:]
    # an outbound-only member (circuit addresses only) gets no observed address
    assert observed([CIRCUIT], "203.0.113.9") == [CIRCUIT]
    assert observed([], "203.0.113.9") == []


HOSTS = st.sampled_from(
    ["0.0.0.0", "127.0.0.1", "127.3.2.1", "10.0.0.1", "203.0.113.9", "::", "::1", "fd00::2"]
)
ADDR = st.one_of(
    st.builds(
        lambda h, port, tail: f"/ip{6 if ':' in h else 4}/{h}/tcp/{port}{tail}",
        HOSTS,
        st.integers(0, 65535),
        st.sampled_from(["", P2P, "/ws"]),
    ),
    st.just(CIRCUIT),
    st.text(max_size=40),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ADDR, max_size=12), st.one_of(st.none(), HOSTS, st.text(max_size=20)))
def test_observed_never_keeps_a_wildcard_nor_a_remote_loopback(
    addrs: list[str], source: str | None
) -> None:
    kept = observed(addrs, source)
    assert len(kept) <= MAX_ADDRS and len(set(kept)) == len(kept)
    assert all(multiaddr_problem(a) is None and not is_wildcard(a) for a in kept)
    if source in ("10.0.0.1", "203.0.113.9", "fd00::2"):
        assert not any(is_loopback(a) for a in kept)
    assert observed(kept, source) == kept  # a second pass changes nothing


def test_membership_stores_announced_addresses_as_observed() -> None:
    """A join from another host keeps no loopback address, and a heartbeat's DHT
    announcement is rewritten the same way; a join from the same host keeps them."""
    members = Membership(n_stages=1, stage_costs=[1.0], ttl_s=10.0, journal=Journal())
    dht = [f"/ip4/127.0.0.1/tcp/5000{P2P}", f"/ip4/10.1.0.5/tcp/5000{P2P}"]

    def peer(pid: str, source: str) -> Peer:
        return Peer(pid, b"k", 0, [f"/ip4/0.0.0.0/tcp/4001{P2P}", f"/ip4/127.0.0.1/tcp/4001{P2P}"],
                    list(dht), "cpu", 1.0, None, source, None, False, 0.0, 10.0)  # fmt: skip

    remote = members.join(peer("remote", "10.1.0.5"))
    assert list(remote.addrs) == [f"/ip4/10.1.0.5/tcp/4001{P2P}"]
    assert list(remote.dht_addrs) == [f"/ip4/10.1.0.5/tcp/5000{P2P}"]
    version = members.version
    members.announce(
        "remote", [f"/ip4/0.0.0.0/tcp/6000{P2P}", f"/ip4/127.0.0.1/tcp/6000{P2P}"], 1.0
    )
    assert (
        list(remote.dht_addrs) == [f"/ip4/10.1.0.5/tcp/6000{P2P}"]
        and members.version == version + 1
    )
    members.announce("remote", [f"/ip4/127.0.0.1/tcp/6000{P2P}"], 2.0)  # the same, rewritten
    assert members.version == version + 1
    local = members.join(peer("local", "127.0.0.1"))
    assert list(local.addrs) == [f"/ip4/127.0.0.1/tcp/4001{P2P}"] and list(local.dht_addrs) == dht
    assert all(not is_loopback(a) for p in members.delta(0).peers if p.peer_id == "remote"
               for a in [*p.addrs, *p.dht_addrs])  # fmt: skip


def test_a_transport_on_every_interface_announces_concrete_addresses() -> None:
    """The default listen address is 0.0.0.0; what the transport announces is the IP of
    each interface (loopback only where there is no other), never the wildcard, and a
    peer reaches it at the announced address."""
    import trio

    from node.config import NodeConfig
    from node.p2p.host import Libp2pTransport
    from node.p2p.interfaces import interface_ips
    from node.p2p.transport import P2PConfig
    from protocol.dataplane import Echo

    assert NodeConfig(coordinator="10.0.0.1:7700").listen == "/ip4/0.0.0.0/tcp/0"
    others = [ip for ip in interface_ips() if ":" not in ip and not ip.startswith("127.")]

    async def echo(remote: str, msg: object) -> object:
        return msg

    async def main() -> None:
        with trio.fail_after(60):
            server = Libp2pTransport(NodeKey.generate(), P2PConfig())
            server.set_handler("/agora-test/echo/1", echo)  # type: ignore[arg-type]
            client = Libp2pTransport(NodeKey.generate(), P2PConfig())
            async with server.run(), client.run():
                addrs = server.listen_addrs
                assert addrs and not any(is_wildcard(a) for a in addrs), addrs
                if others:
                    assert not any(is_loopback(a) for a in addrs), addrs
                    assert {a.split("/")[2] for a in addrs} <= set(others), addrs
                msg = Echo(seq=1, payload=b"across")
                reply = await client.request(
                    server.peer_id, addrs, "/agora-test/echo/1", msg, timeout=20
                )
                assert reply == msg

    trio.run(main)
