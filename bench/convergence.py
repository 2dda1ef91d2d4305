"""`agora bench convergence`: centralised baseline vs the swarm at equal tokens, per seed.

For each of `--seeds N` seeds (`--seed`, `--seed`+1, ...), on the same model preset,
corpus (`--dataset`) and held-out set, each of the `--runs` kinds
(bench/convergence_swarm.py runs the swarms):
1. **swarm**: a real coordinator (run seed = the seed) and `--stages` x `--replicas`
   nodes (2 x 2) on loopback, `--codec` boundaries (`subspace_int4`), DiLoCo outer rounds
   with the node's defaults unless a flag says otherwise (`--outer-every-steps 0`: none),
   trained until the coordinator has committed `--tokens`, then drained;
2. **churn**: the same, but a replica is SIGKILLed and a fresh node started in its place
   `--kills` times (stage 0 first, then stage 1, ...) during the run;
3. **4stage**: the swarm run with 4 stages;
4. **central**: one `node.baseline.train` run (model and data seed = the seed, the
   nodes' learning rate schedule: constant after warm-up; `--central-schedule cosine`
   decays it) of as many steps as the largest token count of this seed's swarm runs
   needs, its held-out loss evaluated at the step nearest to each swarm run's own
   committed tokens, and to the tokens its stage 0 trained (bench/convergence_stats.py),
   so every swarm run is compared at its own token count.

A swarm's model is evaluated the way a user would get it: every node writes its stage's
theta_g to its own `--checkpoint-dir`, `node.export` assembles the newest state of each
stage, and `node.baseline.evaluate_weights` computes the held-out loss on the same
batches the central run is evaluated on. Each gap is `100 (swarm - central) / central`;
the JSON has each seed's gap and their mean with a two-sided 95 % Student t interval,
per run kind (`gap_pct_*`, `gap_churn_pct_*`, `gap_4stage_pct_*`).
The traffic numbers come from the nodes' Prometheus metrics (the last scrape of a killed
node counts): `outer_bytes` is the sum of `agora_node_outer_bytes_total` (pseudo-gradient
bytes sent), `outer_state_bytes` of the global-state bytes the outer processes served to
joining, rebasing and adopting replicas (`agora_node_outer_state_bytes_total`, out),
and `outer_bytes_total` everything the outer processes sent, counted on the wire by a
proxy in front of each node's outer loop (bench/outer_tally.py: pseudo-gradients, state,
matchmaking, DHT, libp2p framing; `outer_other_bytes` is what is neither payload nor
state); `ddp_equivalent_bytes` what a ring all-reduce of fp32 gradients at every
inner step would have sent for the same inner steps (each replica sends
`2 (R-1)/R x 4 x numel(stage)` bytes per step, R replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.convergence_stats import (
    CENTRAL_FLOOR,
    SPLITS,
    Interval,
    central_losses,
    central_steps,
    heldout_split,
    mean_interval,
)
from bench.convergence_swarm import STDLIB, SwarmRun, Topology, ddp_bytes, run_swarm, say
from node.baseline import TrainConfig
from node.config import NodeConfig
from node.data import Dataset, load_dataset
from node.model import preset
from node.outer.settings import COMPRESSIONS
from protocol.tensors import CODECS
from swarmlab.procs import workdir_path

RUN_KINDS = ("swarm", "churn", "4stage")  # the swarm runs `--runs` may name, in run order
SUFFIX = {"swarm": "", "churn": "_churn", "4stage": "_4stage"}  # of each kind's JSON keys
FOUR = 4  # stages of the 4stage run


def topology(args: argparse.Namespace, kind: str) -> Topology:
    """The shape of a run kind: the flags' stages x replicas, 4 stages for `4stage`."""
    stages = FOUR if kind == "4stage" else args.stages
    return Topology(stages=stages, replicas=args.replicas, codec=args.codec, churn=kind == "churn")


def _node_default(name: str) -> Any:
    return NodeConfig.__dataclass_fields__[name].default


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora bench convergence",
        description="Held-out loss of the centralised baseline and of a 2-stage x 2-replica"
        " swarm (subspace_int4, DiLoCo), without and with churn, and with 4 stages, each swarm"
        " run against the central run at its own committed tokens, over several seeds;"
        " outer bytes against a per-step fp32 all-reduce. --stages, --replicas, --codec and"
        " --outer-every-steps 0 take the swarm apart.",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--preset", default="tiny",
        help="model preset (default tiny: the bench preset does not fit 15 min on 2 cores)",
    )  # fmt: skip
    p.add_argument(
        "--dataset", default=STDLIB,
        help="what the coordinator's `dataset` key takes: stdlib (default), a text file or"
        " directory, a .jsonl, a .parquet file or directory, a save_to_disk directory",
    )  # fmt: skip
    p.add_argument("--text-column", default="text", help="text column / .jsonl key")
    p.add_argument("--tokens", type=int, default=150_000, help="training tokens per run")
    p.add_argument("--batch-size", type=int, default=16, help="central sequences per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak inner/central lr (default 2e-3)")
    p.add_argument(
        "--inner-lr", type=float, default=None,
        help="the swarm's peak inner lr when it differs from the central run's (default: --lr)",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps, central and inner")
    p.add_argument(
        "--central-schedule", default="constant", choices=sorted(CENTRAL_FLOOR),
        help="the central run's lr after warm-up: constant (default; the nodes' inner"
        " schedule) or cosine decay to 0.1x over the largest token count compared",
    )  # fmt: skip
    p.add_argument("--micro-batch", type=int, default=8, help="swarm sequences per micro-batch")
    p.add_argument(
        "--in-flight", type=int, default=None,
        help="micro-batches stage 0 keeps in the pipeline (default: the node's,"
        f" {_node_default('in_flight')}); 1 = a synchronous pipeline",
    )  # fmt: skip
    p.add_argument(
        "--lease-pool", type=int, default=None,
        help=f"leases a stage-0 node draws windows from (default: the node's,"
        f" {_node_default('lease_pool')})",
    )  # fmt: skip
    p.add_argument(
        "--route-affinity", type=float, default=None,
        help="the nodes' route_affinity: keep each replica's micro-batches on its paired"
        f" next-stage replica (default: the node's, {_node_default('route_affinity')})",
    )  # fmt: skip
    p.add_argument(
        "--grant-tokens", type=int, default=None,
        help="the largest range the coordinator grants (tokens; default: the coordinator's)",
    )  # fmt: skip
    p.add_argument(
        "--matchmaking-s", type=float, default=None,
        help="seconds an outer round gathers its group (default: the node's,"
        f" {_node_default('outer_matchmaking_s')})",
    )  # fmt: skip
    p.add_argument(
        "--inner-batch-tokens", type=int, default=None,
        help="tokens per inner step per replica (default: central batch / replicas)",
    )  # fmt: skip
    p.add_argument(
        "--outer-every-steps",
        type=int,
        default=25,
        help="inner steps per round (default 25; 0: no outer loop)",
    )
    p.add_argument(
        "--outer-compression", default=None, choices=COMPRESSIONS,
        help=f"pseudo-gradient codec (default: the node's, {_node_default('outer_compression')};"
        " topk1 / topk3: the top 1 / 3 %% of each chunk, with error feedback)",
    )  # fmt: skip
    p.add_argument(
        "--participation-power", type=float, default=None,
        help="p of eta_r = eta min(1, tokens/target)^p (default: the node's)",
    )  # fmt: skip
    p.add_argument("--outer-lr", type=float, default=None, help="eta (default: the node's)")
    p.add_argument("--outer-momentum", type=float, default=None, help="mu (default: the node's)")
    p.add_argument(
        "--outer-robust", choices=("on", "off"), default=None,
        help="robust aggregation of outer rounds (clipping, the pair bound; default: the"
        " node's, on); off: the plain weighted mean, to measure what robustness costs",
    )  # fmt: skip
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--replicas", type=int, default=2, help="replicas per stage (default 2)")
    p.add_argument(
        "--codec", default="subspace_int4", choices=CODECS,
        help="boundary codec between stages (default subspace_int4; raw: uncompressed)",
    )  # fmt: skip
    p.add_argument("--kills", type=int, default=2, help="kill+join events in the churn run")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches")
    p.add_argument(
        "--split", default="heldout", choices=SPLITS,
        help="held-out shards evaluated on: heldout (all, default), validation (2nd, 4th, ..."
        " held-out shard: for tuning), test (1st, 3rd, ...: disjoint from validation)",
    )  # fmt: skip
    p.add_argument(
        "--runs", default="central,swarm,churn,4stage",
        help="comma-separated subset of central, swarm, churn (the swarm with kills), 4stage"
        " (the swarm with 4 stages) (default all)",
    )  # fmt: skip
    p.add_argument("--workdir", type=workdir_path, default="bench-convergence", help="logs, state")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per swarm run")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument(
        "--seeds", type=int, default=3,
        help="seeds per setting: --seed .. --seed+N-1 (default 3; 1 gives no interval)",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _swarm_json(
    args: argparse.Namespace, r: SwarmRun, shape: Topology, seed: int
) -> dict[str, Any]:
    ddp = ddp_bytes(args.preset, seed, shape, r.inner_steps)
    counted = r.outer_bytes + r.outer_state_bytes
    total = r.outer_wire["outer_wire_bytes"]
    return {
        "stages": shape.stages,
        "replicas": shape.replicas,
        "eval_loss": r.eval_loss,
        "tokens_committed": r.tokens_committed,
        "tokens_trained": r.tokens_trained,
        "outer_bytes": r.outer_bytes,
        "outer_state_bytes": r.outer_state_bytes,
        "outer_bytes_total": total,
        "outer_other_bytes": None if total is None else total - counted,
        "outer_bypassing": r.outer_wire["outer_bypassing"],
        "ddp_equivalent_bytes": ddp,
        "traffic_ratio": ddp / total if total else None,
        "outer_rounds": r.outer_rounds,
        "lone_rounds": r.lone_rounds,
        "carried_rounds": r.carried_rounds,
        **r.robust,
        "seconds": round(r.seconds, 1),
        "audit_clean": r.audit_clean,
        "export_rounds": r.rounds,
        "events": r.events,
    }


def run_central(
    args: argparse.Namespace, dataset: Dataset, seed: int, counts: list[int], batch: int
) -> dict[str, Any]:
    """One central run to the largest of `counts`, evaluated at the step nearest to each:
    {"steps", "tokens", "seconds", "at": {count: {"step", "tokens", "eval_loss"}}}."""
    at = central_steps(counts, batch)
    steps = max(at.values())
    say(args.quiet, f"central seed {seed}: {steps} steps of {batch} tokens, evaluated at"
                     f" {sorted(set(at.values()))}")  # fmt: skip
    cfg = TrainConfig(
        preset=args.preset, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len,
        lr=args.lr, warmup=args.warmup, seed=seed, eval_every=steps,
        min_lr_ratio=CENTRAL_FLOOR[args.central_schedule],
        eval_batches=args.eval_batches, threads=1,
    )  # fmt: skip
    losses, seconds = central_losses(cfg, dataset, at.values())
    return {
        "steps": steps,
        "tokens": steps * batch,
        "seconds": round(seconds, 1),
        "at": {c: {"step": s, "tokens": s * batch, "eval_loss": losses[s]} for c, s in at.items()},
    }


def _interval_json(key: str, iv: Interval | None) -> dict[str, Any]:
    if iv is None:
        return {}
    return {f"{key}_mean": iv.mean, f"{key}_ci_low": iv.low, f"{key}_ci_high": iv.high}


def _gaps(run: dict[str, Any], at: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A swarm run against the central run: at its committed count (`gap_pct`, what the
    goals are stated in) and at the count its stage 0 trained (`gap_trained_pct`)."""
    out: dict[str, Any] = {}
    for count, sfx in (("tokens_committed", ""), ("tokens_trained", "_trained")):
        ref = at[run[count]]
        out[f"tokens_central{sfx}"] = ref["tokens"]
        out[f"eval_loss_central{sfx}"] = ref["eval_loss"]
        out[f"gap{sfx}_pct"] = 100.0 * (run["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
    return out


def _problem(args: argparse.Namespace, runs: set[str]) -> str | None:
    """What is wrong with the arguments, for people; None when nothing is."""
    if not runs or not runs <= {"central", *RUN_KINDS}:
        return f"bad --runs {args.runs!r}: choose from central, {', '.join(RUN_KINDS)}"
    if args.seeds < 1:
        return f"--seeds must be >= 1, got {args.seeds}"
    if args.stages < 2:  # the coordinator's rule
        return (
            f"--stages must be >= 2 (a pipeline; one stage is `agora baseline`), got {args.stages}"
        )
    if args.replicas < 1:
        return f"--replicas must be >= 1, got {args.replicas}"
    if args.lease_pool is not None and args.lease_pool < 1:
        return f"--lease-pool must be >= 1, got {args.lease_pool}"
    if args.grant_tokens is not None and args.grant_tokens < 1:
        return f"--grant-tokens must be >= 1, got {args.grant_tokens}"
    if args.inner_lr is not None and not args.inner_lr > 0:
        return f"--inner-lr must be > 0, got {args.inner_lr}"
    if args.outer_every_steps < 0:
        return f"--outer-every-steps must be >= 0, got {args.outer_every_steps}"
    if "churn" in runs and args.replicas < 2:
        return "the churn run kills a replica: it needs --replicas >= 2 (or leave churn out)"
    layers = preset(args.preset).n_layers
    most = max([args.stages] + ([FOUR] if "4stage" in runs else []))
    if most > layers:
        return f"preset {args.preset!r} has {layers} layers, too few for {most} stages"
    return None


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    runs = set(args.runs.split(","))
    try:
        problem = _problem(args, runs)
    except ValueError as exc:  # an unknown preset
        problem = str(exc)
    if problem is not None:
        print(f"agora bench convergence: {problem}", file=sys.stderr)
        return 2
    if args.inner_lr is None:  # the swarm's inner lr is the central run's unless given
        args.inner_lr = args.lr
    torch.set_num_threads(int(os.environ.get("AGORA_TORCH_THREADS", "1")))
    try:
        dataset = load_dataset(args.dataset, text_column=args.text_column)
    except (OSError, ValueError) as exc:
        print(f"agora bench convergence: --dataset {args.dataset!r}: {exc}", file=sys.stderr)
        return 2
    try:
        evalset = heldout_split(dataset, args.split)
    except ValueError as exc:
        print(f"agora bench convergence: --split {args.split}: {exc}", file=sys.stderr)
        return 2
    central_tokens = args.batch_size * args.seq_len
    inner_tokens = args.inner_batch_tokens or max(args.micro_batch * args.seq_len,
                                                  central_tokens // args.replicas)  # fmt: skip
    seeds = list(range(args.seed, args.seed + args.seeds))
    out: dict[str, Any] = {
        "preset": args.preset,
        "dataset": args.dataset,
        "dataset_name": dataset.manifest.name,
        "dataset_tokens": dataset.manifest.total_tokens,
        "split": args.split,
        "eval_tokens": int(evalset.heldout.numel()),
        "seeds": seeds,
        "tokens_target": args.tokens,
        "stages": args.stages,
        "replicas": args.replicas,
        "codec": args.codec,
        "outer_compression": args.outer_compression or _node_default("outer_compression"),
        "outer_compression_source": "flag" if args.outer_compression else "node default",
        "outer_every_steps": args.outer_every_steps,
        "inner_batch_tokens": inner_tokens,
        "in_flight": args.in_flight or _node_default("in_flight"),
        "matchmaking_s": args.matchmaking_s or _node_default("outer_matchmaking_s"),
        "lease_pool": args.lease_pool or _node_default("lease_pool"),
        "route_affinity": args.route_affinity or _node_default("route_affinity"),
        "grant_tokens": args.grant_tokens,  # None: the coordinator's default
        "central_batch_tokens": central_tokens,
        "central_token_match": "committed",
        "lr": args.lr,
        "inner_lr": args.inner_lr,
        "central_schedule": args.central_schedule,
        "participation_power": args.participation_power,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "outer_robust": args.outer_robust or "on (node default)",
        "kills": args.kills,
        "runs": [],
    }
    t_start = time.monotonic()
    try:
        for seed in seeds:
            row: dict[str, Any] = {"seed": seed}
            for key in RUN_KINDS:
                if key in runs:
                    shape = topology(args, key)
                    say(args.quiet, f"{key} seed {seed}: {shape.describe()}, {args.tokens:,}")
                    r = run_swarm(args, evalset, inner_tokens, shape, key=key, seed=seed)
                    row[key] = _swarm_json(args, r, shape, seed)
            if "central" in runs:
                # Equal tokens: each swarm run against the central run at its own committed
                # count (the swarm overshoots --tokens by up to a round plus the drain; a
                # churn run commits fewer than it trains), and at the count its stage 0
                # trained (what its model saw). Without a swarm run: --tokens.
                done = [k for k in RUN_KINDS if k in row]
                counts = [row[k][n] for k in done for n in ("tokens_committed", "tokens_trained")]
                row["central"] = run_central(
                    args, evalset, seed, counts or [args.tokens], central_tokens
                )
                for k in done:
                    row[k].update(_gaps(row[k], row["central"]["at"]))
                # JSON object keys are strings
                row["central"]["at"] = {str(c): v for c, v in row["central"]["at"].items()}
            out["runs"].append(row)
    except KeyboardInterrupt:
        print("agora bench convergence: interrupted", file=sys.stderr)
        return 130
    out.update(summarise(out["runs"]))
    out["seconds_total"] = round(time.monotonic() - t_start, 1)
    _table(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-seed lists and mean / 95 % interval of each swarm run kind's gap and traffic
    ratio (`gap_pct_*` fault-free, `gap_churn_pct_*` with churn, `gap_4stage_pct_*` with 4
    stages; ci None with one seed), and its outer and DDP-equivalent bytes summed over
    the seeds."""
    out: dict[str, Any] = {}
    for key in RUN_KINDS:
        sfx = SUFFIX[key]
        done = [r[key] for r in rows if key in r]
        for at in ("", "_trained"):
            gaps = [d[f"gap{at}_pct"] for d in done if f"gap{at}_pct" in d]
            if gaps:
                out[f"gap{sfx}{at}_pct_per_seed"] = gaps
                out.update(_interval_json(f"gap{sfx}{at}_pct", mean_interval(gaps)))
        ratios = [d["traffic_ratio"] for d in done if d["traffic_ratio"] is not None]
        for name in ("outer_bytes_total", "ddp_equivalent_bytes"):  # summed over the seeds
            if done and all(d[name] is not None for d in done):
                out[f"{name}{sfx}"] = sum(d[name] for d in done)
        if ratios:
            out.update(_interval_json(f"traffic_ratio{sfx}", mean_interval(ratios)))
        if done:  # both zero: the run is the one with outer_robust off
            out[f"robust_rejections{sfx}_per_seed"] = [d["robust_rejections"] for d in done]
            out[f"robust_clipped{sfx}_per_seed"] = [d.get("robust_clipped", 0) for d in done]
            out[f"largest_group{sfx}"] = max(d["largest_group"] for d in done)
    return out


def _table(out: dict[str, Any]) -> None:
    def f(v: Any, fmt: str = "{:.4f}") -> str:
        return "-" if v is None else fmt.format(v)

    shapes = sorted(
        {f"{r['stages']} stages x {r['replicas']} replicas" for row in out["runs"]
         for key in RUN_KINDS if (r := row.get(key)) is not None}
    )  # fmt: skip
    print(
        f"\nconvergence ({out['preset']}, {out['dataset_name']}, {out['tokens_target']:,} tokens,"
        f" {' and '.join(shapes) or 'central only'}, {out['codec']}, outer"
        f" {out['outer_compression']} every {out['outer_every_steps']} steps,"
        f" seeds {out['seeds']})"
    )
    print(
        f"{'seed':<6}{'run':<8}{'tokens':>10}{'central':>10}{'swarm':>9}{'gap %':>9}"
        f"{'trained':>10}{'gap %':>9}{'outer MB':>10}{'state MB':>10}{'wire MB':>10}"
        f"{'DDP MB':>10}"
    )
    for row in out["runs"]:
        for key in RUN_KINDS:
            r = row.get(key)
            if r is None:
                continue
            print(
                f"{row['seed']:<6}{key:<8}{r['tokens_committed']:>10,}"
                f"{f(r.get('eval_loss_central')):>10}{f(r['eval_loss']):>9}"
                f"{f(r.get('gap_pct'), '{:+.2f}'):>9}{r['tokens_trained']:>10,}"
                f"{f(r.get('gap_trained_pct'), '{:+.2f}'):>9}{_mb(r['outer_bytes']):>10}{_mb(r['outer_state_bytes']):>10}"
                f"{_mb(r['outer_bytes_total']):>10}{_mb(r['ddp_equivalent_bytes']):>10}"
            )
        if "central" in row and not any(k in row for k in RUN_KINDS):
            for c, ref in row["central"]["at"].items():
                print(f"{row['seed']:<6}{'central':<8}{int(c):>10,}{f(ref['eval_loss']):>10}")
    for label in RUN_KINDS:
        for at, what in (("", "committed"), ("_trained", "trained")):
            key = f"gap{SUFFIX[label]}{at}_pct"
            if f"{key}_mean" in out:
                lo, hi = out[f"{key}_ci_low"], out[f"{key}_ci_high"]
                ci = "no interval (one seed)" if lo is None else f"95 % CI [{lo:+.2f}, {hi:+.2f}]"
                print(f"{label} gap at {what} tokens: mean {out[key + '_mean']:+.2f} %, {ci}")
        per_seed = out.get(f"robust_rejections{SUFFIX[label]}_per_seed")
        if per_seed is not None:
            print(
                f"{label}: robust aggregation left out {per_seed} part contributions and"
                f" clipped {out[f'robust_clipped{SUFFIX[label]}_per_seed']} (per seed);"
                f" largest group {out[f'largest_group{SUFFIX[label]}']}"
            )


def _mb(v: Any) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"
