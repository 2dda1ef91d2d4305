"""`agora status --coordinator HOST:PORT[#sha256:HEX] [--watch]`: a readable view of a run.

Sends a `StatusRequest` signed with a throw-away key (membership is not needed) over a
blocking TLS connection with a deadline (`node.control_tls.connect`: checked against the
pin when the address carries one, else a warning that the coordinator is not
authenticated), and shows it with `coordinator.status.view`, including the fingerprint
of the certificate it came over. A certificate that is not the pinned one exits 1,
naming both fingerprints, with nothing sent. Torch-free.
"""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console

from coordinator.status import render, watch
from node.control_tls import connect
from protocol.control import ErrorReply, StatusReply, StatusRequest
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.pinning import SYNTAX, CoordinatorAddress, PinMismatch, fingerprint, parse_address
from protocol.signing import sign_request


def fetch_status(
    address: CoordinatorAddress, *, timeout_s: float = 10.0
) -> tuple[StatusReply, str]:
    """The coordinator's status and the fingerprint of the certificate it came over."""
    req = sign_request(NodeKey.generate(), StatusRequest(), now=time.time(), run=None)
    dec = FrameDecoder()
    with connect(address.host, address.port, address.pin, timeout_s=timeout_s) as s:
        seen = fingerprint(s.getpeercert(binary_form=True) or b"")
        s.sendall(frame_message(req))
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError("coordinator closed the connection without a reply")
            msgs = dec.feed_messages(chunk)
            if msgs:
                reply = msgs[0]
                if isinstance(reply, ErrorReply):
                    raise ProtocolError(f"coordinator refused: {reply.code}: {reply.detail}")
                if not isinstance(reply, StatusReply):
                    raise ProtocolError(f"unexpected reply {reply.TYPE!r}")
                return reply, seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agora status",
        description="Show a run's stages, peers per stage, throughput, leases by state, data"
        " progress and ETA, as reported by its coordinator, and the fingerprint of the"
        " coordinator's TLS certificate.",
    )
    parser.add_argument(
        "--coordinator", required=True, metavar=SYNTAX,
        help="the coordinator; #sha256:HEX pins its TLS certificate (the fingerprint it"
        " printed at start): any other certificate is refused",
    )  # fmt: skip
    parser.add_argument(
        "--coordinator-fingerprint", metavar="sha256:HEX",
        help="the certificate pin, when --coordinator carries none",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    parser.add_argument(
        "--watch", action="store_true", help="keep a live view refreshed until Ctrl-C"
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between --watch refreshes (2)"
    )
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)  # refreshes, for tests
    args = parser.parse_args(argv)
    if args.interval <= 0:
        print(f"agora status: --interval must be > 0, got {args.interval}", file=sys.stderr)
        return 2
    try:
        address = parse_address(args.coordinator, args.coordinator_fingerprint)
    except ValueError as exc:
        print(f"agora status: {exc}", file=sys.stderr)
        return 2
    try:
        if args.watch:
            return watch(
                lambda: fetch_status(address, timeout_s=args.timeout),
                Console(),
                interval_s=args.interval,
                count=args.count,
            )
        st, seen = fetch_status(address, timeout_s=args.timeout)
    except (OSError, ProtocolError, PinMismatch) as exc:
        print(f"agora status: {address.hostport}: {exc}", file=sys.stderr)
        return 1
    render(st, Console(), seen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
