"""`agora bench convergence`'s sizing and statistics, apart from the swarm processes.

- `mean_interval(values)`: the mean of per-seed gaps and its two-sided 95 % Student t
  interval (None with fewer than two values: one seed gives no interval).
- `central_steps(counts, batch_tokens)`: the central optimizer step whose token count is
  nearest to each swarm run's committed tokens.
- `central_losses(cfg, dataset, steps)`: one central run of `cfg.steps` steps, its held-out
  loss evaluated at each of `steps` on the way. It is `node.baseline.train`'s loop step for
  step (same init, optimizer, schedule, data order and held-out set: its loss at
  `cfg.steps` equals `train(cfg, dataset)`'s eval loss; tests/test_bench_convergence.py
  checks it), so one run serves every token count of a seed.
- `CENTRAL_FLOOR`: the central run's lr schedules after warm-up, shared by this bench and
  `agora bench outer-sweep`'s simulation.
- `robust_rejections(applied)`: how often robust aggregation changed a swarm run's outer
  rounds: the part contributions its pair and direction rules left out, counted once per
  group round from the nodes' `round_applied` events, and the contributions centered
  clipping scaled down, summed over every member's own reduction. Both zero means the
  run computed exactly the aggregates it would have with `outer_robust` off.
- `heldout_split(dataset, split)`: the dataset with its held-out tokens cut down to one
  split of the held-out shards: `heldout` (all of them), `validation` (the 2nd, 4th, ...
  held-out shard) or `test` (the 1st, 3rd, ...): validation and test are disjoint, so a
  setting tuned on `validation` can be reported on `test` without having seen it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from node.baseline import ChainedStages, TrainConfig, evaluate, lr_at, train_step
from node.data import Dataset, RandomBatches, eval_batches, tokens_tensor
from node.diloco import ROBUST_REASONS
from node.model import param_groups
from protocol.corpus import ShardInfo, shard_data

# the central run's learning rate after warm-up, as a fraction of the peak at its last
# step: constant (the swarm's inner schedule), or cosine decay to 0.1 x
CENTRAL_FLOOR = {"constant": 1.0, "cosine": 0.1}

SPLITS = ("heldout", "validation", "test")

# two-sided 95 % critical values of Student's t (the 0.975 quantile), df = 1..30
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
_Z975 = 1.959964


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (>= 1): a table up
    to 30, the Cornish-Fisher expansion beyond (within 1e-4 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float | None  # None: one value, no interval
    high: float | None
    n: int


def mean_interval(values: Iterable[float]) -> Interval:
    """Mean and two-sided 95 % Student t interval (mean +- t975(n-1) s / sqrt(n))."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_interval needs at least one value")
    if any(not math.isfinite(x) for x in xs):
        raise ValueError(f"mean_interval got a non-finite value in {xs}")
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return Interval(mean, None, None, 1)
    half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Interval(mean, mean - half, mean + half, len(xs))


def central_steps(counts: Iterable[int], batch_tokens: int) -> dict[int, int]:
    """count -> the central step (>= 1) whose tokens (`step * batch_tokens`) are nearest
    to `count`: the central run is at most half a batch off each swarm run's count."""
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    out: dict[int, int] = {}
    for c in counts:
        if c < 1:
            raise ValueError(f"a token count must be >= 1, got {c}")
        out[c] = max(1, round(c / batch_tokens))
    return out


StepHook = Callable[[int, float], None]


def central_losses(
    cfg: TrainConfig, dataset: Dataset, steps: Iterable[int], on_step: StepHook | None = None
) -> tuple[dict[int, float], float]:
    """One central run of `cfg.steps` steps (`node.baseline.train`'s loop); the held-out
    loss after each of `steps` (each in 1..cfg.steps) and the training seconds."""
    want = sorted(set(steps))
    if not want or want[0] < 1 or want[-1] > cfg.steps:
        raise ValueError(f"evaluation steps {want} must lie in 1..{cfg.steps}")
    torch.manual_seed(cfg.seed)
    model = ChainedStages(cfg.model_config(), cfg.stages, cfg.compress)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    batches = RandomBatches(dataset.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    held = eval_batches(dataset.heldout, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    losses: dict[int, float] = {}
    train_s = 0.0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        loss = train_step(model, opt, next(batches), lr_at(cfg, step), cfg.grad_clip)
        train_s += time.perf_counter() - t0
        if not math.isfinite(loss):
            raise FloatingPointError(f"central training loss became {loss} at step {step}")
        if step + 1 in want:
            losses[step + 1] = evaluate(model, held)
        if on_step is not None:
            on_step(step + 1, loss)
    return losses, train_s


def split_shards(heldout: list[ShardInfo], split: str) -> list[ShardInfo]:
    """The held-out shards of `split` (see the module doc)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if split == "heldout":
        return list(heldout)
    if len(heldout) < 2:
        raise ValueError(
            f"the {split} split needs at least 2 held-out shards, the corpus has"
            f" {len(heldout)}; use the heldout split"
        )
    return list(heldout[1::2] if split == "validation" else heldout[0::2])


def heldout_split(dataset: Dataset, split: str) -> Dataset:
    """`dataset` with `heldout` holding only the tokens of `split`'s held-out shards."""
    shards = split_shards(dataset.manifest.heldout, split)
    if split == "heldout":
        return dataset
    width = dataset.manifest.token_bytes
    chunk = b"".join(shard_data(dataset.data, s, width) for s in shards)
    return dataclasses.replace(dataset, heldout=tokens_tensor(chunk, width))


# one robust rejection in a `rejected` reason: the outer process joins a peer's reasons
# over the parts as "part J: REASON; part K: REASON" (the all-gather: "REASON")
_ROBUST = re.compile(
    r"(?:^|; )(?:part \d+: )?(?:" + "|".join(re.escape(r) for r in ROBUST_REASONS) + ")"
)


def robust_rejections(applied: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[str, int]:
    """From (stage, `round_applied` event) pairs of every node of a run: its distinct group
    rounds (a group's members apply one (stage, round, digest), so each counts once), the
    largest group, the part contributions judged (a group of g members cuts g parts, each
    judging every member's piece: g^2), those that the robust rules (the pair bound and
    the majority's direction, `node.diloco.ROBUST_REASONS`) left out, and those that
    centered clipping scaled down (each member's `clipped`, for the reduction it did)."""
    applied = list(applied)
    rounds: dict[tuple[int, int, str], Mapping[str, Any]] = {}
    for stage, e in applied:
        if int(e.get("group_size", 1)) > 1:
            rounds.setdefault((stage, int(e["round"]), str(e.get("digest", ""))), e)
    sizes = [int(e["group_size"]) for e in rounds.values()]
    rejected = sum(
        len(_ROBUST.findall(str(why)))
        for e in rounds.values()
        for why in (e.get("rejected") or {}).values()
    )
    return {
        "group_rounds": len(rounds),
        "largest_group": max(sizes, default=1),
        "part_contributions": sum(g * g for g in sizes),
        "robust_rejections": rejected,
        "robust_clipped": sum(int(e.get("clipped", 0)) for _stage, e in applied),
    }
