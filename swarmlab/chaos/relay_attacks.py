"""The relay attacker of `agora chaos --hostile`: `relay_flood` against the coordinator's
circuit relay (`agora-coordinator --relay`), from a fresh libp2p process.

Run as `python -m swarmlab.chaos.relay_attacks --coordinator HOST:PORT --circuit-bytes N
--json OUT`. The attacker learns the relay from the run (`RunInfo.relays`), then:

1. as a member (it joins as an observer, so nobody routes to it), reserves in its own
   name until the relay, which learns the members from the coordinator, accepts;
2. as that member, reserves in other peers' names (an honest node's, a second attacker
   member's, a stranger's) and asks for a circuit to a stranger;
3. as `STRANGERS` fresh keys that never joined, reserves each in its own name, and one of
   them asks for a circuit to the member of step 1 (which holds a reservation);
4. with the second member, pushes `CUT_FACTOR` times the relay's circuit byte limit
   through a circuit to the first, as echo round trips, counting the circuits it opened.

Defended when every answer of steps 2 and 3 was a refusal, the member's own reservation
was accepted (else the relay served nobody and nothing is judged) and the circuit of
step 4 was cut: it needed more than one circuit.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from typing import Any

import trio

from node.coordinator_client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable
from node.p2p import metrics
from node.p2p.host import Libp2pTransport
from node.p2p.relay import CIRCUIT
from node.p2p.relay_probe import ACCEPTED, TIMEOUT, hop_exchange
from node.p2p.transport import P2PConfig, TransportError
from protocol import control as c
from protocol.dataplane import ECHO_PROTOCOL, Echo
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.pinning import parse_address
from swarmlab.chaos.control_wire import write_outcome
from swarmlab.chaos.rogue import MEMBER_WAIT_S, REQUEST_S

log = logging.getLogger("agora.chaos.relay_attacks")

STRANGERS = 50  # fresh keys that each try to reserve
CUT_FACTOR = 3  # bytes pushed through one circuit, in multiples of the relay's limit
ECHO_BYTES = 64 * 1024  # payload of one echo (it crosses the circuit twice)


def refused(answer: str) -> bool:
    """A relay's answer that grants nothing: a refusal status or the stream closed on us
    (a timeout is no answer)."""
    return answer not in (ACCEPTED, TIMEOUT)


async def echo(remote: str, msg: Message) -> Message:
    return msg


async def own_reservation(member: Libp2pTransport, relay: str) -> tuple[str, int]:
    """Reserve in our own name until accepted or `MEMBER_WAIT_S` passes: (last answer,
    tries). The relay learns of our join within the coordinator's sweep interval."""
    deadline = trio.current_time() + MEMBER_WAIT_S
    tries = 0
    while True:
        tries += 1
        answer = await hop_exchange(member, relay, reserve=True, peer_id=member.peer_id)
        if answer == ACCEPTED or trio.current_time() > deadline:
            return answer, tries
        await trio.sleep(0.3)


async def strangers(relay: str, n: int, member: str) -> dict[str, Any]:
    """`n` fresh keys reserve in their own names; the first also asks for a circuit to
    `member`."""
    answers: collections.Counter[str] = collections.Counter()
    circuit = ""
    for i in range(n):
        stranger = Libp2pTransport(NodeKey.generate(), P2PConfig(listen=[]))
        async with stranger.run():
            answers[
                await hop_exchange(stranger, relay, reserve=True, peer_id=stranger.peer_id)
            ] += 1
            if i == 0:
                circuit = await hop_exchange(stranger, relay, reserve=False, peer_id=member)
    return {"answers": dict(answers), "circuit_to_member": circuit}


async def push_through(
    src: Libp2pTransport, dest: Libp2pTransport, relay: str, limit: int
) -> dict[str, Any]:
    """Echo round trips from src to dest through the relay until `CUT_FACTOR * limit`
    bytes crossed the relay; how many answered and how many circuits src opened."""
    addrs = [f"{relay}{CIRCUIT}/p2p/{dest.peer_id}"]
    circuits = metrics.RELAY_CIRCUITS._value.get()
    answered = failed = 0
    pushed = 0
    seq = 0
    while pushed < CUT_FACTOR * limit:
        msg = Echo(seq=seq, payload=bytes(ECHO_BYTES))
        seq += 1
        try:
            await src.request(dest.peer_id, addrs, ECHO_PROTOCOL, msg, timeout=REQUEST_S)
            answered += 1
            pushed += 2 * ECHO_BYTES
        except TransportError:
            failed += 1
            if failed > 8 + seq // 2:  # the relay stopped serving us altogether
                break
            await trio.sleep(0.2)
    opened = int(metrics.RELAY_CIRCUITS._value.get() - circuits)
    return {"limit_bytes": limit, "pushed_bytes": pushed, "answered": answered,
            "failed": failed, "circuits": opened}  # fmt: skip


async def relay_flood(host: str, port: int, circuit_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    member_key, second_key = NodeKey.generate(), NodeKey.generate()
    member = Libp2pTransport(member_key, P2PConfig(listen=[]))
    second = Libp2pTransport(second_key, P2PConfig(listen=[]))
    member.set_handler(ECHO_PROTOCOL, echo)
    async with (
        member.run(),
        second.run(),
        CoordinatorClient(host, port, member_key) as client,
        CoordinatorClient(host, port, second_key) as client2,
    ):
        run = (await client.join(c.JoinRequest(observer=True))).run
        await client2.join(c.JoinRequest(observer=True))
        if not run.relays:
            raise SystemExit("relay_attacks: the run offers no relay")
        relay = run.relays[0]
        view = await client.membership()
        honest = sorted(p for p, info in view.peers.items() if not info.observer)
        out.update(relay=relay, member=member.peer_id, strangers=STRANGERS)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.heartbeat_loop, list)
            nursery.start_soon(client2.heartbeat_loop, list)
            await _play(out, member, second, relay, honest, circuit_bytes)
            nursery.cancel_scope.cancel()
        for cl in (client, client2):
            await cl.aclose()  # a cancelled heartbeat may have left a reply unread
            with trio.move_on_after(REQUEST_S):
                try:
                    await cl.leave()
                except (CoordinatorError, CoordinatorUnavailable) as exc:
                    log.info("leave failed (the lease TTL will do): %s", exc)
    out["defended"] = judge(out)
    out["expect"] = (
        f"{STRANGERS} non-member reservations, reservations in others' names and circuits "
        f"with a non-member refused; a circuit cut past {circuit_bytes} bytes"
    )
    return out


async def _play(
    out: dict[str, Any],
    member: Libp2pTransport,
    second: Libp2pTransport,
    relay: str,
    honest: list[str],
    circuit_bytes: int,
) -> None:
    """Steps 1 to 4 of the module's list, their answers into `out`."""
    answer, tries = await own_reservation(member, relay)
    out["own_reservation"], out["own_reservation_tries"] = answer, tries
    stranger_id = NodeKey.generate().peer_id
    names = {"honest_node": honest[0] if honest else stranger_id,
             "other_member": second.peer_id, "stranger": stranger_id}  # fmt: skip
    out["in_others_names"] = {
        who: await hop_exchange(member, relay, reserve=True, peer_id=pid)
        for who, pid in names.items()
    }
    out["circuit_to_stranger"] = await hop_exchange(
        member, relay, reserve=False, peer_id=stranger_id
    )
    out["non_members"] = await strangers(relay, STRANGERS, member.peer_id)
    if answer == ACCEPTED:
        out["circuit_cut"] = await push_through(second, member, relay, circuit_bytes)


def judge(out: dict[str, Any]) -> bool | None:
    """None when the relay never accepted the member (nothing to judge against)."""
    if out.get("own_reservation") != ACCEPTED:
        return None
    strangers_ = out["non_members"]
    answers = [a for a, n in strangers_["answers"].items() for _ in range(n)]
    answers += [strangers_["circuit_to_member"], out["circuit_to_stranger"]]
    answers += list(out["in_others_names"].values())
    cut = out.get("circuit_cut", {})
    return all(refused(a) for a in answers) and cut.get("circuits", 0) >= 2


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    address = parse_address(args.coordinator)
    return await relay_flood(address.host, address.port, args.circuit_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m swarmlab.chaos.relay_attacks",
        description="Flood the coordinator's circuit relay (for agora chaos --hostile).",
    )
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--attack", default="relay_flood", choices=("relay_flood",))
    p.add_argument("--circuit-bytes", type=int, required=True,
                   help="the relay's relay_circuit_bytes (a circuit past it must be cut)")  # fmt: skip
    p.add_argument("--json", required=True, help="write the outcome here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s relay_attacks: %(message)s")
    return write_outcome(
        args.json,
        lambda: trio.run(main_async, args),
        (CoordinatorError, CoordinatorUnavailable, OSError),
    )


if __name__ == "__main__":
    sys.exit(main())
