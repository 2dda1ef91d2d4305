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
   victim fails: stage 0 writes a `forward_failed` event naming the micro-batch and the
   victim (its event file, unix time), the
   micro-batch is retried through the other replica after a 0.5 s back-off, and the
   victim is banned in the router. `reroute_seconds` is kill -> the commit of the first
   such re-routed micro-batch (it completed through the survivor: the victim is dead);
   `reroute_all_seconds` the same for the last of them. Both come from the audit log
   (`commit` records carry the coordinator's `time.time()`; a commit covers the
   micro-batch's range once every earlier micro-batch of the lease is done too, so
   this is an upper bound on completion, by one commit round trip, a few ms here).
   `retried_microbatches` is the rise of stage 0's `agora_node_microbatches_total
   {result="retried"}` (Prometheus) from just before the kill to after the coordinator
   dropped the victim from the membership (its peer TTL) and the stage-0 nodes
   refreshed their view: until then the router tries the dead peer again each time its
   ban (2 s, doubling) runs out.
2. **lease re-issue** (a stage-0 replica holding a lease dies). From the audit log:
   kill -> the `expire` record of its lease (`lease_expire_seconds`), -> the `grant` of
   the same shard from the same committed offset at a higher fencing epoch
   (`lease_regrant_seconds`), -> the first `commit` on that new lease
   (`first_commit_seconds`). The expiry is bounded by [TTL - heartbeat interval,
   TTL + sweep interval] after the kill (the lease was last renewed by the victim's last
   heartbeat, and the sweeper runs every `sweep_interval_s`). The re-grant is pull-based:
   it happens when a stage-0 peer asks for work, i.e. when the survivor has finished
   its current lease (a stage-0 node trains one lease at a time; a lease is the rest of a
   shard). That is why the bench uses small shards (`--shard-tokens`); with the default
   262,144-token shards the expired range waits for a fresh node or for the survivor's
   whole shard (a shard re-queued after a partial grant goes to the front of the queue,
   so a survivor would get its own shard back first).

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

from bench.failover_trial import POLL_S, STAGES, TIMES, Bench, Interrupted
from coordinator.config import CoordinatorConfig
from node.config import NodeConfig
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
    out["retried_microbatches"] = [
        t["retried_microbatches"] for t in trials if "reroute" == t["kind"]
    ]
    out["regranted_to"] = [t["regranted_to"] for t in trials if t["kind"] == "lease"]
    out["idle_replacements"] = got["idle_replacements"]
    out["lost_ranges"] = got["audit"]["lost_ranges"]
    out["duplicated_ranges"] = got["audit"]["duplicated_ranges"]
    out["summary"] = {k: _summary(out[k]) for k, _ in TIMES}
    out["summary"]["retried_microbatches"] = _summary(
        [float(x) for x in out["retried_microbatches"]]
    )
    out["bounds"] = {
        "lease_expire_seconds": [
            round(args.lease_ttl - args.heartbeat, 3),
            round(args.lease_ttl + args.sweep, 3),
        ],
        "lease_expire_why": "the lease was last renewed by the victim's last heartbeat (at most"
        " one interval before the kill) and lapses TTL later; the sweeper notices within one"
        " sweep interval",
        "lease_regrant_why": "pull-based: granted when a stage-0 peer asks for work, i.e. when"
        " the survivor finishes its current lease (at most shard_tokens of training) or a new"
        " node joins",
        "first_commit_why": "the new holder's first micro-batch through the pipeline plus a"
        " commit round trip (outer loop off; with it on, the next outer round)",
        "victim_dropped_seconds": [
            round(args.lease_ttl - args.heartbeat, 3),
            round(args.lease_ttl + args.sweep, 3),
        ],
    }
    out["signals"] = {
        "kill": "time.time() in the bench just before SIGKILL",
        "reroute": "stage-0 node event forward_failed via <victim> names the micro-batch; its"
        " range's `commit` record in the coordinator's audit log (SQLite, time.time() at the"
        " coordinator) is its completion through the survivor (an upper bound by one commit"
        " round trip)",
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
        "retry_backoff_s": 0.5,
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
    t.add_column("seconds from the kill to")
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
        "lease_regrant_seconds": "+ survivor's lease",
        "first_commit_seconds": "+ one micro-batch",
        "reroute_seconds": "incl. 0.5 s back-off",
        "reroute_detect_seconds": "stage-1 replica killed",
    }
    for key, label in TIMES:
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
