"""The rogue peer of `agora chaos`: a process that attacks one honest stage peer and the
coordinator, and reports what each attack got back.

Run as `python -m swarmlab.chaos.rogue --coordinator HOST:PORT --victim PEER_ID --json OUT
[--attacks a,b,...]`. It uses the real `Libp2pTransport`. Attacks:

- `not_member`: a well-formed Forward from a key that never joined the run;
- `garbage`, `nan`, `inf`, `shape`, `huge`: a member sends a frame of random bytes, a
  Forward whose hidden state decodes to NaN / Inf, one of the wrong width, a header
  claiming 2 GiB; each from a fresh member identity, then a good request from the same
  identity checks that it was banned;
- `cut`: a member opens forward streams and cuts them mid-message: a header promising
  4 KiB followed by 100 bytes and EOF, and a reset in the middle of a payload;
- `streams`: a member opens thousands of forward streams at once and holds them;
- `coordinator`: raw TCP to the coordinator: a replayed signed request, an unsigned
  message, a forged signature and garbage bytes;
- `outsider`: a key that is not in the run (no join token / not on the allowlist) tries
  to join, then sends a well-formed Forward on the data plane;
- `control`: a member sends well-formed Forwards (they must be answered).

In a closed run pass `--join-token` and/or `--identity` (a key on the allowlist): the
rogue's own joins (observer, members) use them.

Exit 0 when every attack ran, whatever the outcome (the caller judges the outcomes).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from typing import Any

import numpy as np
import trio

from node.control_tls import connect
from node.coordinator_client import (
    ClientConfig,
    CoordinatorClient,
    CoordinatorError,
    CoordinatorUnavailable,
)
from node.model import preset
from node.p2p.host import Libp2pTransport
from node.p2p.transport import P2PConfig, RequestRefused, TransportError
from node.p2p.wire import read_message
from protocol import control as c
from protocol.codec import decode, encode
from protocol.framing import HEADER, FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.pinning import parse_address
from protocol.pipeline import FORWARD_PROTOCOL, Forward
from protocol.signing import sign_request
from protocol.tensors import EncodedTensor, TensorFrame

log = logging.getLogger("agora.chaos.rogue")

BATCH, SEQ = 2, 16  # rows and tokens of the rogue's micro-batches
ATTACKS = (
    "not_member", "garbage", "nan", "inf", "shape", "huge", "cut", "streams", "coordinator",
    "outsider", "control",
)  # fmt: skip
BAN_ATTACKS = ("garbage", "nan", "inf", "shape", "huge")  # each must end in a ban
MEMBER_WAIT_S = 20.0  # seconds to wait for the victim to see a new member
REQUEST_S = 10.0  # seconds per request
STREAMS = 2000  # streams the `streams` attack tries to open
STREAMS_S = 40.0  # seconds the `streams` attack may take in all


def encoded(run: c.RunInfo, shape: list[int], *, bad: float | None = None) -> EncodedTensor:
    """A boundary tensor of `shape` [rows, tokens, width] in the run's subspace codec; its
    scale is `bad` (NaN, Inf) when given."""
    if run.codec not in ("subspace_int4", "subspace_int8"):
        raise SystemExit(
            f"chaos_rogue: only the subspace_int4/int8 codecs are modelled, not {run.codec}"
        )
    rows, seq = shape[0], shape[1]
    k = preset(run.model_preset).subspace_rank
    rng = np.random.default_rng(0)
    if run.codec == "subspace_int4":  # packed nibbles, two codes a byte
        q = rng.integers(0, 256, size=(rows, seq, k // 2), dtype=np.uint8)
    else:
        q = rng.integers(-20, 20, size=(rows, seq, k), dtype=np.int8)
    rel = np.ones((rows, seq), dtype=np.float16)
    g = np.array([0.5 if bad is None else bad], dtype=np.float32)
    return EncodedTensor(
        codec=run.codec, shape=list(shape), parts=[TensorFrame.from_numpy(a) for a in (q, rel, g)]
    )


def forward(
    run: c.RunInfo,
    *,
    width_delta: int = 0,
    bad: float | None = None,
    rows: int = BATCH,
    mb_id: str = "rogue.0.0",
) -> Forward:
    """A Forward for a `subspace_int4` or `subspace_int8` boundary (well-formed unless
    told otherwise)."""
    d = preset(run.model_preset).d_model + width_delta
    tokens = np.random.default_rng(0).integers(0, 256, size=(rows, SEQ + 1), dtype=np.uint8)
    return Forward(
        mb_id=mb_id,
        tokens=TensorFrame.from_numpy(tokens),
        hidden=encoded(run, [rows, SEQ, d], bad=bad),
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
            await _reset(stream)
    reason = getattr(reply, "reason", None)
    return {"outcome": "refused" if reason else "answered", "reason": reason}


async def _reset(stream: Any) -> None:
    try:
        await stream.reset()
    except Exception:  # already gone
        pass


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


def payload_for(name: str, run: c.RunInfo) -> bytes | Forward:
    if name == "garbage":
        junk = os.urandom(512)
        return HEADER.pack(len(junk)) + junk
    if name == "huge":
        return HEADER.pack(2**31) + b"\0" * 64  # claims 2 GiB, sends 64 bytes
    if name == "nan":
        return forward(run, bad=math.nan)
    if name == "inf":
        return forward(run, bad=math.inf)
    if name == "shape":
        return forward(run, width_delta=1)
    raise ValueError(f"unknown attack {name!r}")


async def cut_streams(transport: Libp2pTransport, victim: str, addrs: list[str]) -> dict[str, Any]:
    """Cut forward streams mid-message: EOF inside a payload, and a reset inside one."""
    out: dict[str, Any] = {}
    with trio.fail_after(REQUEST_S):
        stream = await transport.open_stream(victim, addrs, FORWARD_PROTOCOL)
        await stream.write(HEADER.pack(4096) + os.urandom(100))
        await stream.close()  # EOF after 100 of the 4096 promised bytes
        try:
            reply = await read_message(stream, max_frame=1 << 20)
            out["eof"] = {"outcome": "answered", "reply": type(reply).__name__}
        except Exception as exc:
            out["eof"] = {"outcome": "dropped", "detail": f"{type(exc).__name__}"}
    with trio.fail_after(REQUEST_S):
        stream = await transport.open_stream(victim, addrs, FORWARD_PROTOCOL)
        await stream.write(HEADER.pack(4096) + os.urandom(1000))
        await _reset(stream)
        out["reset"] = {"outcome": "cut"}
    return out


async def many_streams(
    transport: Libp2pTransport, victim: str, addrs: list[str], n: int
) -> dict[str, Any]:
    """Open up to `n` forward streams at once and hold them until the time is up."""
    opened: list[Any] = []
    failed = 0
    with trio.move_on_after(STREAMS_S / 2):
        limiter = trio.CapacityLimiter(64)

        async def one() -> None:
            nonlocal failed
            async with limiter:
                try:
                    opened.append(await transport.open_stream(victim, addrs, FORWARD_PROTOCOL))
                except Exception:
                    failed += 1

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one)
    # Held open: the victim admits at most max_streams_per_peer and resets the rest.
    await trio.sleep(2.0)
    held = len(opened)
    with trio.move_on_after(STREAMS_S / 4):
        for s in opened:
            await _reset(s)
    return {"outcome": "flooded", "opened": held, "failed": failed, "tried": n}


async def member_attack(
    name: str,
    host: str,
    port: int,
    victim: str,
    run: c.RunInfo,
    *,
    key: NodeKey | None = None,
    join_token: str = "",
    pin: str | None = None,
) -> dict[str, Any]:
    """Join as a member, attack once, then check that a good request is still refused."""
    key = key or NodeKey.generate()
    transport = Libp2pTransport(key, P2PConfig())
    result: dict[str, Any]
    async with transport.run(), CoordinatorClient(host, port, key, pin=pin) as client:
        await client.join(
            c.JoinRequest(addrs=transport.listen_addrs, stage=0, join_token=join_token)
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.heartbeat_loop, list)
            view = await client.membership()
            if victim not in view.peers:
                raise SystemExit(f"chaos_rogue: victim {victim} is not a member")
            addrs = list(view.peers[victim].addrs)
            # Until the victim sees us as a member it refuses with not_member before
            # reading anything; wait for that with well-formed requests.
            deadline = trio.current_time() + MEMBER_WAIT_S
            while True:
                probe = await send(transport, victim, addrs, forward(run))
                if probe.get("reason") != "not_member":
                    break
                if trio.current_time() > deadline:
                    raise SystemExit("chaos_rogue: the victim never saw us as a member")
                await trio.sleep(0.3)
            if name == "cut":
                result = await cut_streams(transport, victim, addrs)
            elif name == "streams":
                result = await many_streams(transport, victim, addrs, STREAMS)
            elif name == "control":
                result = await send(transport, victim, addrs, forward(run))
            else:
                payload = payload_for(name, run)
                if isinstance(payload, Forward):
                    result = await send(transport, victim, addrs, payload)
                else:
                    result = await raw_frame(transport, victim, addrs, payload)
            await trio.sleep(0.2)
            result["after"] = await send(transport, victim, addrs, forward(run))
            nursery.cancel_scope.cancel()
        await client.aclose()  # a cancelled heartbeat may have left a reply unread
        with trio.move_on_after(REQUEST_S):
            try:
                await client.leave()
            except (CoordinatorError, CoordinatorUnavailable) as exc:
                log.info("leave failed (the lease TTL will do): %s", exc)
    result["peer_id"] = key.peer_id
    return result


async def outsider_attack(
    host: str, port: int, victim: str, addrs: list[str], run: c.RunInfo, pin: str | None = None
) -> dict[str, Any]:
    """A key outside a closed run: its join is refused, and so is its data-plane request."""
    key = NodeKey.generate()
    out: dict[str, Any] = {"peer_id": key.peer_id}
    quick = ClientConfig(call_timeout_s=5.0, retry_deadline_s=10.0)
    for label, token in (("join", ""), ("join_wrong_token", "not-the-token")):
        async with CoordinatorClient(host, port, key, config=quick, pin=pin) as client:
            try:
                await client.join(c.JoinRequest(stage=1, join_token=token))
                out[label] = "accepted"
            except CoordinatorError as exc:
                out[label] = exc.code
    transport = Libp2pTransport(key, P2PConfig())
    async with transport.run():
        out["forward"] = await send(transport, victim, addrs, forward(run))
    return out


async def not_member_attack(victim: str, addrs: list[str], run: c.RunInfo) -> dict[str, Any]:
    transport = Libp2pTransport(NodeKey.generate(), P2PConfig())
    async with transport.run():
        return await send(transport, victim, addrs, forward(run))


def _raw_coordinator(host: str, port: int, data: bytes, timeout_s: float = 5.0) -> list[str]:
    """Send bytes to the coordinator; the reply types/codes until it closes or goes quiet."""
    dec = FrameDecoder()
    out: list[str] = []
    with connect(host, port, None, timeout_s=timeout_s) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                for payload in dec.feed(chunk):
                    msg = decode(payload)
                    out.append(str(getattr(msg, "code", None) or msg.TYPE))
        except (TimeoutError, OSError):
            pass
    return out


def coordinator_attack(host: str, port: int) -> dict[str, Any]:
    """Replayed, unsigned, forged and garbage control requests."""
    key = NodeKey.generate()
    signed = frame_message(sign_request(key, c.StatusRequest(), now=time.time(), run=None))
    req = sign_request(key, c.StatusRequest(), now=time.time(), run=None)
    forged = type(req)(
        key=NodeKey.generate().public_key, ts=req.ts, nonce=req.nonce, body=req.body, sig=req.sig
    )
    stale = sign_request(key, c.StatusRequest(), now=time.time() - 3600, run=None)
    return {
        "replay": _raw_coordinator(host, port, signed + signed),
        "unsigned": _raw_coordinator(host, port, frame_message(c.StatusRequest())),
        "forged": _raw_coordinator(host, port, frame_message(forged)),
        "stale": _raw_coordinator(host, port, frame_message(stale)),
        "garbage": _raw_coordinator(host, port, HEADER.pack(5) + b"hello"),
        "body_garbage": _raw_coordinator(host, port, HEADER.pack(3) + encode(c.OkReply())[:3]),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    address = parse_address(args.coordinator)
    host, port = address.host, address.port
    key = NodeKey(open(args.identity, "rb").read()) if args.identity else None
    async with CoordinatorClient.to(address, key or NodeKey.generate()) as client:
        joined = await client.join(c.JoinRequest(stage=0, join_token=args.join_token))
        view = await client.membership()
        await client.leave()
    if args.victim not in view.peers:
        raise SystemExit(f"chaos_rogue: victim {args.victim} is not a member")
    run = joined.run
    addrs = list(view.peers[args.victim].addrs)
    results: dict[str, Any] = {}
    for name in args.attacks:
        try:
            if name == "not_member":
                results[name] = await not_member_attack(args.victim, addrs, run)
            elif name == "coordinator":
                results[name] = await trio.to_thread.run_sync(coordinator_attack, host, port)
            elif name == "outsider":
                results[name] = await outsider_attack(
                    host, port, args.victim, addrs, run, address.pin
                )
            else:
                results[name] = await member_attack(
                    name, host, port, args.victim, run,
                    key=key if name == "control" else None, join_token=args.join_token,
                    pin=address.pin,
                )  # fmt: skip
        except Exception as exc:  # e.g. the coordinator is being restarted by the chaos
            results[name] = {"outcome": "error", "detail": f"{type(exc).__name__}: {exc}"[:300]}
        log.info("%s: %s", name, results[name])
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m swarmlab.chaos.rogue",
        description="Attack one honest stage peer and the coordinator (for agora chaos).",
    )
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT[#sha256:HEX]")
    p.add_argument("--victim", required=True, help="peer id of the honest peer to attack")
    p.add_argument("--json", required=True, help="write the outcomes here")
    p.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset")
    p.add_argument("--join-token", default="", help="join token of a closed run (auth token)")
    p.add_argument(
        "--identity", default=None, help="seed file of an allowlisted key (observer, control)"
    )
    args = p.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(args.attacks) - set(ATTACKS)
    if unknown:
        p.error(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rogue: %(message)s")
    results = trio.run(main_async, args)
    with open(args.json, "w") as fh:
        json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
