"""`python -m node.p2p.relay_main`: a stand-alone circuit-relay v2 hop.

For nodes started with `--no-listen`: it runs a libp2p host with only the hop role
(node.p2p.relay, through node.p2p.host), prints `agora-relay at MULTIADDR` for each
address once it serves, and runs until SIGINT/SIGTERM (or, with `--stop-on-stdin-eof`,
until its parent closes its stdin). `agora-coordinator --relay` starts it as a child
process (coordinator.relay_child), so the coordinator never imports libp2p.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import multiaddr
import trio

from node.identity import load_or_create_key
from node.p2p.host import Libp2pTransport
from node.p2p.transport import P2PConfig
from protocol.identity import NodeKey

log = logging.getLogger(__name__)


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
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    return p.parse_args(argv)


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
    transport = Libp2pTransport(key, P2PConfig(listen=[args.listen], relay_hop=True))
    # the receiver stays open through the shutdown: a second signal then waits, harmless
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
        async with transport.run():
            addrs = announced_addrs(transport.direct_addrs, args.announce)
            for addr in addrs:
                print(f"agora-relay at {addr}", flush=True)
            if args.addr_file:
                args.addr_file.write_text("".join(f"{a}\n" for a in addrs))
            async with trio.open_nursery() as nursery:
                if args.stop_on_stdin_eof:
                    nursery.start_soon(_stop_on_stdin_eof, nursery.cancel_scope)
                async for signum in sigs:
                    log.info("relay: %s, stopping", signal.Signals(signum).name)
                    break
                nursery.cancel_scope.cancel()
    return 0


async def _stop_on_stdin_eof(scope: trio.CancelScope) -> None:
    async with trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())) as stdin:
        while await stdin.receive_some(4096):
            pass
    log.info("relay: stdin closed (parent gone), stopping")
    scope.cancel()


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
