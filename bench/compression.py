"""`agora bench compression`: what subspace-coded boundaries cost in bytes and in loss.

Trains the `bench` preset centrally for equal tokens: once plain (unconstrained residual
stream, no boundaries) and once per stage count (default 2 and 4) with the subspace
parametrisation and the boundary codec (`--codec`, default `subspace_int4`; the issue's
`subspace_int8` is `--codec subspace_int8 --rank 16`) at every boundary. A boundary is simulated in one
process: the hidden state is encoded, serialised with msgpack, parsed and decoded going
forward, and the gradient likewise (`U^T g`) going backward. Bytes are counted from the
serialised encodings, plus one byte per token forward (the receiver needs the tokens
to rebuild `E0[tokens]`); raw is the fp32 hidden state and gradient. All runs share one
training loop (node.baseline.train), data order and held-out set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from node.baseline import TrainConfig, TrainResult, rich_progress, train
from node.data import load_dataset
from node.model import preset
from node.plotting import Series, plot_series


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora bench compression",
        description="Raw vs wire bytes per token per boundary (forward and backward) and"
        " held-out loss of subspace+int8 boundaries against the plain model at equal tokens.",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--preset", default="bench", help="model preset (default bench)")
    p.add_argument("--rank", type=int, help="subspace rank k (default: the preset's)")
    p.add_argument(
        "--codec",
        default="subspace_int4",
        choices=["subspace_int8", "subspace_int4"],
        help="boundary codec of the compressed runs (default subspace_int4; the issue's"
        " subspace_int8 at the same ratio needs --rank 16, docs/compression.md)",
    )
    p.add_argument("--stages", default="2,4", help="comma-separated stage counts (default 2,4)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default 150)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--seed", type=int, default=0, help="run seed")
    p.add_argument("--threads", type=int, help="torch threads (default min(cpus, 8))")
    p.add_argument("--out", type=Path, help="also write a PNG of the loss curves here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _run(cfg: TrainConfig, label: str, data: Any, quiet: bool) -> TrainResult:
    if quiet:
        return train(cfg, data)[0]
    bar, hook = rich_progress(cfg.steps, label)
    with bar:
        return train(cfg, data, on_step=hook)[0]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        stage_counts = [int(s) for s in args.stages.split(",") if s.strip()]
        model = preset(args.preset)
        rank = model.subspace_rank if args.rank is None else args.rank
        if rank < 1:
            raise ValueError("the compressed runs need a subspace rank >= 1")
        base = TrainConfig(
            preset=args.preset,
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            lr=args.lr,
            warmup=max(1, args.steps // 10),
            eval_every=max(1, args.steps // 5),
            seed=args.seed,
            rank=0,
        )
        runs = {"plain": base}
        for n in stage_counts:
            runs[f"{n} stages"] = replace(base, rank=rank, compress=args.codec, stages=n)
        data = load_dataset(None)
    except ValueError as exc:
        print(f"agora bench compression: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads or min(os.cpu_count() or 1, 8))
    started = time.perf_counter()
    results: dict[str, TrainResult] = {}
    try:
        for label, cfg in runs.items():
            results[label] = _run(cfg, label, data, args.quiet)
    except KeyboardInterrupt:
        print("agora bench compression: interrupted", file=sys.stderr)
        return 130
    out = summarise(results, model.d_model, rank, stage_counts, args)
    out["wall_seconds"] = time.perf_counter() - started
    print_table(out)
    if args.out is not None:
        plot_series(
            args.out / "compression.png",
            [
                Series(
                    label, [r["tokens"] for r in res.curve], [r["train_loss"] for r in res.curve]
                )
                for label, res in results.items()
            ],
            title=f"{args.preset}: plain vs {args.codec} (k={rank})",
            xlabel="tokens",
            ylabel="train loss (nats per byte)",
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


def summarise(
    results: dict[str, TrainResult],
    d_model: int,
    rank: int,
    stage_counts: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    plain = results["plain"]
    runs: dict[str, Any] = {}
    raw = wire = tok = 0
    raw_f = raw_b = wire_f = wire_b = 0
    for n in stage_counts:
        res = results[f"{n} stages"]
        boundaries = []
        for i, b in enumerate(res.boundaries):
            boundaries.append(
                {
                    "boundary": i,
                    "raw_fwd_bytes_per_token": b.raw_fwd / b.tokens,
                    "wire_fwd_bytes_per_token": b.wire_fwd / b.tokens,
                    "raw_bwd_bytes_per_token": b.raw_bwd / b.tokens,
                    "wire_bwd_bytes_per_token": b.wire_bwd / b.tokens,
                    "ratio": b.ratio(),
                }
            )
            raw_f, raw_b = raw_f + b.raw_fwd, raw_b + b.raw_bwd
            wire_f, wire_b = wire_f + b.wire_fwd, wire_b + b.wire_bwd
            tok += b.tokens
        runs[f"{n}_stages"] = {
            "eval_loss": res.eval_loss,
            "loss_gap_pct": 100 * (res.eval_loss - plain.eval_loss) / plain.eval_loss,
            "tokens": res.tokens,
            "tokens_per_s": res.tokens_per_s,
            "boundaries": boundaries,
        }
    raw, wire = raw_f + raw_b, wire_f + wire_b
    worst = max(results[f"{n} stages"].eval_loss for n in stage_counts)
    return {
        "preset": args.preset,
        "d_model": d_model,
        "rank": rank,
        "codec": args.codec,
        "tokens_per_run": plain.tokens,
        # per token per boundary, forward + backward
        "raw_bytes_per_token": raw / tok,
        "wire_bytes_per_token": wire / tok,
        "raw_fwd_bytes_per_token": raw_f / tok,
        "wire_fwd_bytes_per_token": wire_f / tok,
        "raw_bwd_bytes_per_token": raw_b / tok,
        "wire_bwd_bytes_per_token": wire_b / tok,
        "compression_ratio": raw / wire,
        "eval_loss_plain": plain.eval_loss,
        "eval_loss_compressed": worst,  # the worse of the compressed runs
        "loss_gap_pct": 100 * (worst - plain.eval_loss) / plain.eval_loss,
        "tokens_per_s_plain": plain.tokens_per_s,
        "runs": runs,
        "settings": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "lr": args.lr,
            "seed": args.seed,
        },
    }


def print_table(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"compression: {out['preset']} d={out['d_model']} k={out['rank']}"
        f" {out['codec']}, {out['tokens_per_run']} tokens per run"
    )
    for col in ("run", "fwd raw/wire B/tok", "bwd raw/wire B/tok", "ratio", "eval loss", "gap %"):
        table.add_column(col, justify="right")
    table.add_row("plain", "-", "-", "-", f"{out['eval_loss_plain']:.4f}", "-")
    for name, run in out["runs"].items():
        for b in run["boundaries"]:
            table.add_row(
                f"{name} b{b['boundary']}",
                f"{b['raw_fwd_bytes_per_token']:.0f} / {b['wire_fwd_bytes_per_token']:.2f}",
                f"{b['raw_bwd_bytes_per_token']:.0f} / {b['wire_bwd_bytes_per_token']:.2f}",
                f"{b['ratio']:.1f}x",
                f"{run['eval_loss']:.4f}",
                f"{run['loss_gap_pct']:+.2f}",
            )
    table.add_row(
        "all boundaries",
        f"{out['raw_fwd_bytes_per_token']:.0f} / {out['wire_fwd_bytes_per_token']:.2f}",
        f"{out['raw_bwd_bytes_per_token']:.0f} / {out['wire_bwd_bytes_per_token']:.2f}",
        f"{out['compression_ratio']:.1f}x",
        f"{out['eval_loss_compressed']:.4f}",
        f"{out['loss_gap_pct']:+.2f}",
    )
    Console().print(table)
