"""The readable view of a run's `StatusReply` that `agora status` shows.

`view` renders stages (with each one's attested state), peers, throughput, leases, data
progress and ETA with rich (and the fingerprint of the certificate the status came over);
`watch` keeps one screen refreshed every `interval_s` seconds (rich Live) for people
without Grafana; a failed fetch shows the error and the last good view, and Ctrl-C exits
cleanly. The command itself, which connects, is `swarmlab.status` (clients of the
control plane share `node.control_tls`, which the coordinator package may not import).
Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from protocol.control import StatusReply
from protocol.errors import ProtocolError


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def view(st: StatusReply, fingerprint: str = "") -> Group:
    """The status as one rich renderable (printed once, or refreshed by `--watch`);
    `fingerprint`: the certificate it came over."""
    head = Text.from_markup(
        f"[bold]run {st.run_id}[/]  peers {st.peers}"
        + (f"  observers {st.observers}" if st.observers else "")
        + f"  membership v{st.membership_version}"
        f"  uptime {_duration(st.uptime_s)}" + ("  [red]PAUSED[/]" if st.paused else "")
    )
    stages = Table(title="stages")
    for col in ("stage", "peers", "throughput (tok/s)", "cost", "attested state"):
        stages.add_column(col, justify="right")
    for s in st.stages:
        att = f"round {s.attested.round} {s.attested.digest[:8]}" if s.attested else "-"
        stages.add_row(str(s.stage), str(s.peers), f"{s.throughput:,.0f}", f"{s.cost:g}", att)
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
    parts: list[RenderableType] = [head, stages, leases, progress]
    if fingerprint:
        parts.append(Text(f"coordinator certificate {fingerprint}", no_wrap=True))
    return Group(*parts)


def render(st: StatusReply, console: Console, fingerprint: str = "") -> None:
    console.print(view(st, fingerprint))


def watch(
    fetch: Callable[[], tuple[StatusReply, str]],  # the status and the certificate seen
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
                    last = view(*fetch())
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
