"""`agora status --coordinator HOST:PORT [--watch]`: a readable view of a run.

Sends a `StatusRequest` signed with a throw-away key (membership is not needed) over
a plain blocking socket with a deadline, and shows stages, peers, throughput, leases,
data progress and ETA with rich. `--watch` keeps one screen refreshed every
`--interval` seconds (rich Live) for people without Grafana; a failed fetch shows the
error and the last good view, and Ctrl-C exits cleanly. Torch-free.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from protocol.control import ErrorReply, StatusReply, StatusRequest
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.signing import sign_request


def fetch_status(host: str, port: int, *, timeout_s: float = 10.0) -> StatusReply:
    req = sign_request(NodeKey.generate(), StatusRequest(), now=time.time(), run=None)
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


def view(st: StatusReply) -> Group:
    """The status as one rich renderable (printed once, or refreshed by `--watch`)."""
    head = Text.from_markup(
        f"[bold]run {st.run_id}[/]  peers {st.peers}"
        + (f"  observers {st.observers}" if st.observers else "")
        + f"  membership v{st.membership_version}"
        f"  uptime {_duration(st.uptime_s)}" + ("  [red]PAUSED[/]" if st.paused else "")
    )
    stages = Table(title="stages")
    for col in ("stage", "peers", "throughput (tok/s)", "cost"):
        stages.add_column(col, justify="right")
    for s in st.stages:
        stages.add_row(str(s.stage), str(s.peers), f"{s.throughput:,.0f}", f"{s.cost:g}")
    leases = Table(title=f"data epoch {st.data_epoch}")
    leases.add_column("what")
    leases.add_column("count", justify="right")
    for k, v in sorted(st.leases.items()):
        leases.add_row(f"leases {k}", str(v))
    for k, v in sorted(st.shards.items()):
        leases.add_row(f"shards {k}", str(v))
    pct = 100.0 * st.committed_tokens / st.epoch_tokens if st.epoch_tokens else 0.0
    progress = Text(
        f"progress: {st.committed_tokens:,} / {st.epoch_tokens:,} tokens ({pct:.1f}%),"
        f" {st.tokens_per_s:,.0f} tok/s, ETA {_duration(st.eta_s)}"
    )
    return Group(head, stages, leases, progress)


def render(st: StatusReply, console: Console) -> None:
    console.print(view(st))


def watch(
    fetch: Callable[[], StatusReply],
    console: Console,
    *,
    interval_s: float,
    count: int | None = None,
) -> int:
    """Refresh the view every `interval_s` seconds until Ctrl-C (or `count` refreshes)."""
    last: RenderableType = Text("waiting for the first status reply ...")
    shown = 0
    try:
        with Live(last, console=console, auto_refresh=False, screen=False) as live:
            while count is None or shown < count:
                stamp = time.strftime("%H:%M:%S")
                try:
                    last = view(fetch())
                    footer = Text(f"updated {stamp}; every {interval_s:g}s; Ctrl-C quits", "dim")
                except (OSError, ProtocolError) as exc:
                    footer = Text(f"{stamp}: cannot fetch status: {exc}; retrying", "red")
                live.update(Group(last, footer), refresh=True)
                shown += 1
                if count is None or shown < count:
                    time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agora status",
        description="Show a run's stages, peers per stage, throughput, leases by state, data"
        " progress and ETA, as reported by its coordinator.",
    )
    parser.add_argument("--coordinator", required=True, help="HOST:PORT of the coordinator")
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
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        print(f"agora status: expected HOST:PORT, got {args.coordinator!r}", file=sys.stderr)
        return 2
    if args.watch:
        return watch(
            lambda: fetch_status(host.strip("[]"), int(port), timeout_s=args.timeout),
            Console(),
            interval_s=args.interval,
            count=args.count,
        )
    try:
        st = fetch_status(host.strip("[]"), int(port), timeout_s=args.timeout)
    except (OSError, ProtocolError) as exc:
        print(f"agora status: {args.coordinator}: {exc}", file=sys.stderr)
        return 1
    render(st, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
