"""`agora bench efficiency`: swarm tokens/s divided by centralised tokens/s, same cores.

One invocation measures, one after another on the same machine:

1. **centralised**: one process, `--central-threads` torch threads (default: every
   core), the same preset and subspace model trained with `node.baseline.train_step`
   (the shared step function) at `--central-batch` sequences of 128 tokens per step
   (default 32, i.e. 4096 tokens: the swarm's tokens per inner step per replica), for
   `--central-seconds` after a short warm-up, and again with 1 thread. Both are
   measured again before each swarm run, and each ratio uses the measurements next to
   it (the box is shared: load moves). `ratio_*` divides by the faster of the two
   centralised runs (on an oversubscribed box 2 threads can be slower than 1);
   `ratio_*_vs_N_threads` by the N-thread run alone; `cpu_ratio_*` compares tokens per
   CPU-second with the 1-thread run (the swarm's overhead, whatever the load);
2. **swarm on loopback**: `LocalSwarm`, a coordinator and 2 stages x 2 replicas, one
   torch thread each (4 threads on the same cores), the node's default settings, the
   DiLoCo outer loop included (`outer_every_steps` 25 today; `--outer-every-steps`
   overrides it, 0 turns it off). Tokens/s is measured over a steady-state window
   (`--window-s` seconds, starting `--warmup-s` after the first trained micro-batch): the
   stage-0 replicas' trained tokens with the outer loop on (commits then come in
   outer-round lumps), the coordinator's committed tokens without it;
3. **swarm through a shaped link**: the same, with the coordinator and every node behind
   a link of its own in `bench.shaping_proxy` (userspace: this kernel has no sch_netem,
   so netem in a network namespace is not available), 80 Mbit/s per direction and 20 ms
   each way (40 ms RTT) by default. A node's uplink carries everything it sends, to any
   peer, from any of its processes: its data plane and its outer loop's DHT both listen
   on real ports and announce the proxy's (the node settings `announce` and
   `outer_announce`), the proxy charges a connection to the host whose processes opened
   it, and the JSON lists any connection that reached a real port without the proxy
   (`connections_bypassing_the_link`, should be empty).

4. **fault-tolerance overhead** (`--ft-overhead`, on by default; `--ft-only` runs only
   it): two swarms at once on the same cores, one with heartbeats, leases, commits and
   checkpoints at their defaults and one with them at their cheapest (long heartbeat
   interval and TTL, whole-shard grants, no checkpoints), DiLoCo rounds every
   `--ft-outer-every-steps` in both; `ft_overhead_pct` is how much lower the default
   swarm's stage-0 trained tokens/s is, over one window and per interval
   (bench/efficiency_ft.py says exactly how it is measured).

It also reads where the time goes: CPU seconds over the window of the coordinator and of
each node with every process under it (outer-loop process, hivemind DHT, p2p daemon; the
proxy's are reported but not counted as the swarm's), the
stage-0 micro-batch round trip (`agora_node_microbatch_seconds`), retries, boundary wire
bytes, and the 1-thread centralised rate (two cores of perfect pipelining would give
twice it), and the outer rounds the nodes applied in the window.

`--preset small` (default) is the demo's model; `tiny` is sized for tests (a few ms of
compute per micro-batch), so fixed per-micro-batch costs dominate it: a worst case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import shaping_proxy
from bench.efficiency_ft import add_arguments as add_ft_arguments
from bench.efficiency_ft import cpu_seconds, measure_ft_overhead, say
from protocol.pinning import parse_address

NODES = (("a0", 0), ("b0", 0), ("a1", 1), ("b1", 1))
SEQ_LEN = 128  # tokens per sequence, as the nodes' default
PROXY = "shaping proxy"  # its CPU is the emulated network's, not the swarm's


def _outer_every_steps(flag: int | None) -> int:
    """The nodes' outer_every_steps: the flag's, else the node's default."""
    from node.config import NodeConfig

    default = NodeConfig.__dataclass_fields__["outer_every_steps"].default
    assert isinstance(default, int)
    return default if flag is None else flag


_say = say


# --- centralised -------------------------------------------------------------------------


def measure_central(preset: str, threads: int, batch: int, seconds: float) -> dict[str, Any]:
    """Tokens/s of the centralised trainer (node.baseline.train_step) for `seconds`."""
    import torch

    from node.baseline import ChainedStages, TrainConfig, train_step
    from node.data import RandomBatches, load_dataset
    from node.model import param_groups

    torch.set_num_threads(threads)
    cfg = TrainConfig(preset=preset, batch_size=batch, seq_len=SEQ_LEN, steps=10**9)
    torch.manual_seed(cfg.seed)
    model = ChainedStages(cfg.model_config(), 1, None)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    batches = RandomBatches(load_dataset(None).train, batch, SEQ_LEN, seed=cfg.seed)
    for _ in range(3):  # warm-up: allocator, first-call overheads
        train_step(model, opt, next(batches), cfg.lr, cfg.grad_clip)
    steps, loss = 0, float("nan")
    cpu0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        loss = train_step(model, opt, next(batches), cfg.lr, cfg.grad_clip)
        steps += 1
    wall = time.perf_counter() - t0
    tokens = steps * batch * SEQ_LEN
    return {
        "threads": threads,
        "batch_tokens": batch * SEQ_LEN,
        "steps": steps,
        "tokens": tokens,
        "seconds": wall,
        "cpu_seconds": time.process_time() - cpu0,
        "tokens_per_s": tokens / wall,
        "last_loss": loss,
    }


# --- swarm -------------------------------------------------------------------------------


_cpu_seconds = cpu_seconds


@dataclass
class Shaping:
    rate_mbit: float  # Mbit/s per direction of each host's link
    delay_ms: float  # one-way delay, ms
    proxy: subprocess.Popen[bytes] | None = None
    stats_file: Path | None = None
    owners_file: Path | None = None
    owners: dict[str, int] = field(default_factory=dict)  # host -> root pid
    real_ports: set[int] = field(default_factory=set)  # ports only the proxy should dial


def _start_proxy(sh: Shaping, workdir: Path, routes: list[str]) -> None:
    sh.stats_file = workdir / "proxy-stats.json"
    sh.owners_file = workdir / "proxy-owners.json"
    _write_owners(sh)
    sh.proxy = shaping_proxy.spawn(
        workdir, "proxy",
        ["--rate-mbit", str(sh.rate_mbit), "--delay-ms", str(sh.delay_ms),
         "--stats", str(sh.stats_file), "--owners", str(sh.owners_file),
         *[f"--route={r}" for r in routes]],
    )  # fmt: skip


def _write_owners(sh: Shaping) -> None:
    assert sh.owners_file is not None
    tmp = sh.owners_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(sh.owners))
    tmp.replace(sh.owners_file)


def _node_values(outer_every_steps: int | None) -> dict[str, Any]:
    """The node settings every swarm node gets: the node's defaults, but for the outer
    loop's round length when the bench is given one."""
    return {} if outer_every_steps is None else {"outer_every_steps": outer_every_steps}


def _start_shaped(sw: Any, sh: Shaping, workdir: Path, outer_every_steps: int | None) -> None:
    """The coordinator and every node behind its own link: each node's data plane and
    outer-loop DHT listen on real ports and announce the proxy's (node settings
    `announce` and `outer_announce`), so all they send crosses their link."""
    from swarmlab.procs import free_port

    coord = parse_address(sw.address)
    coord_ann = free_port()
    routes = [f"coordinator:{coord_ann}={coord.port}"]
    sh.real_ports.add(coord.port)
    assert sw.coordinator is not None
    sh.owners["coordinator"] = sw.coordinator.popen.pid
    configs = {}
    for name, _ in NODES:
        real, ann, outer_real, outer_ann = (free_port() for _ in range(4))
        routes += [f"{name}:{ann}={real}", f"{name}:{outer_ann}={outer_real}"]
        sh.real_ports |= {real, outer_real}
        values = _node_values(outer_every_steps) | {
            "listen": f"/ip4/127.0.0.1/tcp/{real}",
            "announce": [f"/ip4/127.0.0.1/tcp/{ann}"],
            "outer_port": outer_real,
            "outer_announce": [f"/ip4/127.0.0.1/tcp/{outer_ann}"],
        }
        configs[name] = sw.write_node_config(name, **values)
    _start_proxy(sh, workdir, routes)
    sw.address = str(replace(coord, port=coord_ann))  # the nodes dial the coordinator's link
    for name, stage in NODES:
        sh.owners[name] = sw.add_node(name, stage, "--config", str(configs[name])).popen.pid
        _write_owners(sh)


def _histogram(scraped: dict[str, float], name: str) -> tuple[float, float]:
    return scraped.get(f"{name}_sum", 0.0), scraped.get(f"{name}_count", 0.0)


def _stage0_snapshot(sw: Any) -> dict[str, float]:
    out = {"mb_sum": 0.0, "mb_count": 0.0, "retried": 0.0, "wire": 0.0, "trained": 0.0}
    for name, stage in NODES:
        s = sw.scrape(name)
        if stage == 0:
            total, count = _histogram(s, "agora_node_microbatch_seconds")
            out["mb_sum"] += total
            out["mb_count"] += count
            out["retried"] += s.get('agora_node_microbatches_total{result="retried"}', 0.0)
            out["trained"] += s.get("agora_node_tokens_total", 0.0)
        out["wire"] += sum(
            v
            for k, v in s.items()
            if k.startswith("agora_node_boundary_bytes_total{") and 'kind="wire"' in k
        )
    return out


def measure_swarm(
    preset: str,
    workdir: Path,
    *,
    warmup_s: float,
    window_s: float,
    shaping: Shaping | None,
    outer_every_steps: int | None,
    quiet: bool,
) -> dict[str, Any]:
    from swarmlab.swarm import LocalSwarm

    workdir.mkdir(parents=True, exist_ok=True)
    sw = LocalSwarm(workdir=workdir, preset=preset, stages=2)
    outer_on = _outer_every_steps(outer_every_steps) > 0
    try:
        sw.start_coordinator()
        if shaping is None:
            config = sw.write_node_config(**_node_values(outer_every_steps))
            for name, stage in NODES:
                sw.add_node(name, stage, "--config", str(config))
        else:
            _start_shaped(sw, shaping, workdir, outer_every_steps)
        _say("swarm starting (4 nodes import torch and build their stages)", quiet)
        sw.wait_for(
            lambda: _stage0_snapshot(sw)["trained"] > 0, "the first trained micro-batch", 240
        )
        first = time.monotonic()
        _say(f"training; steady-state window starts in {warmup_s:.0f} s", quiet)
        sw.wait_for(lambda: time.monotonic() - first >= warmup_s, "warm-up", warmup_s + 5, 0.2)
        for name, proc in sw.nodes.items():
            if not proc.alive():
                raise RuntimeError(f"node {name} exited:\n{proc.tail()}")
        pids = {n: p.popen.pid for n, p in sw.nodes.items()}
        assert sw.coordinator is not None
        pids["coordinator"] = sw.coordinator.popen.pid
        if shaping is not None and shaping.proxy is not None:
            pids[PROXY] = shaping.proxy.pid
        st0, t0 = sw.status(), time.monotonic()
        cpu0 = {n: _cpu_seconds(p) for n, p in pids.items()}
        snap0 = _stage0_snapshot(sw)
        _say(f"measuring for {window_s:.0f} s", quiet)
        sw.wait_for(lambda: time.monotonic() - t0 >= window_s, "the window", window_s + 5, 0.2)
        st1, t1 = sw.status(), time.monotonic()
        cpu1 = {n: _cpu_seconds(p) for n, p in pids.items()}
        snap1 = _stage0_snapshot(sw)
        losses = {n: sw.scrape(n).get("agora_node_loss") for n, s in NODES if s == 0}
        rounds = sum(sw.scrape(n).get("agora_node_outer_steps_total", 0.0) for n, _ in NODES)
        bypassing = (
            shaping_proxy.bypassing(
                shaping.real_ports, shaping.proxy.pid if shaping.proxy else None
            )
            if shaping is not None
            else []
        )
        codes = sw.stop()
        _say(f"swarm stopped: exit codes {codes}", quiet)
    finally:
        sw.kill_all()
        if shaping is not None and shaping.proxy is not None:
            shaping_proxy.stop(shaping.proxy)
    wall = t1 - t0
    tokens = st1.committed_tokens - st0.committed_tokens
    mbs = snap1["mb_count"] - snap0["mb_count"]
    trained = snap1["trained"] - snap0["trained"]
    committed_or_trained = trained if outer_on else tokens
    out: dict[str, Any] = {
        "tokens": committed_or_trained,
        "committed_tokens": tokens,
        "trained_tokens": trained,
        "seconds": wall,
        "committed_tokens_per_s": tokens / wall,
        "trained_tokens_per_s": trained / wall,
        # Without outer rounds a micro-batch is committed as it finishes, so committed
        # tokens are the measure; with them commits come in outer-round lumps, so the
        # tokens stage 0 finished backward for are.
        "tokens_per_s": committed_or_trained / wall,
        "measured_as": (
            "stage-0 agora_node_tokens_total over the window"
            if outer_on
            else "coordinator committed tokens over the window"
        ),
        "coordinator_tokens_per_s": st1.tokens_per_s,
        "microbatches": mbs,
        "microbatch_round_trip_s": (snap1["mb_sum"] - snap0["mb_sum"]) / mbs if mbs else None,
        "retried": snap1["retried"] - snap0["retried"],
        "boundary_wire_bytes_per_s": (snap1["wire"] - snap0["wire"]) / wall,
        # each process with every process under it (node.efficiency_ft.cpu_seconds)
        "cpu_seconds": {n: cpu1[n] - cpu0[n] for n in pids},
        "cpu_cores_used": sum(cpu1[n] - cpu0[n] for n in pids if n != PROXY) / wall,
        "outer_rounds_applied": rounds,
        "stage0_loss_at_end": losses,
        "exit_codes": codes,
    }
    if shaping is not None and shaping.stats_file is not None and shaping.stats_file.exists():
        proxied = json.loads(shaping.stats_file.read_text())
        out["proxy"] = {
            "rate_mbit": shaping.rate_mbit,
            "delay_ms_each_way": shaping.delay_ms,
            "bytes_sent": sum(h["bytes_up"] for h in proxied["hosts"].values()),
            "unattributed_bytes": proxied["unattributed_bytes"],
            "connections_bypassing_the_link": bypassing,
            "hosts": proxied["hosts"],
        }
    return out


# --- report ------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"agora bench efficiency ({result['preset']} preset)")
    for col in ("run", "tokens/s", "ratio", "cores used", "mb round trip", "retries"):
        table.add_column(col, justify="right" if col != "run" else "left")
    for key in ("loopback", "shaped"):
        c = result.get(f"central_{key}")
        if c is None:
            continue
        for sub in ("threads_n", "threads_1"):
            m = c[sub]
            table.add_row(
                f"centralised, {m['threads']} thread(s), before {key}",
                f"{m['tokens_per_s']:.0f}", "", f"{m['cpu_seconds'] / m['seconds']:.2f}", "", "",
            )  # fmt: skip
    for key, label in (("loopback", "swarm 2x2, loopback"), ("shaped", "swarm 2x2, shaped link")):
        s = result.get(f"swarm_{key}")
        if s is None:
            continue
        rt = s["microbatch_round_trip_s"]
        table.add_row(
            label,
            f"{s['tokens_per_s']:.0f}",
            f"{result[f'ratio_{key}']:.3f}",
            f"{s['cpu_cores_used']:.2f}",
            f"{rt * 1000:.0f} ms" if rt else "-",
            f"{s['retried']:.0f}",
        )
    ft = result.get("ft")
    if ft is not None:
        for key in ("default", "cheap"):
            m = ft[key]
            table.add_row(
                f"swarm 2x2, fault tolerance {key} (side by side)", f"{m['tokens_per_s']:.0f}",
                "", f"{m['cpu_seconds'] / m['seconds']:.2f}", "", "",
            )  # fmt: skip
    console = Console()
    console.print(table)
    if ft is not None:
        pct, sd = ft["ft_overhead_pct"], ft["ft_overhead_pct_stdev"]
        cpu = ft["ft_overhead_cpu_pct"]
        console.print(
            f"ft_overhead_pct = {pct:.2f} % (per-interval stdev {sd:.2f} points); "
            f"CPU seconds per token: {cpu:+.2f} %"
            if pct is not None and sd is not None and cpu is not None
            else f"ft_overhead_pct = {pct} (stdev {sd}, cpu {cpu})"
        )
    for key in ("loopback", "shaped"):
        if f"ratio_{key}" in result:
            console.print(
                f"ratio_{key} = {result[f'ratio_{key}']:.3f} (vs the faster centralised run); "
                f"vs {result['central_loopback']['threads_n']['threads']} threads only: "
                f"{result[[k for k in result if k.startswith(f'ratio_{key}_vs_')][0]]:.3f}; "
                f"tokens per CPU-second vs 1-thread centralised: {result[f'cpu_ratio_{key}']:.3f}"
            )
    console.print(f"load average {result['loadavg_start']} -> {result['loadavg_end']}")


def _central_pair(args: argparse.Namespace, quiet: bool) -> dict[str, Any]:
    """The centralised rate with every core's threads and with one thread, back to back."""
    n = args.central_threads
    _say(f"centralised, {n} threads, {args.central_seconds:.0f} s", quiet)
    many = measure_central(args.preset, n, args.central_batch, args.central_seconds)
    _say(f"centralised, {n} threads: {many['tokens_per_s']:.0f} tokens/s; now 1 thread", quiet)
    one = measure_central(args.preset, 1, args.central_batch, args.central_seconds)
    _say(f"centralised, 1 thread: {one['tokens_per_s']:.0f} tokens/s", quiet)
    return {"threads_n": many, "threads_1": one}


def _parser() -> argparse.ArgumentParser:
    from swarmlab.procs import workdir_path

    p = argparse.ArgumentParser(
        prog="agora bench efficiency",
        description="Swarm tokens/s (2 stages x 2 replicas) over centralised tokens/s on the"
        " same cores, on loopback and through an emulated consumer link.",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--central-threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the centralised run (default: every core)")  # fmt: skip
    p.add_argument("--central-batch", type=int, default=32,
                   help="sequences per centralised step (default 32 = 4096 tokens)")  # fmt: skip
    p.add_argument("--central-seconds", type=float, default=30.0, help="centralised timing (s)")
    p.add_argument("--warmup-s", type=float, default=30.0, help="swarm warm-up after 1st commit")
    p.add_argument(
        "--window-s", type=float, default=150.0,
        help="swarm measurement window (s; default 150, a few outer rounds at the defaults)",
    )  # fmt: skip
    p.add_argument("--rate-mbit", type=float, default=80.0, help="shaped link rate (Mbit/s)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="shaped one-way delay (ms)")
    p.add_argument(
        "--outer-every-steps", type=int, default=None,
        help="nodes' DiLoCo outer_every_steps (default: the node's; 0 = pipeline only)",
    )  # fmt: skip
    p.add_argument("--no-shaped", action="store_true", help="skip the shaped-link run")
    p.add_argument("--workdir", type=workdir_path, help="keep logs here (default: a temporary dir)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_ft_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from node.model import PRESETS

    if args.preset not in PRESETS:
        print(f"agora bench efficiency: unknown preset {args.preset!r}", file=sys.stderr)
        return 2
    if args.central_threads < 1 or args.window_s <= 0 or args.central_seconds <= 0:
        print(
            "agora bench efficiency: threads, window and seconds must be positive", file=sys.stderr
        )
        return 2
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="agora-efficiency-")
        workdir = Path(tmp.name)
    else:
        workdir = args.workdir
        workdir.mkdir(parents=True, exist_ok=True)
    q = args.quiet
    result: dict[str, Any] = {
        "preset": args.preset,
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "swarm": "2 stages x 2 replicas, 1 torch thread per node, default node settings"
        + (
            ""
            if args.outer_every_steps is None
            else f" but outer_every_steps {args.outer_every_steps}"
        ),
        "outer_every_steps": _outer_every_steps(args.outer_every_steps),
        "outer_every_steps_source": "node default" if args.outer_every_steps is None else "flag",
    }
    started = time.perf_counter()
    try:
        for key, shaping in (
            ("loopback", None),
            ("shaped", Shaping(args.rate_mbit, args.delay_ms)),
        ):
            if args.ft_only or (key == "shaped" and args.no_shaped):
                continue
            central = _central_pair(args, q)
            result[f"central_{key}"] = central
            swarm = measure_swarm(
                args.preset, workdir / key,
                warmup_s=args.warmup_s, window_s=args.window_s, shaping=shaping,
                outer_every_steps=args.outer_every_steps, quiet=q,
            )  # fmt: skip
            result[f"swarm_{key}"] = swarm
            _say(f"{key} swarm: {swarm['tokens_per_s']:.0f} tokens/s", q)
            best = max(central["threads_n"]["tokens_per_s"], central["threads_1"]["tokens_per_s"])
            result[f"ratio_{key}"] = swarm["tokens_per_s"] / best
            result[f"ratio_{key}_vs_{args.central_threads}_threads"] = (
                swarm["tokens_per_s"] / central["threads_n"]["tokens_per_s"]
            )
            swarm_cpu = sum(v for n, v in swarm["cpu_seconds"].items() if v == v and n != PROXY)
            c1 = central["threads_1"]
            result[f"cpu_ratio_{key}"] = (swarm["tokens"] / swarm_cpu) / (
                c1["tokens"] / c1["cpu_seconds"]
            )
            if shaping is not None:
                result["shaping"] = (
                    "userspace TCP proxy (bench.shaping_proxy): this kernel has no sch_netem; "
                    f"each host (node, coordinator) behind one link of {args.rate_mbit} Mbit/s "
                    f"per direction for all it sends or receives (stage and outer loop), "
                    f"{args.delay_ms} ms each way"
                )
        if args.ft_overhead or args.ft_only:
            ft = measure_ft_overhead(
                args.preset, workdir / "ft", warmup_s=args.warmup_s, window_s=args.ft_window_s,
                args=args, quiet=q,
            )  # fmt: skip
            result["ft"] = ft
            result["ft_overhead_pct"] = ft["ft_overhead_pct"]
            _say(f"ft_overhead_pct {ft['ft_overhead_pct']}", q)
    except KeyboardInterrupt:
        print("agora bench efficiency: interrupted", file=sys.stderr)
        return 130
    finally:
        if tmp is not None:
            tmp.cleanup()
    result["loadavg_end"] = os.getloadavg()
    result["wall_seconds"] = time.perf_counter() - started
    print_table(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
