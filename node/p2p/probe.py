"""`python -m node.p2p.probe`: a stand-alone data-plane peer serving echo, for tests and benches.

It prints one JSON line `{"peer_id": ..., "addrs": [...]}` on stdout once it listens,
logs transport events on stderr, and runs until stdin closes or it gets SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

import trio

from node.p2p.host import Libp2pTransport
from node.p2p.limits import LimitsConfig
from node.p2p.transport import P2PConfig
from protocol.dataplane import Echo
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.message import Message

ECHO_PROTOCOL = "/agora/echo/1"
POISON = b"poison"  # with --poison, an Echo carrying exactly this is "invalid input"


def make_echo_handler(*, poison: bool) -> object:
    async def echo(peer_id: str, msg: Message) -> Message:
        if not isinstance(msg, Echo):
            raise ProtocolError(f"expected dp.echo, got {msg.TYPE}")
        if poison and msg.payload == POISON:
            raise ProtocolError("poisoned echo payload")
        if msg.reply_size is not None:
            return Echo(seq=msg.seq, payload=bytes(msg.reply_size))
        return Echo(seq=msg.seq, payload=msg.payload)

    return echo


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m node.p2p.probe",
        description="Serve /agora/echo/1 over py-libp2p (Noise, Yamux) for tests and benches.",
    )
    p.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0", help="listen multiaddr")
    p.add_argument("--seed-hex", help="32-byte ed25519 seed in hex (default: random key)")
    p.add_argument(
        "--allow", action="append", default=None, help="serve only this peer id (repeatable)"
    )
    p.add_argument("--max-frame", type=int, default=None, help="largest frame, bytes")
    p.add_argument("--max-streams", type=int, default=None, help="concurrent streams per peer")
    p.add_argument("--rate", type=float, default=None, help="requests/s per peer")
    p.add_argument("--burst", type=float, default=None, help="request burst per peer")
    p.add_argument("--read-timeout", type=float, default=None, help="seconds to read a request")
    p.add_argument("--poison", action="store_true", help="treat payload b'poison' as invalid")
    return p


def config_from_args(args: argparse.Namespace) -> P2PConfig:
    limits = LimitsConfig()
    if args.max_streams is not None:
        limits.max_streams_per_peer = args.max_streams
    if args.rate is not None:
        limits.rate_per_s = args.rate
    if args.burst is not None:
        limits.burst = args.burst
    cfg = P2PConfig(
        listen=[args.listen] if args.listen else [],
        limits=limits,
        max_outbound_streams_per_peer=min(32, limits.max_streams_per_peer),
        pool_max_idle_per_peer=min(8, limits.max_streams_per_peer),
    )
    if args.max_frame is not None:
        cfg.max_frame = args.max_frame
        limits.max_bytes_in_flight_per_peer = max(
            limits.max_bytes_in_flight_per_peer, 2 * args.max_frame
        )
    if args.read_timeout is not None:
        cfg.read_timeout_s = args.read_timeout
    cfg.__post_init__()
    return cfg


async def serve(args: argparse.Namespace) -> None:
    key = NodeKey(bytes.fromhex(args.seed_hex)) if args.seed_hex else NodeKey.generate()
    allowed = set(args.allow) if args.allow else None
    transport = Libp2pTransport(
        key,
        config_from_args(args),
        allow=(lambda pid: pid in allowed) if allowed is not None else (lambda pid: True),
    )
    transport.set_handler(ECHO_PROTOCOL, make_echo_handler(poison=args.poison))  # type: ignore[arg-type]
    async with transport.run():
        print(
            json.dumps({"peer_id": transport.peer_id, "addrs": transport.listen_addrs}), flush=True
        )
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def until_stdin_closes() -> None:
                    async with trio.lowlevel.FdStream(os.dup(0)) as stdin:
                        while await stdin.receive_some(1024):
                            pass
                    nursery.cancel_scope.cancel()

                async def until_signal() -> None:
                    async for _ in signals:
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(until_stdin_closes)
                nursery.start_soon(until_signal)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("libp2p", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    trio.run(serve, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
