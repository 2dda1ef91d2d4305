"""`agora status --coordinator HOST:PORT`: one readable snapshot of a run.

Sends one `StatusRequest` signed with a throw-away key (membership is not needed) over
a plain blocking socket with a deadline, and prints stages, peers, throughput, leases,
data progress and ETA with rich. Torch-free.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

from rich.console import Console
from rich.table import Table

from protocol.control import ErrorReply, StatusReply, StatusRequest
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.signing import sign_request


def fetch_status(host: str, port: int, *, timeout_s: float = 10.0) -> StatusReply:
    req = sign_request(NodeKey.generate(), StatusRequest(), now=time.time())
    dec = FrameDecoder()
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.settimeout(timeout_s)
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
                return reply


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def render(st: StatusReply, console: Console) -> None:
    console.print(
        f"[bold]run {st.run_id}[/]  peers {st.peers}  membership v{st.membership_version}"
        f"  uptime {_duration(st.uptime_s)}" + ("  [red]PAUSED[/]" if st.paused else "")
    )
    stages = Table(title="stages")
    for col in ("stage", "peers", "throughput (tok/s)", "cost"):
        stages.add_column(col, justify="right")
    for s in st.stages:
        stages.add_row(str(s.stage), str(s.peers), f"{s.throughput:,.0f}", f"{s.cost:g}")
    console.print(stages)
    leases = Table(title=f"data epoch {st.data_epoch}")
    leases.add_column("what")
    leases.add_column("count", justify="right")
    for k, v in sorted(st.leases.items()):
        leases.add_row(f"leases {k}", str(v))
    for k, v in sorted(st.shards.items()):
        leases.add_row(f"shards {k}", str(v))
    console.print(leases)
    pct = 100.0 * st.committed_tokens / st.epoch_tokens if st.epoch_tokens else 0.0
    console.print(
        f"progress: {st.committed_tokens:,} / {st.epoch_tokens:,} tokens ({pct:.1f}%),"
        f" {st.tokens_per_s:,.0f} tok/s, ETA {_duration(st.eta_s)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agora status",
        description="Show a run's stages, peers per stage, throughput, leases by state, data"
        " progress and ETA, as reported by its coordinator.",
    )
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    args = parser.parse_args(argv)
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        print(f"agora status: expected HOST:PORT, got {args.coordinator!r}", file=sys.stderr)
        return 2
    try:
        st = fetch_status(host.strip("[]"), int(port), timeout_s=args.timeout)
    except (OSError, ProtocolError) as exc:
        print(f"agora status: {args.coordinator}: {exc}", file=sys.stderr)
        return 1
    render(st, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
