"""The multiaddr check at the coordinator's edge: a strict subset of what py-multiaddr
parses, never an exception, and a join or heartbeat carrying a bad address refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multiaddr import Multiaddr

from protocol.addrs import MAX_CHARS, multiaddr_problem
from protocol.control import HeartbeatRequest, JoinRequest
from protocol.errors import ProtocolError
from protocol.identity import NodeKey

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
