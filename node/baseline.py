"""`agora baseline`: the centralised trainer every swarm claim is measured against.

Same model (node.model) and data path (node.data) as the swarm; AdamW with linear warm-up
and cosine decay, periodic held-out evaluation, a rich progress bar, and results as JSON
(`--json`), a CSV loss curve and a PNG plot (in `--out`). With `--compress CODEC --stages N`
the model runs as N stages chained in one process, every boundary going through the
codec forward and backward, as a swarm would send it. `train()` is the one training loop;
`agora bench compression` reuses it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ingest.tokenizer import TOKENIZER_FILE, RunTokenizer
from node.compression import BoundaryCodec, BoundaryStats, through_boundary
from node.data import Batch, Dataset, RandomBatches, eval_batches, load_dataset
from node.inner_step import inner_step
from node.model import (
    PRESETS,
    ModelConfig,
    Stage,
    build_stage,
    load_export,
    load_stage_weights,
    param_groups,
    preset,
    save_export,
)
from node.plotting import Series, plot_series, write_csv
from protocol.tensors import CODECS

log = logging.getLogger(__name__)
CURVE_FIELDS = ("step", "tokens", "lr", "train_loss", "eval_loss", "elapsed_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    preset: str = "tiny"  # model preset name (node.model.PRESETS)
    steps: int = 300  # optimizer steps
    batch_size: int = 16  # sequences per step
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak
    warmup: int = 30  # linear warm-up (steps)
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    eval_every: int = 50  # steps between held-out evaluations
    eval_batches: int = 8  # held-out batches per evaluation (batch_size x seq_len each)
    seed: int = 0  # data order and model seed
    rank: int | None = None  # subspace rank override; None = the preset's, 0 = none
    compress: str | None = None  # boundary codec; None = no boundaries
    stages: int = 1  # stages chained in-process (boundaries = stages - 1)
    threads: int = 0  # torch threads; 0 = min(cpu count, 8)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(PRESETS)}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1):
            raise ValueError("lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.warmup < 0 or self.grad_clip < 0 or self.threads < 0:
            raise ValueError("warmup, grad_clip and threads must be >= 0")
        if self.compress is not None and self.compress not in CODECS:
            raise ValueError(f"unknown codec {self.compress!r}; choose from {CODECS}")
        if self.compress is not None and self.stages < 2:
            raise ValueError("--compress needs --stages >= 2 (a codec sits between stages)")

    def model_config(self) -> ModelConfig:
        cfg = preset(self.preset).replace(seed=self.seed)
        if self.rank is not None:
            cfg = cfg.replace(subspace_rank=self.rank)
        if self.seq_len > cfg.max_seq_len:
            cfg = cfg.replace(max_seq_len=self.seq_len)
        return cfg


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    frac = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * frac))


class ChainedStages(nn.Module):
    """All stages of a model chained in one process, with codecs at the boundaries."""

    def __init__(self, config: ModelConfig, n_stages: int, codec: str | None) -> None:
        super().__init__()
        self.stages = nn.ModuleList(build_stage(config, s, n_stages) for s in range(n_stages))
        self.codecs = [
            BoundaryCodec(codec, config.d_model, self.stage_list()[s + 1].subspace)
            for s in range(n_stages - 1)
            if codec is not None
        ]

    def stage_list(self) -> list[Stage]:
        return [cast(Stage, s) for s in self.stages]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = tokens
        for i, stage in enumerate(self.stage_list()):
            if stage.is_last:
                out: torch.Tensor = stage(h, targets)
                return out
            h = stage(h)
            if self.codecs:
                h = through_boundary(h, tokens, self.codecs[i])
        raise AssertionError("unreachable: the last stage returns the loss")

    def boundary_stats(self) -> list[BoundaryStats]:
        return [c.stats for c in self.codecs]


@dataclass(slots=True)
class TrainResult:
    eval_loss: float  # held-out mean cross-entropy (nats per byte) at the end
    tokens: int  # training tokens seen
    tokens_per_s: float  # training throughput (evaluation time excluded)
    train_seconds: float
    final_train_loss: float
    curve: list[dict[str, Any]] = field(default_factory=list)
    boundaries: list[BoundaryStats] = field(default_factory=list)


@torch.no_grad()
def evaluate(model: ChainedStages, batches: list[Batch]) -> float:
    """Mean held-out loss; boundary traffic during evaluation is not counted."""
    saved = [c.stats for c in model.codecs]
    for c in model.codecs:
        c.stats = BoundaryStats()
    try:
        model.eval()
        losses = [float(model(x, y)) for x, y in batches]
    finally:
        model.train()
        for c, s in zip(model.codecs, saved, strict=True):
            c.stats = s
    return sum(losses) / len(losses)


def train_step(
    model: ChainedStages, opt: torch.optim.Optimizer, batch: Batch, lr: float, grad_clip: float
) -> float:
    """One optimizer step (`node.inner_step`, the swarm's own) on `batch`; the loss."""
    x, y = batch
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    inner_step(model.stage_list(), opt, lr=lr, grad_clip=grad_clip)
    return float(loss.detach())


def evaluate_weights(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    dataset: Dataset,
    *,
    batch_size: int,
    seq_len: int,
    n_batches: int,
) -> float:
    """Held-out loss of a whole model's weights (an export) on `eval_batches(...)`: the
    same fixed held-out set a `train` run with the same batch settings evaluates on."""
    if seq_len > config.max_seq_len:
        config = config.replace(max_seq_len=seq_len)
    model = ChainedStages(config, 1, None)
    load_stage_weights(model.stage_list()[0], tensors)
    held = eval_batches(dataset.heldout, batch_size, seq_len, n_batches)
    return evaluate(model, held)


ProgressHook = Callable[[int, dict[str, Any]], None]


def train(
    cfg: TrainConfig,
    dataset: Dataset,
    *,
    model_config: ModelConfig | None = None,
    init: dict[str, torch.Tensor] | None = None,
    on_step: ProgressHook | None = None,
) -> tuple[TrainResult, ChainedStages]:
    """The training loop shared by `agora baseline` and the benchmarks."""
    mcfg = model_config or cfg.model_config()
    torch.manual_seed(cfg.seed)
    model = ChainedStages(mcfg, cfg.stages, cfg.compress)
    if init is not None:
        for stage in model.stage_list():
            load_stage_weights(stage, init)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    batches = RandomBatches(dataset.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    held = eval_batches(dataset.heldout, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    curve: list[dict[str, Any]] = []
    tokens, train_s, loss = 0, 0.0, float("nan")
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(cfg, step)
        loss = train_step(model, opt, next(batches), lr, cfg.grad_clip)
        train_s += time.perf_counter() - t0
        tokens += cfg.batch_size * cfg.seq_len
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {step}")
        row: dict[str, Any] = {
            "step": step + 1,
            "tokens": tokens,
            "lr": lr,
            "train_loss": loss,
            "eval_loss": None,
            "elapsed_s": round(train_s, 3),
        }
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            row["eval_loss"] = evaluate(model, held)
            log.info("step %d tokens %d eval_loss %.4f", step + 1, tokens, row["eval_loss"])
        curve.append(row)
        if on_step is not None:
            on_step(step + 1, row)
    result = TrainResult(
        eval_loss=float(curve[-1]["eval_loss"]),
        tokens=tokens,
        tokens_per_s=tokens / train_s if train_s > 0 else float("nan"),
        train_seconds=train_s,
        final_train_loss=loss,
        curve=curve,
        boundaries=model.boundary_stats(),
    )
    return result, model


def rich_progress(total: int, description: str) -> tuple[Any, ProgressHook]:
    """A rich progress bar and the hook that advances it (use the bar as a context)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}"),
        TimeRemainingColumn(),
        transient=False,
    )
    task = bar.add_task(description, total=total, loss="-", eval="-")

    def hook(step: int, row: dict[str, Any]) -> None:
        fields_: dict[str, Any] = {"loss": f"{row['train_loss']:.3f}"}
        if row["eval_loss"] is not None:
            fields_["eval"] = f"{row['eval_loss']:.3f}"
        bar.update(task, completed=step, **fields_)

    return bar, hook


def write_outputs(out: Path, result: TrainResult, title: str) -> dict[str, str]:
    """CSV loss curve and PNG plot in `out`; returns their paths."""
    csv_path, png_path = out / "loss.csv", out / "loss.png"
    write_csv(csv_path, result.curve, CURVE_FIELDS)
    evals = [r for r in result.curve if r["eval_loss"] is not None]
    plot_series(
        png_path,
        [
            Series(
                "train",
                [r["tokens"] for r in result.curve],
                [r["train_loss"] for r in result.curve],
            ),
            Series("held-out", [r["tokens"] for r in evals], [r["eval_loss"] for r in evals], "o"),
        ],
        title=title,
        xlabel="tokens",
        ylabel="loss (nats per byte)",
    )
    return {"csv": str(csv_path), "png": str(png_path)}


# --- command line ------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora baseline",
        description="Train the model centrally on one machine: the reference every swarm"
        " run is compared to. Writes a CSV loss curve and a PNG plot to --out, and a"
        " summary (eval_loss in nats per token, tokens, tokens_per_s) to --json.",
    )
    p.add_argument("--config", type=Path, help="TOML file with a [baseline] table of options")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default tiny)")
    p.add_argument("--steps", type=int, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 128)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, help="run seed: model init, subspace and data order")
    p.add_argument("--rank", type=int, help="subspace rank k (default: the preset's; 0 = none)")
    p.add_argument("--eval-every", type=int, help="steps between held-out evaluations")
    p.add_argument("--compress", choices=CODECS, help="simulate stage boundaries with this codec")
    p.add_argument("--stages", type=int, help="stages to split the model into (with --compress)")
    p.add_argument("--threads", type=int, help="torch threads (default min(cpus, 8))")
    p.add_argument(
        "--dataset",
        help="'stdlib' (default), a directory of text files, a .jsonl, a .parquet file or"
        " directory, or a directory written by datasets' save_to_disk",
    )
    p.add_argument("--text-column", default="text", help="column holding the text (default text)")
    p.add_argument(
        "--tokenizer", default="bytes",
        help="'bytes' (default) or a tokenizer.json (agora tokenizer train); the model's"
        " vocabulary is the tokenizer's",
    )  # fmt: skip
    p.add_argument(
        "--init", type=Path, help="start from an export dir (model.safetensors + config.json)"
    )
    p.add_argument(
        "--eval-only", action="store_true",
        help="with --init: only evaluate the model on the held-out set (no training)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("baseline-out"), help="output directory")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


_FLAG_FIELDS = (
    "preset", "steps", "batch_size", "seq_len", "lr", "seed", "rank", "eval_every",
    "compress", "stages", "threads",
)  # fmt: skip


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = {}
    if args.config is not None:
        with args.config.open("rb") as fh:
            table = tomllib.load(fh).get("baseline", {})
        known = {f.name for f in fields(TrainConfig)}
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"{args.config}: unknown [baseline] keys {sorted(unknown)}")
        values.update(table)
    values.update({k: getattr(args, k) for k in _FLAG_FIELDS if getattr(args, k) is not None})
    return TrainConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        tokenizer = RunTokenizer.load(args.tokenizer)
        model_config, init = None, None
        if args.init is not None:
            model_config, init = load_export(args.init)
            if cfg.rank is not None:
                model_config = model_config.replace(subspace_rank=cfg.rank)
        elif not tokenizer.is_bytes:
            model_config = cfg.model_config().replace(vocab_size=tokenizer.vocab_size)
        vocab = (model_config or cfg.model_config()).vocab_size
        if vocab != tokenizer.vocab_size:
            raise ValueError(
                f"the model's vocabulary is {vocab} tokens, tokenizer {args.tokenizer}'s"
                f" {tokenizer.vocab_size}"
            )
        dataset = load_dataset(args.dataset, tokenizer=tokenizer, text_column=args.text_column)
    except (ValueError, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"agora baseline: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.threads or min(os.cpu_count() or 1, 8))
    if args.eval_only:
        return _eval_only(args, cfg, model_config, init, dataset)
    mcfg = model_config or cfg.model_config()
    title = f"baseline {cfg.preset} d={mcfg.d_model} k={mcfg.subspace_rank}"
    if cfg.compress:
        title += f" {cfg.compress} x{cfg.stages - 1} boundaries"
    try:
        if args.quiet:
            result, model = train(cfg, dataset, model_config=model_config, init=init)
        else:
            bar, hook = rich_progress(cfg.steps, "baseline")
            with bar:
                result, model = train(
                    cfg, dataset, model_config=model_config, init=init, on_step=hook
                )
    except KeyboardInterrupt:
        print("agora baseline: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"agora baseline: {exc}", file=sys.stderr)
        return 2
    paths = write_outputs(args.out, result, title)
    full = build_stage(mcfg, 0, 1)
    full.load_state_dict({k: v for s in model.stages for k, v in s.state_dict().items()})
    save_export(full, mcfg, args.out / "model")
    if not tokenizer.is_bytes:  # the export carries its tokenizer (agora export --format hf)
        (args.out / "model" / TOKENIZER_FILE).write_bytes(tokenizer.json)
    summary = {
        "eval_loss": result.eval_loss,
        "tokens": result.tokens,
        "tokens_per_s": result.tokens_per_s,
        "train_seconds": result.train_seconds,
        "final_train_loss": result.final_train_loss,
        "steps": cfg.steps,
        "dataset": dataset.manifest.name,
        "content_hash": dataset.manifest.content_hash,
        "train_config": {f.name: getattr(cfg, f.name) for f in fields(cfg)},
        "model_config": mcfg.to_dict(),
        "n_params": sum(p.numel() for p in full.parameters()),
        "export": str(args.out / "model"),
        **paths,
    }
    if result.boundaries:
        summary["boundaries"] = [
            {**{f.name: getattr(b, f.name) for f in fields(b)}, "ratio": b.ratio()}
            for b in result.boundaries
        ]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"eval_loss {result.eval_loss:.4f} nats/token after {result.tokens} tokens"
        f" ({result.tokens_per_s:.0f} tokens/s); curve {paths['csv']}, plot {paths['png']}"
    )
    return 0


def _eval_only(
    args: argparse.Namespace,
    cfg: TrainConfig,
    model_config: ModelConfig | None,
    init: dict[str, torch.Tensor] | None,
    dataset: Dataset,
) -> int:
    """`--init DIR --eval-only`: the held-out loss of an export, nothing trained."""
    if model_config is None or init is None:
        print("agora baseline: --eval-only needs --init DIR (an export)", file=sys.stderr)
        return 2
    try:
        loss = evaluate_weights(
            model_config, init, dataset,
            batch_size=cfg.batch_size, seq_len=cfg.seq_len, n_batches=cfg.eval_batches,
        )  # fmt: skip
    except ValueError as exc:
        print(f"agora baseline: {exc}", file=sys.stderr)
        return 2
    summary = {
        "eval_loss": loss,
        "init": str(args.init),
        "dataset": dataset.manifest.name,
        "content_hash": dataset.manifest.content_hash,
        "eval_batches": cfg.eval_batches,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "model_config": model_config.to_dict(),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"eval_loss {loss:.4f} nats/token (held-out, {args.init})")
    return 0
