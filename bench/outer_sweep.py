"""`agora bench outer-sweep`: the outer optimizer's settings and the swarm's gap sources,
measured side by side in one process.

This module is the command: it plans the runs (the staged grid, or the cross product of
the given values), runs each with `bench.outer_sweep_sim.Simulation` and one central
reference per token count (`central`), prints a table and writes the rows as JSON. What a
run simulates, and how it differs from the real node: `bench.outer_sweep_sim`.

`--grid` runs eta x mu x H without churn, then p under churn at the best of those, then
data x inner schedule at the best (GRID_DEFAULTS; flags restrict each axis). The default
204,800 tokens is a whole number of rounds at both H = 10 and H = 25 (rounds of
2 x H x 1,024 tokens), so every run of the grid is compared with one central run; the
default grid (18 runs and the central one) took 12.6 minutes on a shared 2-core machine.
Results and what they say: docs/outer-loop.md, "Participation rule". `--data pooled`
(with `--grant-tokens`, `--lease-pool`, `--shuffle-windows`) runs the lease data path the
swarm uses now: docs/outer-loop.md, "Data order", has a command per row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from bench.convergence_stats import CENTRAL_FLOOR, SPLITS, heldout_split
from bench.outer_sweep_sim import (
    DATA_MODES,
    OUTER_CODECS,
    SCHEDULES,
    Common,
    RunResult,
    Setting,
    Simulation,
    central,
)
from node.data import load_dataset
from node.model import PRESETS

_DEFAULT = Common()  # the defaults of the command line
_SETTING = Setting()  # the node's (and the coordinator's) defaults

# --- the grid ------------------------------------------------------------------------------

GRID_DEFAULTS: dict[str, list[Any]] = {
    "eta": [0.7, 1.0],
    "mu": [0.0, 0.5, 0.9],
    "H": [10, 25],
    "p": [0.0, 0.5, 1.0],
    "churn": [0.3],
    "data": ["random", "lease"],
    "inner_schedule": ["constant", "cosine"],
    "outer_compression": ["none"],
    "clip_rel": [_SETTING.clip_rel],
    "grant_tokens": [_SETTING.grant_tokens],
    "lease_pool": [_SETTING.lease_pool],
    "shuffle_windows": [_SETTING.shuffle_windows],
    "robust": [_SETTING.robust],
}


def _pick(values: list[Any], preferred: Any) -> Any:
    return preferred if preferred in values else values[0]


def grid_stage_optimizer(ax: dict[str, list[Any]]) -> list[Setting]:
    """eta x mu x H without churn, random data, constant inner lr (the node's)."""
    p = _pick(ax["p"], 0.5)
    data, sched = _pick(ax["data"], "random"), _pick(ax["inner_schedule"], "constant")
    comp = _pick(ax["outer_compression"], "none")
    return [
        Setting(
            eta=e,
            mu=m,
            H=h,
            p=p,
            churn=0.0,
            data=data,
            inner_schedule=sched,
            outer_compression=comp,
            stage="optimizer",
        )  # fmt: skip
        for h in ax["H"]
        for e in ax["eta"]
        for m in ax["mu"]
    ]


def grid_stage_participation(best: Setting, ax: dict[str, list[Any]]) -> list[Setting]:
    """p under churn (with kill+join) at the best (eta, mu, H)."""
    return [
        replace(best, p=p, churn=q, stage="participation")
        for q in ax["churn"]
        if q > 0.0
        for p in ax["p"]
    ]


def grid_stage_data(best: Setting, ax: dict[str, list[Any]]) -> list[Setting]:
    """Data (random vs lease) x inner schedule (constant vs cosine) x wire codec at the best
    (pooled data with the first of the given grant, pool and draw settings)."""
    pooled = {k: ax[k][0] for k in ("grant_tokens", "lease_pool", "shuffle_windows")}
    return [
        replace(best, data=d, inner_schedule=s, outer_compression=c, stage="data", **pooled)
        for d in ax["data"]
        for s in ax["inner_schedule"]
        for c in ax["outer_compression"]
    ]


def plain_settings(ax: dict[str, list[Any]]) -> list[Setting]:
    keys = list(ax)
    return [
        Setting(**dict(zip(keys, combo, strict=True)), stage="plain")
        for combo in itertools.product(*(ax[k] for k in keys))
    ]


# --- command line --------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _switches(text: str) -> list[bool]:
    words = _words(("on", "off"))(text)
    return [w == "on" for w in words]


def _words(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in choices]
        if bad or not out:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return out

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora bench outer-sweep",
        description="Simulate a stage group of R replicas in one process with the real"
        " outer step (node.diloco) and inner AdamW, under churn, and compare the held-out"
        " loss of theta_g with a central run of the same tokens. Comma-separated values"
        " sweep; --grid runs the staged default grid (flags restrict it).",
    )
    p.add_argument("--json", type=Path, help="write one row per run (and the central loss) here")
    p.add_argument(
        "--split", choices=SPLITS, default="validation",
        help="held-out shards the runs are evaluated on (default validation: tuning never"
        " reads the test half that agora bench convergence --split test reports on)",
    )  # fmt: skip
    p.add_argument("--grid", action="store_true", help="the staged default grid (see docs)")
    p.add_argument("--eta", type=_floats, help="outer lr(s)")
    p.add_argument("--mu", type=_floats, help="outer momentum(s)")
    p.add_argument("--H", type=_ints, help="inner steps per round (outer_every_steps)")
    p.add_argument("--p", type=_floats, help="participation power(s)")
    p.add_argument("--churn", type=_floats, help="probability a replica misses a round")
    p.add_argument(
        "--data", type=_words(DATA_MODES),
        help="random | lease | pooled (comma list): random windows, whole shards front to"
        " back, or the lease data path (small grants in round robin, pooled leases)",
    )  # fmt: skip
    p.add_argument(
        "--grant-tokens", type=_ints,
        help=f"pooled data: largest granted range in tokens, 0 = the rest of the shard"
        f" (default {_SETTING.grant_tokens}, the coordinator's)",
    )  # fmt: skip
    p.add_argument(
        "--lease-pool", type=_ints,
        help=f"pooled data: open leases per replica (default {_SETTING.lease_pool}, the node's)",
    )  # fmt: skip
    p.add_argument(
        "--shuffle-windows", type=_switches,
        help="pooled data: on | off, draw each micro-batch's windows at random across the"
        " open leases (default on, the node's) or take them in lease order",
    )  # fmt: skip
    p.add_argument("--inner-schedule", type=_words(SCHEDULES), help="constant | cosine")
    p.add_argument(
        "--robust", type=_switches,
        help="on | off (comma list): the node's robust aggregation (outer_robust) or the plain"
        " weighted mean (default on)",
    )  # fmt: skip
    p.add_argument(
        "--outer-compression", type=_words(OUTER_CODECS),
        help="none | fp16 | uint8, or sparse1 | sparse3 (top 1 / 3 %% of each chunk at 2 bits,"
             " error feedback; simulation only)",
    )  # fmt: skip
    p.add_argument(
        "--clip-rel", type=_floats,
        help="centered-clipping radius(es) in median norms, groups of >= 3 (0: plain mean)",
    )  # fmt: skip
    p.add_argument(
        "--kill-at", type=_floats, default=None,
        help="run fractions of kill+join events in runs with churn (default 0.33,0.67;"
        " '' for none)",
    )  # fmt: skip
    p.add_argument("--tokens", type=int, default=_DEFAULT.tokens, help="tokens per run")
    p.add_argument("--replicas", type=int, default=2, help="R (default 2)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch-size", type=int, default=16, help="central sequences per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--inner-batch-tokens", type=int, default=0,
        help="tokens per inner step per replica (default: central batch / R)",
    )  # fmt: skip
    p.add_argument("--lr", type=float, default=_DEFAULT.lr, help="inner and central peak lr")
    p.add_argument("--warmup", type=int, default=_DEFAULT.warmup, help="warm-up steps")
    p.add_argument(
        "--central-schedule", default=_DEFAULT.central_schedule, choices=sorted(CENTRAL_FLOOR),
        help="the central run's lr after warm-up: constant (default; the nodes' inner"
        " schedule) or cosine decay to 0.1x, as every sweep before 6 December measured",
    )  # fmt: skip
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _axes(args: argparse.Namespace, grid: bool) -> dict[str, list[Any]]:
    node = Setting()
    single: dict[str, list[Any]] = {
        "eta": [node.eta], "mu": [node.mu], "H": [node.H], "p": [node.p], "churn": [0.0],
        "data": ["random"], "inner_schedule": ["constant"], "outer_compression": ["none"],
        "clip_rel": [node.clip_rel], "grant_tokens": [node.grant_tokens], "lease_pool": [node.lease_pool],
        "shuffle_windows": [node.shuffle_windows], "robust": [node.robust],
    }  # fmt: skip
    base = GRID_DEFAULTS if grid else single
    given = {k: getattr(args, k) for k in base}
    return {k: (given[k] if given[k] else list(base[k])) for k in base}


def _row(
    s: Setting, r: RunResult, central_loss: float, kill_at: tuple[float, ...]
) -> dict[str, Any]:
    return {
        "stage": s.stage,
        "eta": s.eta,
        "mu": s.mu,
        "H": s.H,
        "p": s.p,
        "churn": s.churn,
        "kill_at": list(kill_at) if s.churn > 0.0 else [],
        "data": s.data,
        "grant_tokens": s.grant_tokens,
        "lease_pool": s.lease_pool,
        "shuffle_windows": s.shuffle_windows,
        "inner_schedule": s.inner_schedule,
        "outer_compression": s.outer_compression,
        "clip_rel": s.clip_rel,
        "robust": s.robust,
        "rejected_contributions": sum(lg.rejected for lg in r.log),
        "eval_loss": r.eval_loss,
        "central_eval_loss": central_loss,
        "gap_pct": 100.0 * (r.eval_loss - central_loss) / central_loss,
        "final_train_loss": r.final_train_loss,
        "rounds": r.rounds,
        "rounds_applied": r.rounds_applied,
        "tokens": r.tokens_trained,
        "tokens_applied": r.tokens_applied,
        "mean_eta_r": r.mean_eta_r,
        "wall_s": round(r.seconds, 1),
        "events": r.events,
        # min, median and max over the rounds with two contributions (None: none had two)
        "pair_cos": _spread([x.pair_cos for x in r.log if x.pair_cos is not None]),
    }


def _spread(xs: list[float]) -> list[float] | None:
    if not xs:
        return None
    s = sorted(xs)
    return [round(s[0], 4), round(s[(len(s) - 1) // 2], 4), round(s[-1], 4)]


class _Bar:
    """A rich progress bar over runs (and the rounds of the current run), or nothing."""

    def __init__(self, quiet: bool, total: int) -> None:
        self.bar: Any = None
        if quiet:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[note]}"),
        )  # fmt: skip
        self.runs = self.bar.add_task("runs", total=total, note="")
        self.rounds = self.bar.add_task("rounds", total=1, note="")
        self.bar.start()

    def start_run(self, label: str, rounds: int) -> None:
        if self.bar is not None:
            self.bar.update(self.rounds, total=rounds, completed=0, note=label)

    def on_round(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.rounds, completed=done)

    def done_run(self, note: str, extra_total: int = 0, line: str = "") -> None:
        if self.bar is not None:
            task = self.bar.tasks[self.runs]
            self.bar.update(self.runs, advance=1, total=(task.total or 0) + extra_total, note=note)
            if line:  # one line per finished run, also when the output is not a terminal
                self.bar.console.print(line, highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _data_label(s: Setting) -> str:
    if s.data != "pooled":
        return s.data
    draw = "shuffled" if s.shuffle_windows else "in order"
    return f"pooled ({s.grant_tokens} x {s.lease_pool}, {draw})"


def _label(s: Setting) -> str:
    return (
        f"eta {s.eta} mu {s.mu} H {s.H} p {s.p} churn {s.churn} {_data_label(s)}"
        f" {s.inner_schedule}{'' if s.outer_compression == 'none' else ' ' + s.outer_compression}"
    )


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        common = Common(
            preset=args.preset, tokens=args.tokens, replicas=args.replicas,
            batch_size=args.batch_size, seq_len=args.seq_len,
            inner_batch_tokens=args.inner_batch_tokens, lr=args.lr, warmup=args.warmup,
            eval_batches=args.eval_batches, seed=args.seed,
            central_schedule=args.central_schedule,
            kill_at=_DEFAULT.kill_at if args.kill_at is None else tuple(args.kill_at),
        )  # fmt: skip
        axes = _axes(args, args.grid)
        first = grid_stage_optimizer(axes) if args.grid else plain_settings(axes)
    except ValueError as exc:
        print(f"agora bench outer-sweep: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("AGORA_TORCH_THREADS", "1")))
    # tuning reads the validation half of the held-out shards; claims (agora bench
    # convergence --split test) the other half
    dataset = heldout_split(load_dataset(), args.split)
    t_start = time.monotonic()
    centrals: dict[int, tuple[float, int, float]] = {}
    rows: list[dict[str, Any]] = []
    done: dict[tuple[Any, ...], dict[str, Any]] = {}
    planned = len(first) + (
        len(grid_stage_participation(first[0], axes)) + len(grid_stage_data(first[0], axes)) - 1
        if args.grid
        else 0
    )
    bar = _Bar(args.quiet, planned + 1)

    def central_for(tokens: int) -> float:
        if tokens not in centrals:
            extra = 1 if centrals else 0  # the plan counted one central run
            bar.start_run(f"central, {tokens:,} tokens", 1)
            centrals[tokens] = central(common, dataset, tokens)
            bar.on_round(1)
            loss, _, secs = centrals[tokens]
            bar.done_run(
                f"central {loss:.4f}",
                extra_total=extra,
                line=f"central, {tokens:,} tokens: eval {loss:.4f} ({secs:.0f} s)",
            )
        return centrals[tokens][0]

    def run_all(settings: list[Setting]) -> list[dict[str, Any]]:
        out = []
        for s in settings:
            if s.key() in done:  # the same run asked for twice: reuse it
                out.append(done[s.key()])
                continue
            sim = Simulation(common, s, dataset)
            ref = central_for(sim.rounds * s.H * common.inner_tokens * common.replicas)
            bar.start_run(_label(s), sim.rounds)
            res = sim.run(bar.on_round)
            row = _row(s, res, ref, common.kill_at)
            result = f"eval {row['eval_loss']:.4f} ({row['gap_pct']:+.2f} %)"
            bar.done_run(
                f"last: {result}",
                line=f"{s.stage}: {_label(s)}: {result}, {row['wall_s']:.0f} s",
            )
            rows.append(row)
            done[s.key()] = row
            out.append(row)
        return out

    def best_of(got: list[dict[str, Any]], settings: list[Setting]) -> Setting:
        i = min(range(len(got)), key=lambda j: got[j]["eval_loss"])
        return settings[i]

    try:
        got = run_all(first)
        if args.grid:
            best = best_of(got, first)
            run_all(grid_stage_participation(best, axes))
            run_all(grid_stage_data(best, axes))
    except KeyboardInterrupt:
        bar.stop()
        print("agora bench outer-sweep: interrupted", file=sys.stderr)
        return 130
    finally:
        bar.stop()
    out: dict[str, Any] = {
        "common": {**asdict(common), "kill_at": list(common.kill_at),
                   "inner_batch_tokens": common.inner_tokens,
                   "central_batch_tokens": common.central_tokens},
        "central": [
            {"tokens": t, "eval_loss": v[0], "tokens_trained": v[1], "wall_s": round(v[2], 1)}
            for t, v in centrals.items()
        ],
        "eval_loss_central": next(iter(centrals.values()))[0] if centrals else None,
        "rows": rows,
        "seconds_total": round(time.monotonic() - t_start, 1),
    }  # fmt: skip
    _table(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _data_cell(r: dict[str, Any]) -> str:
    """`pooled 8192x8 shuf`: grant tokens x open leases, windows shuffled or in order."""
    if r["data"] != "pooled":
        return str(r["data"])
    draw = "shuf" if r["shuffle_windows"] else "ord"
    return f"pooled {r['grant_tokens']}x{r['lease_pool']} {draw}"


def _table(out: dict[str, Any]) -> None:
    c = out["common"]
    print(
        f"\nouter-sweep ({c['preset']}, R = {c['replicas']}, {c['inner_batch_tokens']} tokens"
        f" per inner step, inner lr {c['lr']:g})"
    )
    for ref in out["central"]:
        print(f"central: eval loss {ref['eval_loss']:.4f} at {ref['tokens_trained']:,} tokens")
    head = (
        f"{'stage':<14}{'eta':>5}{'mu':>5}{'H':>4}{'p':>5}{'churn':>6}  {'data':<20}{'sched':<9}"
        f"{'wire':<6}{'clip':>5}{'rob':>4}{'rej':>4}{'rounds':>8}{'eta_r':>7}{'eval':>8}{'gap %':>8}{'wall s':>8}"
    )
    print(head)
    for r in out["rows"]:
        print(
            f"{r['stage']:<14}{r['eta']:>5g}{r['mu']:>5g}{r['H']:>4}{r['p']:>5g}{r['churn']:>6g}"
            f"  {_data_cell(r):<20}{r['inner_schedule']:<9}{r['outer_compression']:<6}"
            f"{r['clip_rel']:>5g}{'on' if r['robust'] else 'off':>4}{r['rejected_contributions']:>4}"
            f"{r['rounds_applied']:>4}/{r['rounds']:<3}{r['mean_eta_r']:>7.3f}"
            f"{r['eval_loss']:>8.4f}{r['gap_pct']:>+8.2f}{r['wall_s']:>8.1f}"
        )
