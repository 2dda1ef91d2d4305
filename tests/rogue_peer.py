"""A rogue data-plane peer for the swarm tests: it attacks one honest stage peer.

Run as a process (`python tests/rogue_peer.py --coordinator HOST:PORT --victim PEER_ID
--json OUT`). It uses the real `Libp2pTransport` with identities of its own and tries,
in order:

- `not_member`: a well-formed Forward from a key that never joined the run;
- `garbage`: a member sends a frame of random bytes;
- `nan`: a member sends a Forward whose hidden state decodes to NaN;
- `shape`: a member sends a Forward whose hidden state has the wrong width;
- `huge`: a member sends a frame header that claims 2 GiB;
- `control`: a member sends a well-formed Forward (it must be answered: this shows the
  ban check after each attack can tell a banned peer from a served one).

Every member attack uses a fresh identity that joins the run (stage 0, heartbeating),
waits until the victim has learnt it is a member, attacks once, then checks that a
well-formed Forward from the same identity is no longer served (it was banned). The
outcome of each attack goes to the JSON file; the test asserts on it and on the
victim's Prometheus counters. Exit 0 when every attack ran (whatever the outcome).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from node.coordinator_client import CoordinatorClient  # noqa: E402
from node.model import preset  # noqa: E402
from node.p2p.host import Libp2pTransport  # noqa: E402
from node.p2p.transport import P2PConfig, RequestRefused, TransportError  # noqa: E402
from node.p2p.wire import read_message  # noqa: E402
from protocol.control import JoinRequest, RunInfo  # noqa: E402
from protocol.framing import HEADER  # noqa: E402
from protocol.identity import NodeKey  # noqa: E402
from protocol.pipeline import FORWARD_PROTOCOL, Forward  # noqa: E402
from protocol.tensors import EncodedTensor, TensorFrame  # noqa: E402

log = logging.getLogger("rogue")

BATCH, SEQ = 2, 16  # rows and tokens of the rogue's micro-batches
ATTACKS = ("garbage", "nan", "shape", "huge", "control")
MEMBER_WAIT_S = 20.0  # seconds to wait for the victim to see a new member
REQUEST_S = 10.0  # seconds per request


def forward(run: RunInfo, *, width_delta: int = 0, nan: bool = False) -> Forward:
    """A Forward for a `subspace_int8` boundary (well-formed unless told otherwise)."""
    cfg = preset(run.model_preset)
    d, k = cfg.d_model + width_delta, cfg.subspace_rank
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(BATCH, SEQ + 1), dtype=np.uint8)
    q = rng.integers(-20, 20, size=(BATCH, SEQ, k), dtype=np.int8)
    rel = np.ones((BATCH, SEQ), dtype=np.float16)
    g = np.array([math.nan if nan else 0.5], dtype=np.float32)
    if run.codec != "subspace_int8":
        raise SystemExit(f"rogue_peer: only the subspace_int8 codec is modelled, not {run.codec}")
    hidden = EncodedTensor(
        codec="subspace_int8",
        shape=[BATCH, SEQ, d],
        parts=[TensorFrame.from_numpy(a) for a in (q, rel, g)],
    )
    return Forward(
        mb_id="rogue.0.0",
        tokens=TensorFrame.from_numpy(tokens),
        hidden=hidden,
        route=["rogue"],
        deadline=time.time() + 30,
    )


async def raw_frame(
    transport: Libp2pTransport, victim: str, addrs: list[str], data: bytes
) -> dict[str, Any]:
    """Write raw bytes on a fresh forward stream; report the victim's reaction."""
    with trio.fail_after(REQUEST_S):
        stream = await transport.open_stream(victim, addrs, FORWARD_PROTOCOL)
        try:
            await stream.write(data)
            reply = await read_message(stream, max_frame=1 << 20)
        except Exception as exc:  # a reset or EOF: the victim dropped us
            return {"outcome": "dropped", "detail": f"{type(exc).__name__}: {exc}"[:200]}
        finally:
            try:
                await stream.reset()
            except Exception:
                pass
    reason = getattr(reply, "reason", None)
    return {"outcome": "refused" if reason else "answered", "reason": reason}


async def send(
    transport: Libp2pTransport, victim: str, addrs: list[str], msg: Forward
) -> dict[str, Any]:
    try:
        reply = await transport.request(victim, addrs, FORWARD_PROTOCOL, msg, timeout=REQUEST_S)
    except RequestRefused as exc:
        return {"outcome": "refused", "reason": exc.reason}
    except TransportError as exc:
        return {"outcome": "dropped", "detail": str(exc)[:200]}
    return {"outcome": "answered", "reply": type(reply).__name__}


def attack_bytes(name: str, run: RunInfo) -> bytes | Forward:
    if name == "garbage":
        junk = os.urandom(512)
        return HEADER.pack(len(junk)) + junk
    if name == "huge":
        return HEADER.pack(2**31) + b"\0" * 64  # claims 2 GiB, sends 64 bytes
    if name == "nan":
        return forward(run, nan=True)
    if name == "shape":
        return forward(run, width_delta=1)
    if name == "control":
        return forward(run)
    raise ValueError(f"unknown attack {name!r}")


async def member_attack(
    name: str, host: str, port: int, victim: str, run: RunInfo
) -> dict[str, Any]:
    key = NodeKey.generate()
    transport = Libp2pTransport(key, P2PConfig())
    async with transport.run(), CoordinatorClient(host, port, key) as client:
        await client.join(JoinRequest(addrs=transport.listen_addrs, stage=0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.heartbeat_loop, list)
            view = await client.membership()
            if victim not in view.peers:
                raise SystemExit(f"rogue_peer: victim {victim} is not a member")
            addrs = list(view.peers[victim].addrs)
            # Wait until the victim serves us as a member: until then it refuses with
            # not_member before reading anything, so probing with the attack is harmless.
            payload = attack_bytes(name, run)
            deadline = trio.current_time() + MEMBER_WAIT_S
            while True:
                if isinstance(payload, Forward):
                    result = await send(transport, victim, addrs, payload)
                else:
                    result = await raw_frame(transport, victim, addrs, payload)
                if result.get("reason") != "not_member":
                    break
                if trio.current_time() > deadline:
                    result["outcome"] = "victim never saw us as a member"
                    break
                await trio.sleep(0.3)
            # Banned? A well-formed request from the same identity must not be served.
            await trio.sleep(0.2)
            result["after"] = await send(transport, victim, addrs, forward(run))
            nursery.cancel_scope.cancel()
        await client.leave()
    result["peer_id"] = key.peer_id
    return result


async def not_member_attack(victim: str, addrs: list[str], run: RunInfo) -> dict[str, Any]:
    transport = Libp2pTransport(NodeKey.generate(), P2PConfig())
    async with transport.run():
        return await send(transport, victim, addrs, forward(run))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    host, _, port_s = args.coordinator.rpartition(":")
    port = int(port_s)
    observer = NodeKey.generate()
    async with CoordinatorClient(host, port, observer) as client:
        joined = await client.join(JoinRequest(stage=0))
        view = await client.membership()
        await client.leave()
    if args.victim not in view.peers:
        raise SystemExit(f"rogue_peer: victim {args.victim} is not a member")
    run = joined.run
    addrs = list(view.peers[args.victim].addrs)
    results: dict[str, Any] = {"not_member": await not_member_attack(args.victim, addrs, run)}
    log.info("not_member: %s", results["not_member"])
    for name in args.attacks:
        results[name] = await member_attack(name, host, port, args.victim, run)
        log.info("%s: %s", name, results[name])
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--victim", required=True, help="peer id of the honest peer to attack")
    p.add_argument("--json", required=True, type=Path, help="write the outcomes here")
    p.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset")
    args = p.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rogue: %(message)s")
    results = trio.run(main_async, args)
    args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
