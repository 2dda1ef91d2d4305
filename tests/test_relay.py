"""Outbound-only peers reached through a circuit-relay v2 hop.

- In process: a hop relay, an outbound-only destination (`listen=[]`) that reserves a
  slot on it and announces only its circuit address, and a source that reaches it by
  that address alone; Noise + Yamux run end to end over the relayed stream.
- The hop serves members only: a stranger's reservation and circuit are refused, a
  member's work, and a circuit is cut at its duration (in process, a node's hop) and at
  its byte limit (the coordinator's relay child, which learns the live members from the
  coordinator; the member's reservation is refused until it joins, then held).
- Multi-process: `agora-coordinator --relay` runs the hop as a child; a normal stage-0
  node and two `--no-listen` nodes (stage 0 and stage 1, taking the coordinator's relay)
  train. The only stage-1 replica accepts no connections, so every forward crosses the
  relay; it must serve them. Then a clean stop (exit 0 everywhere, the relay child
  gone) and `agora audit` finds no lost or duplicated ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from coordinator_harness import write_config

from node.config import NodeConfig
from node.coordinator_client import CoordinatorClient
from node.p2p import metrics
from node.p2p.host import Libp2pTransport
from node.p2p.relay import RelayAddressError, parse_relay_addr
from node.p2p.relay_main import MAX_MEMBERS, announced_addrs, parse_members
from node.p2p.transport import P2PConfig, TransportError
from protocol import control as c
from protocol.dataplane import Echo
from protocol.identity import NodeKey
from swarmlab.coordinator import start_coordinator
from swarmlab.swarm import LocalSwarm

START_S = 150.0  # seconds for the processes to import torch, reserve and join (loaded box)
TRAIN_S = 120.0  # seconds for tokens to rise through the relay
ECHO = "/agora-test/echo/1"


# --- pure pieces --------------------------------------------------------------------------


def test_relay_addresses_are_checked() -> None:
    key = NodeKey.generate()
    tcp, pid = parse_relay_addr(f"/ip4/10.0.0.1/tcp/4001/p2p/{key.peer_id}")
    assert str(tcp) == "/ip4/10.0.0.1/tcp/4001" and pid.to_string() == key.peer_id
    for bad in ("/ip4/10.0.0.1/tcp/4001", f"/ip4/1.2.3.4/tcp/1/p2p/{key.peer_id}/p2p-circuit"):
        with pytest.raises(RelayAddressError):
            parse_relay_addr(bad)
    addr = f"/ip4/0.0.0.0/tcp/4001/p2p/{key.peer_id}"
    assert announced_addrs([addr], None) == [f"/ip4/127.0.0.1/tcp/4001/p2p/{key.peer_id}"]
    assert announced_addrs([addr], "relay.example.org") == [
        f"/dns/relay.example.org/tcp/4001/p2p/{key.peer_id}"
    ]
    assert announced_addrs([addr], "::1") == [f"/ip6/::1/tcp/4001/p2p/{key.peer_id}"]


def test_node_config_relay_fields() -> None:
    relay = f"/ip4/127.0.0.1/tcp/4001/p2p/{NodeKey.generate().peer_id}"
    cfg = NodeConfig(coordinator="127.0.0.1:7700", no_listen=True, relays=[relay])
    assert cfg.no_listen and cfg.relays == [relay]
    with pytest.raises(ValueError, match="relay_hop"):
        NodeConfig(coordinator="127.0.0.1:7700", no_listen=True, relay_hop=True)
    with pytest.raises(ValueError, match="/p2p/"):
        NodeConfig(coordinator="127.0.0.1:7700", relays=["/ip4/127.0.0.1/tcp/4001"])


def test_membership_lines_are_parsed_strictly() -> None:
    a, b = NodeKey.generate().peer_id, NodeKey.generate().peer_id
    assert parse_members(f"members {a} {b}".encode()) == {a, b}
    assert parse_members(b"members") == frozenset()
    for bad in (b"", b"member " + a.encode(), f"members {a} x/y".encode(),
                b"members " + b"1" * 129, b"members " + b"1 " * (MAX_MEMBERS + 1)):  # fmt: skip
        assert parse_members(bad) is None


# --- in process ---------------------------------------------------------------------------


def counted(name: str, **labels: str) -> float:
    """The current value of one of node.p2p.metrics' counters (process-wide)."""
    counter = getattr(metrics, name)
    return float((counter.labels(**labels) if labels else counter)._value.get())


async def echo_handler(remote: str, msg: Any) -> Any:
    return msg


async def echoes(src: Libp2pTransport, dest: Libp2pTransport, n: int, size: int, gap_s: float
                 ) -> tuple[int, int]:  # fmt: skip
    """`n` echo requests of `size` bytes from src to dest: (answered, failed)."""
    ok = failed = 0
    for seq in range(n):
        msg = Echo(seq=seq, payload=bytes(size))
        try:
            assert await src.request(dest.peer_id, dest.listen_addrs, ECHO, msg, timeout=10) == msg
            ok += 1
        except TransportError:
            failed += 1
        await trio.sleep(gap_s)
    return ok, failed


def test_a_nodes_hop_serves_members_only_and_cuts_a_circuit_at_its_duration() -> None:
    """A `--relay-hop` node relays only for the members of its view: a stranger's
    reservation and circuit are refused (and counted); a member's circuit is cut after
    relay_circuit_duration_s, and the next request opens a new one."""
    members: set[str] = set()
    refused_res = counted("RELAY_REFUSED", what="reservation")
    refused_circ = counted("RELAY_REFUSED", what="circuit")

    async def main() -> None:
        with trio.fail_after(90):
            cfg = P2PConfig(relay_hop=True, relay_circuit_duration_s=2)
            relay = Libp2pTransport(NodeKey.generate(), cfg, allow=members.__contains__)
            async with relay.run():
                hop = relay.direct_addrs[0]
                dest = Libp2pTransport(NodeKey.generate(), P2PConfig(listen=[], relays=[hop]))
                src = Libp2pTransport(NodeKey.generate(), P2PConfig(listen=[]))
                stranger = Libp2pTransport(NodeKey.generate(), P2PConfig(listen=[], relays=[hop]))
                members.update({dest.peer_id, src.peer_id})
                dest.set_handler(ECHO, echo_handler)
                async with dest.run(), src.run(), stranger.run():
                    assert dest.relay.held == [hop]
                    assert stranger.relay.held == []  # refused: announced, never reachable
                    assert counted("RELAY_REFUSED", what="reservation") > refused_res
                    # the stranger cannot open a circuit to a member either
                    with pytest.raises(TransportError):
                        msg = Echo(seq=0, payload=b"x")
                        await stranger.request(
                            dest.peer_id, dest.listen_addrs, ECHO, msg, timeout=5
                        )
                    assert counted("RELAY_REFUSED", what="circuit") > refused_circ
                    # a member's circuit lasts 2 s, then the relay cuts it as data moves
                    circuits = counted("RELAY_CIRCUITS")
                    ok, failed = await echoes(src, dest, n=20, size=1024, gap_s=0.3)
                    assert ok >= 10, (ok, failed)
                    assert counted("RELAY_CIRCUITS") - circuits >= 2, "the circuit was never cut"

    trio.run(main)


def test_the_coordinators_relay_serves_live_members_only_and_cuts_at_its_byte_limit(
    tmp_path: Path,
) -> None:
    """`agora-coordinator --relay`: the relay child learns the live members from the
    coordinator. A stranger's reservation is refused; a member's is refused until it
    joins, then held (the node's order: reserve, join, reservation held); a circuit is
    cut past relay_circuit_bytes and the next request opens a new one."""
    cfg = write_config(
        tmp_path, relay_circuit_bytes=256 * 1024, lease_ttl_s=120.0, heartbeat_interval_s=30.0
    )
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", args=["--relay"])
    dest_key, src_key = NodeKey.generate(), NodeKey.generate()

    async def join(key: NodeKey) -> None:
        async with CoordinatorClient("127.0.0.1", coord.port, key) as client:
            await client.join(c.JoinRequest())

    async def main() -> None:
        with trio.fail_after(120):
            async with CoordinatorClient("127.0.0.1", coord.port, NodeKey.generate()) as cl:
                status = await cl.call(c.StatusRequest())
            assert isinstance(status, c.StatusReply) and len(status.relays) == 1
            hop = status.relays[0]
            dest = Libp2pTransport(dest_key, P2PConfig(listen=[], relays=[hop]))
            dest.set_handler(ECHO, echo_handler)
            stranger = Libp2pTransport(NodeKey.generate(), P2PConfig(listen=[], relays=[hop]))
            async with dest.run(), stranger.run():
                # not a member yet: refused, the circuit address announced for the join
                assert dest.relay.held == [] and dest.listen_addrs
                await join(dest_key)
                while dest.relay.held != [hop]:  # the relay learns of the join, we retry
                    await trio.sleep(0.2)
                await join(src_key)
                src = Libp2pTransport(src_key, P2PConfig(listen=[]))
                async with src.run():
                    with trio.move_on_after(8):  # the stranger retries; never accepted
                        while not stranger.relay.held:
                            await trio.sleep(0.5)
                    assert stranger.relay.held == []
                    while True:  # the src's membership reaches the relay within a sweep
                        try:
                            msg = Echo(seq=0, payload=b"x")
                            await src.request(dest.peer_id, dest.listen_addrs, ECHO, msg, timeout=5)
                            break
                        except TransportError:
                            await trio.sleep(0.5)
                    circuits = counted("RELAY_CIRCUITS")
                    # 16 round trips of 2 x 32 KiB: 1 MiB through a 256 KiB circuit limit
                    ok, failed = await echoes(src, dest, n=16, size=32 * 1024, gap_s=0.05)
                    assert ok >= 8, (ok, failed)
                    assert counted("RELAY_CIRCUITS") - circuits >= 2, "the circuit was never cut"

    try:
        trio.run(main)
    finally:
        log = coord.log.read_text(errors="replace")
        assert coord.stop() == 0
    assert "refused a reservation" in log, log[-3000:]


def leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def test_request_reaches_an_outbound_only_peer_through_the_relay() -> None:
    async def main() -> None:
        with trio.fail_after(60):
            relay = Libp2pTransport(NodeKey.generate(), P2PConfig(relay_hop=True))
            async with relay.run():
                hop = relay.direct_addrs[0]
                dest = Libp2pTransport(NodeKey.generate(), P2PConfig(listen=[], relays=[hop]))

                async def echo(remote: str, msg: Any) -> Any:
                    return msg

                dest.set_handler(ECHO, echo)
                async with dest.run():
                    # announced: the circuit address only (it has no listener)
                    assert dest.direct_addrs == []
                    assert dest.listen_addrs == [f"{hop}/p2p-circuit/p2p/{dest.peer_id}"]
                    src = Libp2pTransport(NodeKey.generate(), P2PConfig(listen=[]))
                    async with src.run():
                        for seq in range(20):
                            msg = Echo(seq=seq, payload=bytes(range(256)) * 64)
                            reply = await src.request(
                                dest.peer_id, dest.listen_addrs, ECHO, msg, timeout=20
                            )
                            assert reply == msg
                        assert src.connection_stack(dest.peer_id) == [("/noise", "/yamux/1.0.0")]
                # a relay that refuses (none there) is a clear error for an outbound-only node
                lonely = Libp2pTransport(
                    NodeKey.generate(),
                    P2PConfig(listen=[], relays=[f"/ip4/127.0.0.1/tcp/9/p2p/{relay.peer_id}"]),
                )
                with pytest.raises(BaseException) as caught:
                    async with lonely.run():
                        pass
                assert "no relay accepted a reservation" in str(leaf(caught.value))

    trio.run(main)


# --- a swarm ------------------------------------------------------------------------------


def poll(predicate: Callable[[], Any], timeout_s: float, what: str, swarm: LocalSwarm) -> Any:
    """`LocalSwarm.wait_for`: poll until truthy; on timeout fail with the log tails."""
    return swarm.wait_for(predicate, what, timeout_s)


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    sw = LocalSwarm(
        workdir=tmp_path,
        preset="tiny",
        stages=2,
        coordinator_args=["--relay"],
        node_args=["--outer-every-steps", "0"],
    )
    try:
        yield sw
    finally:
        sw.kill_all()


def test_no_listen_nodes_train_through_the_coordinators_relay(swarm: LocalSwarm) -> None:
    swarm.start_coordinator()
    assert swarm.coordinator is not None
    relays = swarm.status().relays
    assert len(relays) == 1 and "/p2p/" in relays[0], relays
    swarm.add_node("open0", 0)
    swarm.add_node("hidden0", 0, "--no-listen")
    swarm.add_node("hidden1", 1, "--no-listen")  # the only stage-1 replica
    poll(
        lambda: [st.peers for st in swarm.status().stages] == [2, 1],
        START_S,
        "2 peers on stage 0 and 1 on stage 1",
        swarm,
    )
    before = swarm.status().committed_tokens
    poll(
        lambda: swarm.status().committed_tokens > before + 8 * 1024,
        TRAIN_S,
        f"committed tokens past {before + 8 * 1024}",
        swarm,
    )
    hidden1 = swarm.scrape("hidden1")
    assert hidden1.get("agora_node_tokens_total", 0) > 0, "the no-listen stage 1 trained nothing"
    assert hidden1.get("agora_p2p_served_total", 0) > 0, "the no-listen stage 1 served nothing"
    poll(
        lambda: swarm.scrape("hidden0").get("agora_node_tokens_total", 0) > 0,
        TRAIN_S,
        "tokens on the no-listen stage-0 node",
        swarm,
    )
    # The forwards reached hidden1 through the relay: both stage-0 nodes opened a circuit
    # (hidden1 is their only next-stage peer, and with --no-listen it has no direct
    # address to dial instead), and hidden1 holds a reservation on the relay.
    for name in ("open0", "hidden0"):
        poll(
            lambda n=name: swarm.scrape(n).get("agora_p2p_relay_circuits_total", 0) > 0,
            TRAIN_S,
            f"{name} to reach hidden1 through the relay",
            swarm,
        )
    assert swarm.scrape("hidden1").get("agora_p2p_relay_reservations_total", 0) > 0

    codes = swarm.stop_nodes(timeout_s=60)
    assert codes == {"open0": 0, "hidden0": 0, "hidden1": 0}, codes
    coordinator_log = swarm.coordinator.log
    assert swarm.stop_coordinator() == {"coordinator": 0}
    text = coordinator_log.read_text(errors="replace")
    assert "relay: stopped (exit 0)" in text, text[-2000:]

    audit = swarm.audit()
    assert audit.exit_code == 0, audit.stdout
    epochs = audit.epochs
    assert epochs
    for epoch in epochs:
        assert epoch["lost"] == [] and epoch["duplicated"] == [], epoch
    assert sum(e["committed_tokens"] for e in epochs) > before + 8 * 1024
