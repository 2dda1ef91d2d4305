"""`agora bench convergence`'s swarm runs: one real local swarm of a given shape.

`run_swarm` starts a coordinator (run seed = the seed) and `Topology.stages` x
`Topology.replicas` nodes on loopback, trains until the coordinator has committed the
target tokens (with `churn`, SIGKILLing a replica and starting a fresh one in its place
at even fractions of the target), drains, audits, exports the newest state of each
stage from the nodes' checkpoint directories and evaluates it on the held-out batches.
Its traffic numbers come from the nodes' Prometheus metrics and from a counting proxy
in front of every outer process (bench/outer_tally.py). `ddp_bytes` is the per-step
fp32 ring all-reduce the outer rounds are compared with.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.convergence_stats import robust_rejections
from bench.outer_tally import OuterTally
from node.baseline import evaluate_weights
from node.data import Dataset
from node.export import export_checkpoints
from node.model import build_stage, load_export, preset
from protocol.corpus import DEFAULT_HELDOUT_EVERY
from swarmlab.swarm import LocalSwarm

STDLIB = "stdlib"
STATE_OUT = 'agora_node_outer_state_bytes_total{direction="out"}'
SCRAPED = (
    "agora_node_outer_bytes_total",
    STATE_OUT,
    "agora_node_tokens_total",
    "agora_node_outer_steps_total",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The shape of one swarm run."""

    stages: int  # pipeline stages
    replicas: int  # replicas of each stage
    codec: str  # boundary codec (protocol.tensors.CODECS; "raw" = uncompressed)
    churn: bool = False  # kill a replica and start a fresh one, `--kills` times

    def describe(self) -> str:
        churn = ", churn" if self.churn else ""
        return f"{self.stages} stages x {self.replicas} replicas, {self.codec}{churn}"


@dataclass
class SwarmRun:
    eval_loss: float
    tokens_committed: int
    tokens_trained: int  # stage-0 tokens through the pipeline (re-trained ones included)
    outer_bytes: float
    outer_state_bytes: float  # global-state bytes served to other replicas
    outer_wire: dict[str, Any]  # OuterTally.stop(): every outer byte, and any bypass
    inner_steps: dict[int, float]  # stage -> inner steps summed over its replicas
    outer_rounds: float  # outer steps applied, summed over nodes
    # rounds a node stepped alone, and group rounds whose contribution carried such
    # rounds (node.outer.parts.carried_view), summed over nodes (`round_applied` events)
    lone_rounds: int
    carried_rounds: int
    # what robust aggregation left out of the group rounds (`robust_rejections`)
    robust: dict[str, int]
    seconds: float
    audit_clean: bool
    rounds: dict[int, int]  # stage -> round of the exported state
    events: list[str] = field(default_factory=list)


def node_settings(args: argparse.Namespace, inner_tokens: int) -> dict[str, Any]:
    """The nodes' `[node]` settings; None (an option not given) leaves the node default."""
    return {
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "in_flight": args.in_flight,
        "inner_batch_tokens": inner_tokens,
        "lr": args.inner_lr,
        "warmup_steps": args.warmup,
        "outer_every_steps": args.outer_every_steps,
        "outer_compression": args.outer_compression,
        "outer_matchmaking_s": args.matchmaking_s,
        "checkpoint_every_rounds": 1,
        "outer_participation_power": args.participation_power,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "outer_robust": None if args.outer_robust is None else args.outer_robust == "on",
        "lease_pool": args.lease_pool,
        "route_affinity": args.route_affinity,
    }


def run_config(args: argparse.Namespace, dataset: Dataset, seed: int) -> dict[str, Any]:
    """The coordinator's run.toml keys beyond `LocalSwarm`'s: the run seed, and the corpus
    cut into the same shards as `dataset` (the central run's), so the held-out shards the
    swarm never trains on are the ones every model is evaluated on."""
    source = args.dataset if args.dataset == STDLIB else str(Path(args.dataset).resolve())
    shards = dataset.manifest.train + dataset.manifest.heldout
    return {
        "seed": seed,
        "dataset": source,
        "text_column": args.text_column,
        "shard_tokens": max(s.tokens for s in shards),
        "heldout_every": DEFAULT_HELDOUT_EVERY,
        **({} if args.grant_tokens is None else {"grant_tokens": args.grant_tokens}),
    }


def say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, flush=True)


def run_swarm(
    args: argparse.Namespace,
    dataset: Dataset,
    inner_tokens: int,
    shape: Topology,
    *,
    key: str,
    seed: int,
) -> SwarmRun:
    """One swarm run of `shape`, its files under `args.workdir/seed{seed}/{key}`."""
    workdir = args.workdir / f"seed{seed}" / key
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    swarm = LocalSwarm(
        workdir=workdir, preset=args.preset, stages=shape.stages, codec=shape.codec,
        run_config=run_config(args, dataset, seed),
    )  # fmt: skip
    ckpt: dict[str, Path] = {}
    stage_of: dict[str, int] = {}
    last: dict[str, dict[str, float]] = {}  # node -> last scraped metrics
    label = f"{key} seed {seed}"

    def add(name: str, stage: int) -> None:
        ckpt[name], stage_of[name] = workdir / "ckpt" / name, stage
        values = node_settings(args, inner_tokens) | tally.node_settings(name)
        config = str(swarm.write_node_config(name, **values))
        swarm.add_node(name, stage, "--config", config, "--checkpoint-dir", str(ckpt[name]))

    def scrape() -> None:
        for name, proc in swarm.nodes.items():
            if proc.alive():
                got = swarm.scrape(name)
                if got:
                    last[name] = {k: got.get(k, 0.0) for k in SCRAPED}

    events: list[str] = []
    kills = args.kills if shape.churn else 0
    kill_at = [args.tokens * (i + 1) / (kills + 1) for i in range(kills)]
    t0 = time.monotonic()
    # replica i of stage s is "s{s}-{letter i}"; the k-th joiner takes the next letter
    names = {s: [f"s{s}-{chr(ord('a') + i)}" for i in range(shape.replicas)]
             for s in range(shape.stages)}  # fmt: skip
    fresh = [f"s{i % shape.stages}-{chr(ord('a') + shape.replicas + i // shape.stages)}"
             for i in range(kills)]  # fmt: skip
    tally = OuterTally.start(workdir, [n for ns in names.values() for n in ns] + fresh)
    try:
        swarm.start_coordinator()
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
            say(args.quiet, f"  [{label} {time.monotonic() - t0:5.0f}s] committed {committed:,}")
            if kill_at and committed >= kill_at[0]:
                kill_at.pop(0)
                stage = next_id % shape.stages
                victim, joiner = names[stage][-1], fresh[next_id]
                swarm.nodes[victim].signal(signal.SIGKILL)
                swarm.nodes[victim].popen.wait(10)
                add(joiner, stage)
                names[stage][-1] = joiner
                next_id += 1
                events.append(f"{committed} tokens: killed {victim}, started {joiner}")
                say(args.quiet, f"  >>> {events[-1]}")
        scrape()
        tally.check()
        codes = swarm.stop_nodes(timeout_s=120.0)
        swarm.stop_coordinator()
    finally:
        swarm.kill_all()
        wire = tally.stop()
    seconds = time.monotonic() - t0
    bad = {n: c for n, c in codes.items() if c not in (0, -9)}
    if bad:
        raise RuntimeError(f"{label}: nodes exited badly {bad}")
    audit = swarm.audit()
    # every data epoch's commits (the status counts only the current epoch's, which
    # restarts at 0 when a small corpus is used up)
    committed = audit.committed_tokens
    if committed < 1:
        raise RuntimeError(f"{label}: the swarm committed no tokens (audit: {audit.epochs})")
    export_dir = workdir / "export"
    # a node killed before its first applied round never wrote a checkpoint
    got = export_checkpoints([d for d in ckpt.values() if d.is_dir()], export_dir)
    config, tensors = load_export(export_dir)
    loss = evaluate_weights(
        config, tensors, dataset,
        batch_size=args.batch_size, seq_len=args.seq_len, n_batches=args.eval_batches,
    )  # fmt: skip
    by_stage = [
        (stage_of[name], e) for name in swarm.nodes for e in swarm.events(name, "round_applied")
    ]
    applied = [e for _, e in by_stage]
    steps: dict[int, float] = {s: 0.0 for s in range(shape.stages)}
    for name, m in last.items():
        steps[stage_of[name]] += m["agora_node_tokens_total"] / inner_tokens
    return SwarmRun(
        eval_loss=loss,
        tokens_committed=committed,
        tokens_trained=_stage0_trained(swarm, stage_of, last),
        outer_bytes=sum(m["agora_node_outer_bytes_total"] for m in last.values()),
        outer_state_bytes=sum(m[STATE_OUT] for m in last.values()),
        outer_wire=wire,
        inner_steps=steps,
        outer_rounds=sum(m["agora_node_outer_steps_total"] for m in last.values()),
        lone_rounds=sum(e["group_size"] == 1 and not e["rebased"] for e in applied),
        carried_rounds=sum(bool(e.get("carried")) for e in applied),
        robust=robust_rejections(by_stage),
        seconds=seconds,
        audit_clean=audit.clean,
        rounds=got.rounds,
        events=events,
    )


def ddp_bytes(preset_name: str, seed: int, shape: Topology, inner_steps: dict[int, float]) -> float:
    """Bytes a ring all-reduce of fp32 gradients at every inner step would have sent
    (each replica sends `2 (R-1)/R x 4 x numel(stage)` bytes per step; 0 for R = 1)."""
    cfg = preset(preset_name).replace(seed=seed)
    ring = 2 * (shape.replicas - 1) / shape.replicas
    total = 0.0
    for s, steps in inner_steps.items():
        numel = sum(p.numel() for p in build_stage(cfg, s, shape.stages).parameters())
        total += steps * ring * 4 * numel
    return total


def _stage0_trained(
    swarm: LocalSwarm, stage_of: dict[str, int], last: dict[str, dict[str, float]]
) -> int:
    """Tokens the stage-0 nodes trained: from each one's `left` event (which counts the
    windows a drain trains after the last scrape), else its last scraped counter."""
    total = 0
    for name in swarm.nodes:
        if stage_of[name] != 0:
            continue
        left = swarm.events(name, "left")
        if left:
            total += int(left[-1]["tokens_trained"])
        else:
            total += int(last.get(name, {}).get("agora_node_tokens_total", 0))
    return total
