"""`agora bench convergence`: centralised baseline vs the swarm at equal tokens.

Three runs on the same model preset, seed, corpus and held-out set:
1. **central**: `node.baseline.train` on one process (the reference);
2. **swarm**: a real coordinator and 2 stages x 2 replicas on loopback (`LocalSwarm`),
   `subspace_int4` boundaries, DiLoCo outer rounds, trained until the coordinator has
   committed the same number of tokens, then drained;
3. **swarm + churn**: the same, but a replica is SIGKILLed and a fresh node started in
   its place `--kills` times (stage 0 first, then stage 1, ...) during the run.

A swarm's model is evaluated the way a user would get it: every node writes its stage's
theta_g to its own `--checkpoint-dir`, `node.export` assembles the newest state of each
stage, and `node.baseline.evaluate_weights` computes the held-out loss on the same
batches the central run is evaluated on. The traffic numbers come from the nodes'
Prometheus metrics (the last scrape of a killed node counts): `outer_bytes` is the sum of
`agora_node_outer_bytes_total` (pseudo-gradient bytes sent), `ddp_equivalent_bytes` what a
ring all-reduce of fp32 gradients at every inner step would have sent for the same inner
steps (each replica sends `2 (R-1)/R x 4 x numel(stage)` bytes per step, R replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from node.baseline import TrainConfig, evaluate_weights, rich_progress, train
from node.data import Dataset, load_dataset
from node.export import export_checkpoints
from node.model import build_stage, load_export, preset
from swarmlab.procs import workdir_path
from swarmlab.swarm import LocalSwarm

STAGES = 2
REPLICAS = 2
CODEC = "subspace_int4"
SCRAPED = (
    "agora_node_outer_bytes_total",
    "agora_node_tokens_total",
    "agora_node_outer_steps_total",
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora bench convergence",
        description="Held-out loss of the centralised baseline and of a 2-stage x 2-replica"
        " swarm (subspace_int4, DiLoCo), without and with churn, at equal tokens; outer-step"
        " bytes against a per-step fp32 all-reduce.",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--preset", default="tiny",
        help="model preset (default tiny: the bench preset does not fit 15 min on 2 cores)",
    )  # fmt: skip
    p.add_argument("--tokens", type=int, default=150_000, help="training tokens per run")
    p.add_argument("--batch-size", type=int, default=16, help="central sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak inner/central lr (default 2e-3)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps, central and inner")
    p.add_argument("--micro-batch", type=int, default=8, help="swarm sequences per micro-batch")
    p.add_argument(
        "--inner-batch-tokens", type=int, default=None,
        help="tokens per inner step per replica (default: central batch / replicas)",
    )  # fmt: skip
    p.add_argument(
        "--outer-every-steps", type=int, default=25, help="inner steps per round (default 25)"
    )
    p.add_argument("--outer-compression", default="uint8", help="none | fp16 | uint8")
    p.add_argument(
        "--participation-power", type=float, default=None,
        help="p of eta_r = eta min(1, tokens/target)^p (default: the node's)",
    )  # fmt: skip
    p.add_argument("--outer-lr", type=float, default=None, help="eta (default: the node's)")
    p.add_argument("--outer-momentum", type=float, default=None, help="mu (default: the node's)")
    p.add_argument("--kills", type=int, default=2, help="kill+join events in the churn run")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches")
    p.add_argument(
        "--runs", default="central,swarm,churn",
        help="comma-separated subset of central, swarm, churn (default all)",
    )  # fmt: skip
    p.add_argument("--workdir", type=workdir_path, default="bench-convergence", help="logs, state")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per swarm run")
    p.add_argument("--seed", type=int, default=0, help="run seed")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


@dataclass
class SwarmRun:
    eval_loss: float
    tokens_committed: int
    tokens_trained: int  # stage-0 tokens through the pipeline (re-trained ones included)
    outer_bytes: float
    inner_steps: dict[int, float]  # stage -> inner steps summed over its replicas
    outer_rounds: float  # outer steps applied, summed over nodes
    seconds: float
    audit_clean: bool
    rounds: dict[int, int]  # stage -> round of the exported state
    events: list[str] = field(default_factory=list)


def _node_config(args: argparse.Namespace, inner_tokens: int) -> dict[str, Any]:
    """The nodes' `[node]` settings; None (an option not given) leaves the node default."""
    return {
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "inner_batch_tokens": inner_tokens,
        "lr": args.lr,
        "warmup_steps": args.warmup,
        "outer_every_steps": args.outer_every_steps,
        "outer_compression": args.outer_compression,
        "checkpoint_every_rounds": 1,
        "outer_participation_power": args.participation_power,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
    }


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


def run_swarm(
    args: argparse.Namespace, dataset: Dataset, inner_tokens: int, *, churn: bool
) -> SwarmRun:
    label = "churn" if churn else "swarm"
    workdir = args.workdir / label
    if workdir.exists():
        import shutil

        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    swarm = LocalSwarm(workdir=workdir, preset=args.preset, stages=STAGES, codec=CODEC)
    toml = swarm.write_node_config(**_node_config(args, inner_tokens))
    swarm.node_args = ["--config", str(toml)]
    ckpt: dict[str, Path] = {}
    last: dict[str, dict[str, float]] = {}  # node -> last scraped metrics

    def add(name: str, stage: int) -> None:
        ckpt[name] = workdir / "ckpt" / name
        swarm.add_node(name, stage, "--checkpoint-dir", str(ckpt[name]))

    def scrape() -> None:
        for name, proc in swarm.nodes.items():
            if proc.alive():
                got = swarm.scrape(name)
                if got:
                    last[name] = {k: got.get(k, 0.0) for k in SCRAPED}

    events: list[str] = []
    kill_at = [args.tokens * (i + 1) / (args.kills + 1) for i in range(args.kills)] if churn else []
    t0 = time.monotonic()
    try:
        swarm.start_coordinator()
        names = {0: ["s0-a", "s0-b"], 1: ["s1-a", "s1-b"]}
        for stage, ns in names.items():
            for n in ns:
                add(n, stage)
        deadline = t0 + args.run_timeout
        committed, next_id = 0, 0
        while committed < args.tokens:
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{p.tail(8)}" for n, p in swarm.nodes.items())
                raise TimeoutError(
                    f"{label}: {committed} of {args.tokens} tokens after {args.run_timeout:.0f}s"
                    f"\n{tails}"
                )
            time.sleep(2.0)
            for proc in swarm.nodes.values():
                if not proc.alive() and proc.popen.returncode not in (-9, 0):
                    raise RuntimeError(f"node {proc.name} crashed:\n{proc.tail(30)}")
            try:
                committed = swarm.status().committed_tokens
            except Exception:  # the coordinator is busy; try again next poll
                continue
            scrape()
            _say(args.quiet, f"  [{label} {time.monotonic() - t0:5.0f}s] committed {committed:,}")
            if kill_at and committed >= kill_at[0]:
                kill_at.pop(0)
                stage = next_id % STAGES
                victim = names[stage][1]
                swarm.nodes[victim].signal(signal.SIGKILL)
                swarm.nodes[victim].popen.wait(10)
                fresh = f"s{stage}-{chr(ord('c') + next_id // STAGES)}"
                add(fresh, stage)
                names[stage][1] = fresh
                next_id += 1
                events.append(f"{committed} tokens: killed {victim}, started {fresh}")
                _say(args.quiet, f"  >>> {events[-1]}")
        scrape()
        codes = swarm.stop_nodes(timeout_s=120.0)
        committed = swarm.status().committed_tokens
        swarm.stop_coordinator()
    finally:
        swarm.kill_all()
    seconds = time.monotonic() - t0
    bad = {n: c for n, c in codes.items() if c not in (0, -9)}
    if bad:
        raise RuntimeError(f"{label}: nodes exited badly {bad}")
    audit = swarm.audit()
    export_dir = workdir / "export"
    # a node killed before its first applied round never wrote a checkpoint
    got = export_checkpoints([d for d in ckpt.values() if d.is_dir()], export_dir)
    config, tensors = load_export(export_dir)
    loss = evaluate_weights(
        config, tensors, dataset,
        batch_size=args.batch_size, seq_len=args.seq_len, n_batches=args.eval_batches,
    )  # fmt: skip
    steps: dict[int, float] = {s: 0.0 for s in range(STAGES)}
    for name, m in last.items():
        steps[int(name[1])] += m["agora_node_tokens_total"] / inner_tokens
    return SwarmRun(
        eval_loss=loss,
        tokens_committed=committed,
        tokens_trained=_stage0_trained(swarm, last),
        outer_bytes=sum(m["agora_node_outer_bytes_total"] for m in last.values()),
        inner_steps=steps,
        outer_rounds=sum(m["agora_node_outer_steps_total"] for m in last.values()),
        seconds=seconds,
        audit_clean=audit.clean,
        rounds=got.rounds,
        events=events,
    )


def ddp_bytes(preset_name: str, seed: int, inner_steps: dict[int, float]) -> float:
    """Bytes a ring all-reduce of fp32 gradients at every inner step would have sent."""
    cfg = preset(preset_name).replace(seed=seed)
    ring = 2 * (REPLICAS - 1) / REPLICAS
    total = 0.0
    for s, steps in inner_steps.items():
        numel = sum(p.numel() for p in build_stage(cfg, s, STAGES).parameters())
        total += steps * ring * 4 * numel
    return total


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    runs = set(args.runs.split(","))
    if not runs <= {"central", "swarm", "churn"} or not runs:
        print(f"agora bench convergence: bad --runs {args.runs!r}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("AGORA_TORCH_THREADS", "1")))
    dataset = load_dataset()
    central_tokens = args.batch_size * args.seq_len
    inner_tokens = args.inner_batch_tokens or max(args.micro_batch * args.seq_len,
                                                  central_tokens // REPLICAS)  # fmt: skip
    out: dict[str, Any] = {
        "preset": args.preset,
        "tokens_target": args.tokens,
        "stages": STAGES,
        "replicas": REPLICAS,
        "codec": CODEC,
        "outer_compression": args.outer_compression,
        "outer_every_steps": args.outer_every_steps,
        "inner_batch_tokens": inner_tokens,
        "central_batch_tokens": central_tokens,
        "lr": args.lr,
        "participation_power": args.participation_power,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "kills": args.kills,
    }
    t_start = time.monotonic()
    try:
        for key, churn in (("swarm", False), ("churn", True)):
            if key not in runs:
                continue
            _say(args.quiet, f"{key}: 2 stages x 2 replicas, {args.tokens:,} tokens")
            r = run_swarm(args, dataset, inner_tokens, churn=churn)
            sfx = "" if not churn else "_churn"
            out[f"eval_loss_swarm{sfx}"] = r.eval_loss
            out[f"tokens_swarm{sfx}"] = r.tokens_committed
            out[f"tokens_trained_swarm{sfx}"] = r.tokens_trained
            out[f"outer_bytes{sfx}"] = r.outer_bytes
            out[f"ddp_equivalent_bytes{sfx}"] = ddp_bytes(args.preset, args.seed, r.inner_steps)
            out[f"outer_rounds{sfx}"] = r.outer_rounds
            out[f"seconds_swarm{sfx}"] = round(r.seconds, 1)
            out[f"audit_clean{sfx}"] = r.audit_clean
            out[f"export_rounds{sfx}"] = r.rounds
            if churn:
                out["churn_events"] = r.events
        if "central" in runs:
            # Equal tokens: the swarm overshoots --tokens (commits land a round at a time,
            # the drain adds a round), and it may train windows it never commits (leases
            # released at drain, work of killed peers). The central run trains as many
            # tokens as the fault-free swarm's stage 0 trained, never fewer than it
            # committed (the churn run's counts are reported).
            tokens = max(
                int(out.get("tokens_swarm", args.tokens)),
                int(out.get("tokens_trained_swarm", 0)),
            )
            steps = max(1, round(tokens / central_tokens))
            _say(args.quiet, f"central: {steps} steps of {central_tokens} tokens")
            cfg = TrainConfig(
                preset=args.preset, steps=steps, batch_size=args.batch_size,
                seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, seed=args.seed,
                eval_every=steps, eval_batches=args.eval_batches, threads=1,
            )  # fmt: skip
            if args.quiet:
                res, _ = train(cfg, dataset)
            else:
                bar, hook = rich_progress(steps, "central")
                with bar:
                    res, _ = train(cfg, dataset, on_step=hook)
            out.update(eval_loss_central=res.eval_loss, tokens_central=res.tokens,
                       seconds_central=round(res.train_seconds, 1))  # fmt: skip
    except KeyboardInterrupt:
        print("agora bench convergence: interrupted", file=sys.stderr)
        return 130
    central = out.get("eval_loss_central")
    for sfx, key in (("", "gap_pct"), ("_churn", "gap_churn_pct")):
        swarm_loss = out.get(f"eval_loss_swarm{sfx}")
        if central is not None and swarm_loss is not None:
            out[key] = 100.0 * (swarm_loss - central) / central
        if out.get(f"outer_bytes{sfx}"):
            out[f"traffic_ratio{sfx}"] = (
                out[f"ddp_equivalent_bytes{sfx}"] / out[f"outer_bytes{sfx}"]
            )
    out["seconds_total"] = round(time.monotonic() - t_start, 1)
    _table(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _stage0_trained(swarm: LocalSwarm, last: dict[str, dict[str, float]]) -> int:
    """Tokens the stage-0 nodes trained: from each one's `left` event (which counts the
    windows a drain trains after the last scrape), else its last scraped counter."""
    total = 0
    for name in swarm.nodes:
        if name[1] != "0":
            continue
        left = swarm.events(name, "left")
        if left:
            total += int(left[-1]["tokens_trained"])
        else:
            total += int(last.get(name, {}).get("agora_node_tokens_total", 0))
    return total


def _table(out: dict[str, Any]) -> None:
    def f(key: str, fmt: str = "{:.4f}") -> str:
        v = out.get(key)
        return "-" if v is None else fmt.format(v)

    print(
        f"\nconvergence ({out['preset']}, {out['tokens_target']:,} tokens, 2 stages x 2 replicas)"
    )
    print(f"{'run':<14}{'eval loss':>11}{'gap %':>9}{'tokens':>11}{'outer MB':>10}{'DDP MB':>10}")
    print(f"{'central':<14}{f('eval_loss_central'):>11}{'':>9}{f('tokens_central', '{:,}'):>11}")
    for label, sfx, gap in (("swarm", "", "gap_pct"), ("swarm+churn", "_churn", "gap_churn_pct")):
        print(
            f"{label:<14}{f('eval_loss_swarm' + sfx):>11}{f(gap, '{:+.2f}'):>9}"
            f"{f('tokens_swarm' + sfx, '{:,}'):>11}"
            f"{_mb(out.get('outer_bytes' + sfx)):>10}"
            f"{_mb(out.get('ddp_equivalent_bytes' + sfx)):>10}"
        )


def _mb(v: Any) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"
