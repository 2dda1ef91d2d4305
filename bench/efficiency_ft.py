"""What fault tolerance costs: `ft_overhead_pct` of `agora bench efficiency`.

Two swarms of the same shape (a coordinator and 2 stages x 2 replicas, one torch thread
per node, the same preset, node settings and DiLoCo rounds) run **at the same time** on
the same cores, so they see the same load from start to end:

- **default**: the fault-tolerance machinery at its defaults: the coordinator's
  heartbeat interval (3 s) and lease / peer TTL (15 s), 8,192-token grants, commits at
  every applied outer round, and stage checkpoints after every applied round
  (`--checkpoint-dir`, `checkpoint_every_rounds = 1`);
- **cheap**: the same at its cheapest: a long heartbeat interval and TTL
  (`--ft-cheap-heartbeat-s`, `--ft-cheap-ttl-s`), whole-shard grants (`grant_tokens =
  0`, the fewest lease calls) and no checkpoints. Commits cannot be turned off; they
  ride in the rounds both swarms run.

Both warm up until each swarm's four nodes train (stage 0 trained, stage 1 served) and
then `warmup_s` more. Over the window, every `window_s / intervals` seconds, the bench
reads each swarm's stage-0 trained tokens (`agora_node_tokens_total` of both replicas)
and the CPU seconds of each swarm's node and coordinator processes, each with every
process under it (a node's outer-loop process and p2p daemons; `cpu_seconds_by_process`
in the JSON). `ft_overhead_pct` is
`100 (1 - default tokens/s / cheap tokens/s)` over the whole window (positive: fault
tolerance costs throughput); `ft_overhead_pct_intervals` is the same per interval,
and their spread says how far one number can be trusted on a shared box;
`ft_overhead_cpu_pct` compares CPU seconds per trained token, which a load that favours
one swarm's processes moves less. The two swarms share the cores, so each one's rate is
about half of what it would be alone: the overhead is a ratio, comparable to a paper's
percentage only as a ratio.

Measured (`agora bench efficiency --preset tiny --ft-only --ft-window-s 240
--ft-intervals 8`, 2 December, shared 2-core box at load average 11-23, rounds every 4
inner steps so checkpoints come often): default 994 vs cheap 1,024 stage-0 tokens/s,
`ft_overhead_pct` 2.9 % (per-interval 13.0, 7.7, 0.0, 3.7, -3.7, 10.3, 5.9, -7.1 %;
stdev 7.0 points, so about +-2.5 points of standard error), CPU seconds per token
+5.9 % (the coordinator's CPU 1.86 s vs 0.46 s; counted then from each main process
alone, without the outer-loop processes). A 120 s window at load average 17-24
gave 20.3 % with a per-interval stdev of 34 points: at this noise one short run cannot
tell 3 % from 0 or from 20.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

NODES = (("a0", 0), ("b0", 0), ("a1", 1), ("b1", 1))
DEFAULT_HEARTBEAT_S = 3.0  # coordinator.config.CoordinatorConfig defaults
DEFAULT_TTL_S = 15.0


def say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[efficiency] {msg}", file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and every process under it (a node's
    outer-loop process, its hivemind DHT process and p2p daemon), the reaped ones
    included through their parents' children times; NaN once `pid` is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return float("nan")
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue  # exited since the listing: its parent's children times hold it
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _swarm(workdir: Path, preset: str, *, cheap: bool, args: Any) -> Any:
    from swarmlab.swarm import LocalSwarm

    run: dict[str, Any] = {"run_id": "ft-cheap" if cheap else "ft-default"}
    if cheap:
        hb, ttl = args.ft_cheap_heartbeat_s, args.ft_cheap_ttl_s
        run |= {"heartbeat_interval_s": hb, "lease_ttl_s": ttl, "grant_tokens": 0}
    else:
        run |= {"heartbeat_interval_s": DEFAULT_HEARTBEAT_S, "lease_ttl_s": DEFAULT_TTL_S}
    sw = LocalSwarm(workdir=workdir, preset=preset, stages=2, run_config=run)
    node = sw.write_node_config(outer_every_steps=args.ft_outer_every_steps)
    sw.node_args = ["--config", str(node)]
    return sw


def _trained(sw: Any) -> float:
    return float(sum(sw.scrape(n).get("agora_node_tokens_total", 0.0) for n, s in NODES if s == 0))


def _serving(sw: Any) -> bool:
    return all(
        sw.scrape(n).get("agora_node_tokens_total" if s == 0 else "agora_p2p_served_total", 0.0) > 0
        for n, s in NODES
    )


def _pids(sw: Any) -> dict[str, int]:
    return {n: p.popen.pid for n, p in sw.nodes.items()} | {"coordinator": sw.coordinator.popen.pid}


def measure_ft_overhead(
    preset: str,
    workdir: Path,
    *,
    warmup_s: float,
    window_s: float,
    args: Any,
    quiet: bool,
) -> dict[str, Any]:
    """Run the default and the cheap swarm side by side; their rates and the overhead."""
    swarms = {
        "default": _swarm(workdir / "ft-default", preset, cheap=False, args=args),
        "cheap": _swarm(workdir / "ft-cheap", preset, cheap=True, args=args),
    }
    intervals = max(1, args.ft_intervals)
    samples: list[dict[str, tuple[float, float]]] = []  # per sample: swarm -> (tokens, cpu)
    cpu_at: list[dict[str, dict[str, float]]] = []  # first and last: swarm -> process -> cpu
    times: list[float] = []
    try:
        for sw in swarms.values():
            sw.start_coordinator()
        for name, stage in NODES:  # interleaved, so neither swarm starts first
            for key, sw in swarms.items():
                ckpt = ["--checkpoint-dir", str(sw.workdir / "checkpoints" / name)]
                sw.add_node(name, stage, *(ckpt if key == "default" else []))
        say("fault-tolerance overhead: two swarms starting side by side", quiet)
        for key, sw in swarms.items():
            sw.wait_for(lambda sw=sw: _serving(sw), f"the {key} swarm's nodes training", 300)
        say(f"both swarms train; window starts in {warmup_s:.0f} s", quiet)
        start = time.monotonic()
        first = swarms["default"]
        first.wait_for(lambda: time.monotonic() - start >= warmup_s, "warm-up", warmup_s + 5, 0.2)
        say(f"measuring for {window_s:.0f} s in {intervals} intervals", quiet)
        t0 = time.monotonic()
        for i in range(intervals + 1):
            if i:
                due = t0 + window_s * i / intervals
                first.wait_for(lambda due=due: time.monotonic() >= due, "interval", window_s, 0.2)
            times.append(time.monotonic())
            cpu = {k: {n: cpu_seconds(p) for n, p in _pids(sw).items()} for k, sw in swarms.items()}
            samples.append({k: (_trained(sw), sum(cpu[k].values())) for k, sw in swarms.items()})
            if i in (0, intervals):
                cpu_at.append(cpu)
        for key, sw in swarms.items():
            for name, proc in sw.nodes.items():
                if not proc.alive():
                    raise RuntimeError(f"{key} swarm: node {name} exited:\n{proc.tail()}")
        codes = {key: sw.stop(timeout_s=90) for key, sw in swarms.items()}
    finally:
        for sw in swarms.values():
            sw.kill_all()
    wall = times[-1] - times[0]

    def rate(key: str, a: int, b: int) -> float:
        return (samples[b][key][0] - samples[a][key][0]) / (times[b] - times[a])

    def overhead(a: int, b: int) -> float | None:
        cheap = rate("cheap", a, b)
        return 100.0 * (1.0 - rate("default", a, b) / cheap) if cheap > 0 else None

    per = [overhead(i, i + 1) for i in range(intervals)]
    per_ok = [p for p in per if p is not None]
    out: dict[str, Any] = {
        key: {
            "tokens": samples[-1][key][0] - samples[0][key][0],
            "seconds": wall,
            "tokens_per_s": rate(key, 0, intervals),
            "cpu_seconds": samples[-1][key][1] - samples[0][key][1],
            "cpu_seconds_by_process": {n: cpu_at[1][key][n] - t for n, t in cpu_at[0][key].items()},
            "exit_codes": codes[key],
        }
        for key in swarms
    }
    for key in swarms:
        out[key]["cpu_seconds_per_1k_tokens"] = (
            1000.0 * out[key]["cpu_seconds"] / out[key]["tokens"] if out[key]["tokens"] else None
        )
    cd, cc = out["default"]["cpu_seconds_per_1k_tokens"], out["cheap"]["cpu_seconds_per_1k_tokens"]
    out["settings"] = {
        "default": f"heartbeat {DEFAULT_HEARTBEAT_S} s, TTL {DEFAULT_TTL_S} s, 8192-token"
        " grants, checkpoints every applied round",
        "cheap": f"heartbeat {args.ft_cheap_heartbeat_s} s, TTL {args.ft_cheap_ttl_s} s,"
        " whole-shard grants, no checkpoints",
        "both": f"{preset} preset, outer_every_steps {args.ft_outer_every_steps}, run at once",
    }
    out["ft_overhead_pct"] = overhead(0, intervals)
    out["ft_overhead_pct_intervals"] = per
    out["ft_overhead_pct_stdev"] = statistics.stdev(per_ok) if len(per_ok) > 1 else None
    out["ft_overhead_cpu_pct"] = 100.0 * (cd / cc - 1.0) if cd and cc else None
    return out


def add_arguments(p: Any) -> None:
    p.add_argument(
        "--ft-overhead", action="store_true", default=True,
        help="measure ft_overhead_pct: default vs cheapest fault-tolerance settings, two"
        " swarms at once (default on)",
    )  # fmt: skip
    p.add_argument("--no-ft-overhead", dest="ft_overhead", action="store_false")
    p.add_argument("--ft-only", action="store_true", help="only the ft_overhead_pct run")
    p.add_argument("--ft-window-s", type=float, default=120.0, help="its window (s)")
    p.add_argument("--ft-intervals", type=int, default=6, help="intervals of its window")
    p.add_argument(
        "--ft-outer-every-steps", type=int, default=4,
        help="nodes' outer_every_steps in both swarms (rounds carry commits and checkpoints)",
    )  # fmt: skip
    p.add_argument("--ft-cheap-heartbeat-s", type=float, default=15.0)
    p.add_argument("--ft-cheap-ttl-s", type=float, default=300.0)
