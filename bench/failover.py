"""`agora bench failover`: time from a peer's death to its traffic being re-routed and to
its data lease being re-issued, on real processes.

A real coordinator (its SQLite file, its sweeper) and 2 stages x 2 replicas of real
nodes (py-libp2p on loopback, `LocalSwarm`), tiny preset. The coordinator runs with a
short lease TTL, heartbeat and sweep interval (flags; the operator defaults are printed
alongside) so that the numbers are about the mechanism, not about waiting. The nodes run
without the DiLoCo outer loop by default (`--outer-every-steps 0`): a finished
micro-batch is then committed at once, so every micro-batch's completion is a
timestamped `commit` record in the coordinator's audit log. With the outer loop on,
commits wait for the outer round that covers them and `first_commit` grows by up to a
round.

Each trial is one SIGKILL on a swarm that trains steadily with all four nodes; the dead
node is replaced by a fresh node on its stage, which must train before the next kill
(not after the last one). Trial kinds, alternating:

1. **re-route** (a stage-1 replica dies). Stage 0 learns it when a request through the
   victim fails: the dial is refused or the stream reset (`PeerUnreachable`, within tens
   of ms of a SIGKILL on loopback), and stage 0 writes a `forward_failed` event naming
   the micro-batch, the victim and `kind="unreachable"` (its event file, unix time;
   `reroute_detect_seconds`). The router then marks the victim down: no micro-batch is
   routed to it while the other replica is up, until the membership shows it alive again
   (it never does: it is dead, and the coordinator drops it after its peer TTL). The
   micro-batch is retried at once through the survivor (the 0.5 s back-off applies only
   once every usable peer failed it) with `Forward.retry`, which the survivor computes
   before its fresh forwards (and stage 0 runs its backward before its own new
   forwards), and stage 0 writes `forward_rerouted` when it completes. `reroute_seconds` is kill -> the first such completion,
   `reroute_all_seconds` the last, `reroute_after_detection_s` the first completion
   after the node's detection (the goal: under 1 s). `sent_after_detection` counts the
   requests a stage-0 node sent to the victim after its own first transport failure
   there (each `forward_failed` carries the attempt's duration, so its send time is
   known): 0 when the mechanism works. `reroute_commit_seconds` is kill -> the audit
   log's `commit` record covering the first re-routed micro-batch; a commit covers a
   range only once every earlier window of its lease is trained too, and windows are
   drawn at random across 8 open leases, so it measures the commit rule, not routing.
   `microbatch_seconds_before_kill` is stage 0's mean micro-batch round trip before the
   kill (`agora_node_microbatch_seconds`): the re-routed micro-batch needs about one
   such round trip, so on a loaded box it, not the routing, bounds the re-route.
   `retried_microbatches` is the rise of stage 0's `agora_node_microbatches_total
   {result="retried"}` (Prometheus) from just before the kill to after the coordinator
   dropped the victim from the membership and the stage-0 nodes refreshed their view.
2. **lease re-issue** (a stage-0 replica holding leases dies). From the audit log:
   kill -> the `expire` record of its first lease (`lease_expire_seconds`), -> the
   `grant` of the same shard from the same committed offset at a higher fencing epoch
   (`lease_regrant_seconds`), -> the first `commit` on that new lease
   (`first_commit_seconds`); `regrant_after_expiry_s` is expire -> grant (the goal:
   within one heartbeat interval). The expiry is bounded by [TTL - heartbeat interval,
   TTL + sweep interval] after the kill (the lease was last renewed by the victim's last
   heartbeat, and the sweeper runs every `sweep_interval_s`). The re-grant is announced:
   the coordinator counts the ranges expired or released leases left
   (`HeartbeatReply.freed`, stage-0 nodes only), and a stage-0 node whose pool has room
   (up to twice `lease_pool` open leases, so even a full pool) asks for one at once
   (`LeaseAcquire(freed_only=True)`). So the survivor's next heartbeat after the expiry,
   at most one interval later, re-grants it. The first commit waits for the new lease's
   first window to be trained (windows are drawn at random across the open leases).

Times are wall-clock seconds measured by this process (kill) and by the coordinator
and nodes (audit records, node events, the coordinator's status) on the same machine.
At the end every node is drained, the coordinator stopped and `agora audit` replays the
lease log: lost and duplicated ranges must be 0. Exit 0 iff every trial measured and the audit is clean.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.failover_trial import DELTAS, POLL_S, STAGES, TIMES, Bench, Interrupted
from coordinator.config import CoordinatorConfig
from node.config import NodeConfig
from node.pipeline_hop import RETRY_WAIT_S
from node.routing import Router
from swarmlab.procs import workdir_path


def _parser() -> argparse.ArgumentParser:
    op = CoordinatorConfig()
    nd = NodeConfig(coordinator="127.0.0.1:1")
    p = argparse.ArgumentParser(
        prog="agora bench failover",
        description="SIGKILL peers of a local swarm (coordinator + 2 stages x 2 replicas) and"
        " measure the time to re-route their traffic (stage-1 victim) and to re-issue their"
        " data lease (stage-0 victim), from node logs and the coordinator's audit log; then"
        " check with `agora audit` that no range was lost or duplicated.",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--trials", type=int, default=3, help="kills of each kind (default 3)")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument(
        "--lease-ttl", type=float, default=5.0,
        help=f"coordinator lease/peer TTL, s (default 5; operator default {op.lease_ttl_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--heartbeat", type=float, default=1.0,
        help="heartbeat interval, s (default 1; operator default"
        f" {op.heartbeat_interval_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--sweep", type=float, default=0.5,
        help=f"expiry sweep interval, s (default 0.5; operator default {op.sweep_interval_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--shard-tokens", type=int, default=8192,
        help="tokens per shard = per lease (default 8192, 8 micro-batches; operator default"
        f" {op.shard_tokens})",
    )  # fmt: skip
    p.add_argument(
        "--outer-every-steps", type=int, default=0,
        help="nodes' inner steps per DiLoCo round (default 0: off, commits per micro-batch;"
        f" node default {nd.outer_every_steps})",
    )  # fmt: skip
    p.add_argument(
        "--workdir",
        type=workdir_path,
        default=None,
        help="logs and the coordinator DB (default: temp)",
    )
    p.add_argument(
        "--start-timeout", type=float, default=240.0,
        help="seconds for nodes to start training (torch import on a loaded box)",
    )  # fmt: skip
    p.add_argument("--trial-timeout", type=float, default=120.0, help="seconds one trial may take")
    return p


# --- helpers ---------------------------------------------------------------------------


def _summary(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return {
        "min": round(min(vals), 3),
        "median": round(statistics.median(vals), 3),
        "max": round(max(vals), 3),
    }


def build_report(args: argparse.Namespace, workdir: Path, got: dict[str, Any]) -> dict[str, Any]:
    op = CoordinatorConfig()
    nd = NodeConfig(coordinator="127.0.0.1:1")
    router = Router()
    trials = got["trials"]
    out: dict[str, Any] = {}
    for key, _ in TIMES:
        out[key] = [round(t[key], 3) for t in trials if key in t and t[key] is not None]
    for key, _ in DELTAS:
        out[key] = [round(t[key], 3) for t in trials if t.get(key) is not None]
    reroutes = [t for t in trials if t["kind"] == "reroute"]
    out["retried_microbatches"] = [t["retried_microbatches"] for t in reroutes]
    out["sent_after_detection"] = [t["sent_after_detection"] for t in reroutes]
    out["microbatch_seconds_before_kill"] = [
        round(t["microbatch_seconds_before_kill"], 3)
        for t in reroutes
        if t.get("microbatch_seconds_before_kill") is not None
    ]
    out["regranted_to"] = [t["regranted_to"] for t in trials if t["kind"] == "lease"]
    out["idle_replacements"] = got["idle_replacements"]
    out["lost_ranges"] = got["audit"]["lost_ranges"]
    out["duplicated_ranges"] = got["audit"]["duplicated_ranges"]
    out["summary"] = {k: _summary(out[k]) for k, _ in (*TIMES, *DELTAS)}
    out["summary"]["retried_microbatches"] = _summary(
        [float(x) for x in out["retried_microbatches"]]
    )
    out["goals"] = {
        "reroute_after_detection_s": 1.0,
        "regrant_after_expiry_s": args.heartbeat,
        "sent_after_detection": 0,
    }
    out["met"] = {
        "reroute_after_detection_s": bool(out["reroute_after_detection_s"])
        and max(out["reroute_after_detection_s"]) < 1.0,
        "regrant_after_expiry_s": bool(out["regrant_after_expiry_s"])
        and max(out["regrant_after_expiry_s"]) <= args.heartbeat,
        "sent_after_detection": not any(out["sent_after_detection"]),
    }
    out["bounds"] = {
        "lease_expire_seconds": [
            round(args.lease_ttl - args.heartbeat, 3),
            round(args.lease_ttl + args.sweep, 3),
        ],
        "lease_expire_why": "the lease was last renewed by the victim's last heartbeat (at most"
        " one interval before the kill) and lapses TTL later; the sweeper notices within one"
        " sweep interval",
        "lease_regrant_why": "announced: the next heartbeat reply of a stage-0 survivor after"
        " the expiry counts the freed range (HeartbeatReply.freed) and the node asks for it at"
        " once (LeaseAcquire freed_only), so within one heartbeat interval of the expiry",
        "reroute_why": "the first transport failure marks the victim down; the micro-batch is"
        " retried at once through the survivor (its forward again, the survivor's queue, the"
        " backward)",
        "first_commit_why": "the new holder's first micro-batch through the pipeline plus a"
        " commit round trip (outer loop off; with it on, the next outer round)",
        "victim_dropped_seconds": [
            round(args.lease_ttl - args.heartbeat, 3),
            round(args.lease_ttl + args.sweep, 3),
        ],
    }
    out["signals"] = {
        "kill": "time.time() in the bench just before SIGKILL",
        "reroute": "stage-0 node event forward_failed via <victim> (kind, attempt seconds)"
        " names the micro-batch; the node's forward_rerouted event for it is its completion"
        " through the survivor; its range's `commit` record in the coordinator's audit log"
        " (reroute_commit_seconds) is when the commit rule let it commit",
        "retried": 'stage-0 Prometheus agora_node_microbatches_total{result="retried"},'
        " scraped before the kill and after the victim left every stage-0 view",
        "victim_dropped": "coordinator status: one peer fewer on the stage (within one poll)",
        "lease": "audit records expire / grant (same shard and offset, higher epoch) / first"
        " commit on the new lease, coordinator time.time()",
    }
    out["settings"] = {
        "preset": args.preset,
        "stages": STAGES,
        "replicas": 2,
        "trials": args.trials,
        "lease_ttl_s": args.lease_ttl,
        "heartbeat_interval_s": args.heartbeat,
        "sweep_interval_s": args.sweep,
        "shard_tokens": args.shard_tokens,
        "outer_every_steps": args.outer_every_steps,
        "micro_batch": nd.micro_batch,
        "seq_len": nd.seq_len,
        "in_flight": nd.in_flight,
        "request_timeout_s": nd.request_timeout_s,
        "retry_backoff_s": RETRY_WAIT_S,
        "ban_base_s": router.ban_base_s,
        "poll_interval_s": POLL_S,
        "operator_defaults": {
            "lease_ttl_s": op.lease_ttl_s,
            "heartbeat_interval_s": op.heartbeat_interval_s,
            "sweep_interval_s": op.sweep_interval_s,
            "shard_tokens": op.shard_tokens,
            "outer_every_steps": nd.outer_every_steps,
        },
    }
    out["trials"] = trials
    out["audit"] = got["audit"]
    out["bad_exits"] = got["bad_exits"]
    out["workdir"] = str(workdir)
    return out


def print_report(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, Console().width))
    s = out["settings"]
    op = s["operator_defaults"]
    st = Table(title="failover settings (bench value / operator default)")
    st.add_column("setting")
    st.add_column("bench", justify="right")
    st.add_column("operator default", justify="right")
    for key in ("lease_ttl_s", "heartbeat_interval_s", "sweep_interval_s", "shard_tokens",
                "outer_every_steps"):  # fmt: skip
        st.add_row(key, f"{s[key]:g}", f"{op[key]:g}")
    console.print(st)
    t = Table(title=f"failover ({s['preset']}, 2 stages x 2 replicas, {s['trials']} trials each)")
    t.add_column("seconds from the kill to (last two: between)")
    t.add_column("n", justify="right")
    t.add_column("min s", justify="right")
    t.add_column("median s", justify="right")
    t.add_column("max s", justify="right")
    t.add_column("context")
    bounds = out["bounds"]
    ctx = {
        "lease_expire_seconds": f"TTL {s['lease_ttl_s']:g}: in"
        f" [{bounds['lease_expire_seconds'][0]:g}, {bounds['lease_expire_seconds'][1]:g}]",
        "victim_dropped_seconds": f"TTL {s['lease_ttl_s']:g}, sweep {s['sweep_interval_s']:g}",
        "lease_regrant_seconds": "+ the survivor's next heartbeat",
        "first_commit_seconds": "+ the lease's first window",
        "reroute_seconds": "retried at once",
        "reroute_commit_seconds": "+ the commit rule",
        "reroute_detect_seconds": "stage-1 replica killed",
        "reroute_after_detection_s": "goal < 1 s",
        "regrant_after_expiry_s": f"goal <= heartbeat {s['heartbeat_interval_s']:g} s",
    }
    for key, label in (*TIMES, *DELTAS):
        sm = out["summary"].get(key)
        n = len(out[key])
        if sm is None:
            t.add_row(label, str(n), "-", "-", "-", ctx.get(key, ""))
        else:
            t.add_row(label, str(n), f"{sm['min']:.2f}", f"{sm['median']:.2f}",
                      f"{sm['max']:.2f}", ctx.get(key, ""))  # fmt: skip
    sm = out["summary"]["retried_microbatches"]
    if sm is not None:
        t.add_row("(micro-batches retried)", str(len(out["retried_microbatches"])),
                  f"{sm['min']:g}", f"{sm['median']:g}", f"{sm['max']:g}", "count, not s")  # fmt: skip
    console.print(t)
    met = out["met"]
    console.print(
        "goals: re-route < 1 s after the detection: "
        f"{'met' if met['reroute_after_detection_s'] else 'NOT met'}; re-grant within one"
        f" heartbeat of the expiry: {'met' if met['regrant_after_expiry_s'] else 'NOT met'};"
        f" requests to the dead peer after the detection: {out['sent_after_detection']}"
    )
    console.print(
        f"agora audit: lost {out['lost_ranges']}, duplicated {out['duplicated_ranges']} ranges;"
        f" re-granted to: {', '.join(out['regranted_to']) or '-'}; logs in {out['workdir']}"
    )


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.trials < 1:
        print("agora bench failover: --trials must be >= 1", file=sys.stderr)
        return 2
    try:
        CoordinatorConfig(
            lease_ttl_s=args.lease_ttl, heartbeat_interval_s=args.heartbeat,
            sweep_interval_s=args.sweep, shard_tokens=args.shard_tokens,
        )  # fmt: skip
    except ValueError as exc:
        print(f"agora bench failover: {exc}", file=sys.stderr)
        return 2
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="agora-failover-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, workdir)
    op = CoordinatorConfig()
    bench.say(
        f"settings: lease TTL {args.lease_ttl:g}s (operator default {op.lease_ttl_s:g}),"
        f" heartbeat {args.heartbeat:g}s ({op.heartbeat_interval_s:g}), sweep {args.sweep:g}s"
        f" ({op.sweep_interval_s:g}), shard {args.shard_tokens} tokens ({op.shard_tokens}),"
        f" outer every {args.outer_every_steps} steps; {args.trials} trials of each kind;"
        f" logs in {workdir}"
    )
    try:
        got = bench.run()
    except KeyboardInterrupt:
        print("agora bench failover: interrupted; swarm killed", file=sys.stderr)
        return 130
    except (TimeoutError, Interrupted) as exc:
        print(f"agora bench failover: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.swarm.kill_all()
    out = build_report(args, workdir, got)
    out["seconds_total"] = round(time.monotonic() - bench.t_start, 1)
    print_report(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    ok = (
        not out["lost_ranges"]
        and not out["duplicated_ranges"]
        and not out["bad_exits"]
        and all(len(out[k]) == args.trials for k in ("reroute_seconds", "lease_expire_seconds",
                                                     "lease_regrant_seconds", "first_commit_seconds"))
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
