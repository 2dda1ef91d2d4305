"""`python -m node.p2p.relay_main`: a stand-alone circuit-relay v2 hop.

For nodes started with `--no-listen`: it runs a libp2p host with only the hop role
(node.p2p.relay, through node.p2p.host), prints `agora-relay at MULTIADDR` for each
address once it serves, and runs until SIGINT/SIGTERM (or, with `--stop-on-stdin-eof`,
until its parent closes its stdin). `agora-coordinator --relay` starts it as a child
process (coordinator.relay_child), so the coordinator never imports libp2p.

It serves the run's members only: with `--members-on-stdin` its parent writes the live
peer ids as lines `members ID ID ...` (each line replaces the set; nobody is served
before the first), and the relay drops the reservations of peers no longer listed.
`--open` serves every peer instead, for a relay on a trusted network only.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import multiaddr
import trio

from node.identity import load_or_create_key
from node.p2p.host import Libp2pTransport
from node.p2p.limits import MembershipFilter, allow_everyone
from node.p2p.transport import P2PConfig
from protocol.identity import NodeKey

log = logging.getLogger(__name__)

MAX_LINE = 8 << 20  # bytes: the longest membership line read from the parent
MAX_MEMBERS = 1 << 17  # peer ids in one membership line
_PEER_ID = re.compile(rb"[1-9A-HJ-NP-Za-km-z]{1,128}")  # base58btc, as peer ids are written


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m node.p2p.relay_main",
        description="Run a stand-alone libp2p circuit-relay v2 hop for Agora nodes started "
        "with --no-listen. Prints `agora-relay at MULTIADDR` once it serves; pass that "
        "multiaddr to the nodes with --relay.",
    )
    p.add_argument(
        "--listen", default="/ip4/0.0.0.0/tcp/4001",
        help="libp2p listen multiaddr (default /ip4/0.0.0.0/tcp/4001; tcp/0 = OS-chosen port)",
    )  # fmt: skip
    p.add_argument(
        "--announce", default=None,
        help="host or IP to print in the relay's address instead of the listen IP (needed "
        "when listening on 0.0.0.0; default: the listen IP, or 127.0.0.1 for 0.0.0.0)",
    )  # fmt: skip
    p.add_argument(
        "--identity", type=Path, default=None,
        help="ed25519 key file (created on first run), so the relay keeps its peer id "
        "across restarts (default: a fresh key per start)",
    )  # fmt: skip
    p.add_argument("--addr-file", type=Path, default=None, help="also write the address here")
    p.add_argument(
        "--stop-on-stdin-eof", action="store_true",
        help="stop when stdin closes (a parent that starts the relay holds the pipe, so the"
        " relay does not outlive it, even after a SIGKILL)",
    )  # fmt: skip
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--members-on-stdin", action="store_true",
        help="serve only the peer ids the parent writes on stdin, as lines `members ID ID ...`"
        " (implies --stop-on-stdin-eof; agora-coordinator --relay does this)",
    )  # fmt: skip
    who.add_argument(
        "--open", action="store_true",
        help="serve every peer: anyone can reserve and relay through it (trusted networks only)",
    )  # fmt: skip
    d = P2PConfig()
    p.add_argument("--circuit-bytes", type=int, default=d.relay_circuit_bytes,
                   help=f"bytes one circuit may carry (default {d.relay_circuit_bytes})")  # fmt: skip
    p.add_argument("--circuit-duration", type=float, default=d.relay_circuit_duration_s,
                   help=f"seconds one circuit may last (default {d.relay_circuit_duration_s:g})")  # fmt: skip
    p.add_argument("--reservation-ttl", type=float, default=d.relay_reservation_ttl_s,
                   help=f"seconds a reservation lasts unless renewed (default {d.relay_reservation_ttl_s:g})")  # fmt: skip
    p.add_argument("--max-reservations", type=int, default=d.relay_max_reservations,
                   help=f"reservations held at once (default {d.relay_max_reservations})")  # fmt: skip
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    return p.parse_args(argv)


def parse_members(line: bytes) -> frozenset[str] | None:
    """`members ID ID ...` -> the ids; None for a line that is not one (bounded, strict)."""
    words = line.split()
    if not words or words[0] != b"members" or len(words) > MAX_MEMBERS + 1:
        return None
    if not all(_PEER_ID.fullmatch(w) for w in words[1:]):
        return None
    return frozenset(w.decode() for w in words[1:])


def deny_everyone(peer_id: str) -> bool:
    """The membership before the parent's first list: nobody."""
    return False


def announced_addrs(listen_addrs: Sequence[str], announce: str | None) -> list[str]:
    """Dialable addresses: the IP is replaced by `announce` if given, a wildcard by 127.0.0.1."""
    out = []
    for addr in listen_addrs:
        parts = addr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            if announce is not None:
                try:
                    parts[1] = f"ip{ipaddress.ip_address(announce).version}"
                except ValueError:
                    parts[1] = "dns"
                parts[2] = announce
            elif parts[2] in ("0.0.0.0", "::"):
                parts[1], parts[2] = "ip4", "127.0.0.1"
        out.append("/".join(parts))
    return out


async def _serve_relay(args: argparse.Namespace) -> int:
    key = load_or_create_key(args.identity) if args.identity else NodeKey.generate()
    cfg = P2PConfig(
        listen=[args.listen],
        relay_hop=True,
        relay_circuit_bytes=args.circuit_bytes,
        relay_circuit_duration_s=args.circuit_duration,
        relay_reservation_ttl_s=args.reservation_ttl,
        relay_renew_s=min(60.0, args.reservation_ttl / 2),
        relay_max_reservations=args.max_reservations,
    )
    allow: MembershipFilter = allow_everyone if args.open else deny_everyone
    transport = Libp2pTransport(key, cfg, allow=allow)
    # the receiver stays open through the shutdown: a second signal then waits, harmless
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
        async with transport.run():
            addrs = announced_addrs(transport.direct_addrs, args.announce)
            for addr in addrs:
                print(f"agora-relay at {addr}", flush=True)
            if args.addr_file:
                args.addr_file.write_text("".join(f"{a}\n" for a in addrs))
            async with trio.open_nursery() as nursery:
                if args.stop_on_stdin_eof or args.members_on_stdin:
                    nursery.start_soon(
                        _follow_stdin, nursery.cancel_scope, transport, args.members_on_stdin
                    )
                async for signum in sigs:
                    log.info("relay: %s, stopping", signal.Signals(signum).name)
                    break
                nursery.cancel_scope.cancel()
    return 0


async def _follow_stdin(scope: trio.CancelScope, transport: Libp2pTransport, members: bool) -> None:
    """Stop when stdin closes; with `members`, apply each membership line on the way."""
    buf = bytearray()
    skipping = False  # inside a line over MAX_LINE: dropped up to its newline
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        while chunk := await stdin.receive_some(1 << 16):
            if not members:
                continue
            buf += chunk
            while (end := buf.find(b"\n")) >= 0:
                line = bytes(buf[:end])
                del buf[: end + 1]
                if skipping:  # the tail of an overlong line
                    skipping = False
                    continue
                _apply_members(transport, line)
            if len(buf) > MAX_LINE:
                log.warning("relay: a membership line over %d bytes, ignored", MAX_LINE)
                buf.clear()
                skipping = True
    log.info("relay: stdin closed (parent gone), stopping")
    scope.cancel()


def _apply_members(transport: Libp2pTransport, line: bytes) -> None:
    ids = parse_members(line)
    if ids is None:
        log.warning("relay: ignored a bad membership line (%d bytes)", len(line))
        return
    transport.set_membership(ids.__contains__)
    transport.relay.proto.drop_non_members()
    log.debug("relay: serving %d members", len(ids))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        multiaddr.Multiaddr(args.listen)
    except Exception as exc:
        print(f"agora-relay: bad --listen {args.listen!r}: {exc}", file=sys.stderr)
        return 2
    try:
        return trio.run(_serve_relay, args)
    except OSError as exc:
        print(f"agora-relay: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
