"""The model behind `agora bench outer-sweep`: one stage group simulated in one process.

The real swarm benchmark (`agora bench convergence`) takes ~25 minutes a run on a small
machine, too slow to sweep. `Simulation` is an in-process simulation of one stage group
that reuses the real pieces:

- the model, its AdamW parameter groups and the inner step: `node.baseline.ChainedStages`
  (one stage, the whole `node.model` model) and `node.baseline.train_step` (gradient
  projection, clipping at 1.0, AdamW with betas (0.9, 0.95), weight projection), the
  same step `node.stage_compute.StageCompute.step` takes;
- the outer update: `node.diloco.pseudo_gradient`, `Contribution`, `outer_step` (robust
  token-weighted `aggregate`, `participation_lr`, `nesterov_step`) on an `OuterState`,
  and `merge_local_progress` to set a replica to the new `theta_g`;
- the wire codec of group rounds: `node.outer.wire.round_trip`, the outer-loop process's
  pseudo-gradient compression and decoder (loaded only when a run asks for one);
- the data: `node.data.RandomBatches` (`random`: random windows, like the central run),
  or stage 0's leased data (`bench.outer_sweep_data`): `lease`, whole shards in manifest
  order read front to back (the node's data path before small grants), or `pooled`, the
  lease data path the swarm runs now (ranges of at most `grant_tokens` tokens from shards
  in a seeded per-epoch order, round robin; the node's `node.lease_pool.LeasePool` with
  `lease_pool` open leases and windows drawn across them when `shuffle_windows`, committed
  by its commit rule at the round that carries them); and the fixed held-out set of
  `agora baseline` / `agora bench convergence` (`node.data.eval_batches`).

One simulated run: R replicas of the full model (default 2), each with its own AdamW
(inner lr and warm-up as the node's: linear warm-up, then constant, or `--inner-schedule
cosine` over the run's inner steps like the central run). Every round each replica trains
H inner steps of `inner_batch_tokens` tokens; the replicas that take part send
`theta_g - theta` weighted by their tokens, `outer_step` applies elastic Nesterov with
`target_tokens = R x H x inner_batch_tokens`, and every replica then continues from the new
`theta_g` (its AdamW state kept, as the node does after a merge).

Churn (`--churn Q`): each round each replica misses it with probability Q (seeded; the
same pattern for every setting of a run); its progress is not in the group (the round
gathers fewer tokens, so eta_r shrinks by the participation rule) and it rebases onto the
new `theta_g`, losing its round. With churn, `--kill-at` adds kill+join events: at each
fraction of the run one replica (in turn) is killed during a round (its round is lost) and
a fresh replica starts from the new `theta_g` with a fresh AdamW (warm-up again) at the
next round; in the lease modes the killed replica's shards are handed out first, from
where they stood (`lease`) or from their committed offsets (`pooled`), as the coordinator
does with released ones. A round nobody took part in does not step.

Simplifications, relative to the real node: rounds are synchronous (no overlap of inner
steps with the round); a replica that misses a round does not step alone on a diverging
copy of `theta_g` (it rebases); data a replica trained in a lost round is not re-trained
(except in `pooled` mode, whose commit rule hands it back as the node's does);
one process trains the whole model (no pipeline stages, no boundary codec).

The central reference (`central`) is `node.baseline.train` for the same total tokens (the
replicas' tokens, lost rounds included), same seed and held-out set, in the same process.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from bench.convergence_stats import CENTRAL_FLOOR
from bench.outer_sparse import SPARSE_CODECS, ErrorFeedback
from bench.outer_sweep_data import GrantQueue, LeaseBatches, LeaseQueue, PooledBatches
from node.baseline import ChainedStages, TrainConfig, evaluate, lr_at, train, train_step
from node.config import NodeConfig
from node.data import Dataset, RandomBatches, eval_batches
from node.diloco import (
    Contribution,
    DilocoConfig,
    OuterState,
    StepReport,
    merge_local_progress,
    outer_step,
    pseudo_gradient,
)
from node.model import PRESETS, ModelConfig, param_groups, preset
from node.outer.contract import COMPRESSIONS
from node.outer.sparse import SPARSE

DATA_MODES = ("random", "lease", "pooled")
SCHEDULES = ("constant", "cosine")
# the node's defaults (inner lr, warm-up, weight decay, outer settings)
_NODE: dict[str, Any] = {f.name: f.default for f in fields(NodeConfig)}


def _node_default(name: str) -> Any:
    return _NODE[name]


@dataclass(frozen=True, kw_only=True, slots=True)
class Common:
    """What every run of a sweep shares."""

    preset: str = "tiny"  # model preset (a name in node.model.PRESETS)
    tokens: int = 204_800  # training tokens per run, rounded to whole rounds (tokens)
    replicas: int = 2  # R, replicas of the stage group (replicas)
    batch_size: int = 16  # central batch (sequences per step)
    seq_len: int = 128  # sequence length (tokens)
    inner_batch_tokens: int = 0  # per inner step per replica (tokens); 0 = central / R
    lr: float = float(_node_default("lr"))  # inner and central peak lr (dimensionless)
    warmup: int = int(_node_default("warmup_steps"))  # inner and central warm-up (steps)
    weight_decay: float = float(_node_default("weight_decay"))  # AdamW decay (dimensionless)
    min_lr_ratio: float = 0.1  # cosine floor of a cosine inner lr (fraction)
    # the central run's lr after warm-up, one of CENTRAL_FLOOR: "constant" (the node's
    # inner schedule) or "cosine"
    central_schedule: str = "constant"
    eval_batches: int = 16  # held-out batches of batch_size x seq_len (batches)
    seed: int = 0  # model, data and churn seed (integer)
    kill_at: tuple[float, ...] = (1 / 3, 2 / 3)  # kill+join points in churn runs (run fraction)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {sorted(PRESETS)}")
        if self.replicas < 1 or self.tokens < 1 or self.batch_size < 1 or self.seq_len < 1:
            raise ValueError("replicas, tokens, batch size and seq len must be >= 1")
        if self.inner_tokens % self.seq_len or self.inner_tokens < self.seq_len:
            raise ValueError(
                f"inner_batch_tokens {self.inner_tokens} must be a multiple of seq_len {self.seq_len}"
            )
        if self.central_schedule not in CENTRAL_FLOOR:
            raise ValueError(
                f"central schedule {self.central_schedule!r}: choose from {sorted(CENTRAL_FLOOR)}"
            )
        if any(not 0.0 <= f < 1.0 for f in self.kill_at):
            raise ValueError(f"kill fractions must be in [0, 1), got {self.kill_at}")

    @property
    def central_tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def inner_tokens(self) -> int:
        return self.inner_batch_tokens or self.central_tokens // self.replicas

    def model_config(self) -> ModelConfig:
        cfg = preset(self.preset).replace(seed=self.seed)
        if self.seq_len > cfg.max_seq_len:
            cfg = cfg.replace(max_seq_len=self.seq_len)
        return cfg


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """The knobs one run varies."""

    eta: float = float(_node_default("outer_lr"))  # outer learning rate (dimensionless)
    mu: float = float(_node_default("outer_momentum"))  # outer momentum (dimensionless)
    H: int = int(_node_default("outer_every_steps"))  # inner steps per round (steps)
    p: float = float(_node_default("outer_participation_power"))  # participation power (exponent)
    churn: float = 0.0  # probability a replica misses a round (probability)
    data: str = "random"  # random | lease | pooled (name)
    # pooled data only: the coordinator's default grant cap (coordinator.config's
    # grant_tokens; 0 = the rest of the shard) and the node's pool and window draw
    grant_tokens: int = 8192  # largest granted range (tokens)
    lease_pool: int = int(_node_default("lease_pool"))  # open leases per replica (leases)
    shuffle_windows: bool = bool(_node_default("shuffle_windows"))  # draw across leases
    inner_schedule: str = "constant"  # constant | cosine (name)
    # none | fp16 | uint8 (the outer process's codecs), or sparse1 | sparse3 (top 1 or 3 %
    # of each chunk at 2 bits, with error feedback: bench.outer_sparse); group rounds only
    outer_compression: str = "none"  # (name)
    # centered clipping at this x the median norm, groups of >= 3 (0: the weighted mean)
    clip_rel: float = DilocoConfig().clip_rel
    # the node's robust aggregation (`outer_robust`): with it off, the plain weighted mean
    # (no centered clipping, no pair or direction bound), as `outer_robust = false` (switch)
    robust: bool = True
    stage: str = ""  # which part of the grid asked for it (label)

    def __post_init__(self) -> None:
        if self.H < 1 or not 0.0 <= self.churn < 1.0:
            raise ValueError(f"H must be >= 1 and churn in [0, 1), got {self.H}, {self.churn}")
        if self.data not in DATA_MODES or self.inner_schedule not in SCHEDULES:
            raise ValueError(f"data in {DATA_MODES}, inner schedule in {SCHEDULES}")
        if self.outer_compression not in OUTER_CODECS:
            raise ValueError(f"outer compression in {OUTER_CODECS}")
        if self.grant_tokens < 0 or self.lease_pool < 1:
            raise ValueError("grant_tokens must be >= 0 and lease_pool >= 1")

    def key(self) -> tuple[Any, ...]:
        d = asdict(self)
        d.pop("stage")
        return tuple(d.values())


# what `Setting.outer_compression` takes: the outer process's dense codecs (its sparse
# ones select with error feedback inside the outer process), and this simulation's own
OUTER_CODECS = (*(c for c in COMPRESSIONS if c not in SPARSE), *SPARSE_CODECS)


def flat_params(model: ChainedStages) -> torch.Tensor:
    """The replica's parameters as one flat fp32 vector (the outer loop's layout)."""
    return torch.cat([p.detach().flatten().to(torch.float32) for p in model.parameters()])


def _load_flat(model: ChainedStages, theta_g: torch.Tensor) -> None:
    """Set the working copy to `theta_g` the way the node's merge does (nothing in flight)."""
    params = list(model.parameters())
    merge_local_progress(params, flat_params(model), theta_g)


def _wire(delta: torch.Tensor, codec: str) -> torch.Tensor:
    """`delta` after the outer process's wire codec and its decoder (what every member of a
    group averages, its own contribution included)."""
    if codec == "none":
        return delta
    from node.outer.wire import round_trip  # loads hivemind: only for runs that need it

    return round_trip(delta, codec)


@dataclass
class Replica:
    model: ChainedStages
    opt: torch.optim.Optimizer
    batches: Any  # RandomBatches | LeaseBatches | PooledBatches
    steps: int = 0  # its own inner steps (warm-up restarts for a joiner)
    tokens: int = 0  # tokens trained since it last took theta_g
    loss: float = float("nan")


@dataclass
class RoundLog:
    round: int
    participants: int
    applied: bool
    eta_r: float
    tokens: int
    train_loss: float
    events: list[str] = field(default_factory=list)
    # with two contributions: the cosine of their pseudo-gradients (as sent), what the
    # pair bound (node.diloco.pair_problem) checks against its floor
    pair_cos: float | None = None
    rejected: int = 0  # contributions the outer step left out (count)


@dataclass
class RunResult:
    eval_loss: float
    rounds: int
    rounds_applied: int
    tokens_trained: int  # over all replicas, lost rounds included
    tokens_applied: int  # in the contributions outer steps used
    mean_eta_r: float  # over applied rounds
    final_train_loss: float
    seconds: float
    events: list[str]
    log: list[RoundLog]


class Simulation:
    """One run: R replicas, rounds of H inner steps, the real outer step."""

    def __init__(self, common: Common, setting: Setting, dataset: Dataset) -> None:
        self.c, self.s, self.dataset = common, setting, dataset
        self.mcfg = common.model_config()
        self.rows = common.inner_tokens // common.seq_len
        per_round = common.replicas * setting.H * common.inner_tokens
        self.rounds = max(1, round(common.tokens / per_round))
        self.total_inner_steps = self.rounds * setting.H
        self.dcfg = DilocoConfig(
            eta=setting.eta, mu=setting.mu, participation_power=setting.p,
            target_tokens=per_round, clip_rel=setting.clip_rel,
        )  # fmt: skip
        if not setting.robust:  # as node.outer_loop.outer_config does for outer_robust off
            self.dcfg = replace(self.dcfg, clip_rel=0.0, pair_max_ratio=0.0, pair_cos_sigmas=0.0)
        self.churn_rng = random.Random(common.seed)
        self.leases = LeaseQueue(dataset)
        self.grants = GrantQueue(
            dataset.manifest.train, grant_tokens=setting.grant_tokens, seed=common.seed
        )
        self._took_part: set[int] = set()  # slots whose contribution is in this round
        self.feedback: dict[int, ErrorFeedback] = {}  # slot -> its residual (sparse codecs)
        self._seeds = itertools.count(common.seed + 1)
        self.replicas: list[Replica | None] = [self._fresh() for _ in range(common.replicas)]
        first = self.replicas[0]
        assert first is not None
        self.state = OuterState.fresh(flat_params(first.model))
        self.kills: dict[int, int] = {}  # round -> replica slot
        if setting.churn > 0.0:
            for i, f in enumerate(common.kill_at):
                self.kills[min(self.rounds - 1, int(f * self.rounds))] = i % common.replicas
        self.joining: dict[int, Replica] = {}  # slot -> replacement for the next round
        self._events: list[str] = []  # this round's kill+join events
        self._missed: list[int] = []  # slots that missed this round
        self.lr_cfg = TrainConfig(
            preset=common.preset, steps=self.total_inner_steps, lr=common.lr,
            warmup=common.warmup, min_lr_ratio=common.min_lr_ratio,
        )  # fmt: skip

    def _fresh(self) -> Replica:
        model = ChainedStages(self.mcfg, 1, None)
        opt = torch.optim.AdamW(
            param_groups(model, self.c.weight_decay), lr=self.c.lr, betas=(0.9, 0.95)
        )
        batches: Any
        if self.s.data == "random":
            batches = RandomBatches(
                self.dataset.train, self.rows, self.c.seq_len, seed=next(self._seeds)
            )
        elif self.s.data == "lease":
            batches = LeaseBatches(self.leases, self.rows, self.c.seq_len)
        else:  # the node's window draw is seeded per node; here per replica
            rng = random.Random(next(self._seeds)) if self.s.shuffle_windows else None
            batches = PooledBatches(
                self.grants, self.dataset, rows=self.rows, seq_len=self.c.seq_len,
                lease_pool=self.s.lease_pool, rng=rng,
            )  # fmt: skip
        return Replica(model=model, opt=opt, batches=batches)

    def lr(self, rep: Replica, global_step: int) -> float:
        warm = min(1.0, (rep.steps + 1) / max(1, self.c.warmup))
        if self.s.inner_schedule == "constant":
            return self.c.lr * warm  # node.stage_compute: linear warm-up, then constant
        # the central run's cosine over the run's inner steps; a joiner warms up again
        return lr_at(self.lr_cfg, max(global_step, self.c.warmup)) * warm

    def train(self, k: int) -> list[Contribution]:
        """Round k's inner steps on every live replica; the contributions of those that
        take part (churn and kills decide)."""
        contribs: list[Contribution] = []
        slots: list[int] = []  # of each contribution
        self._events, self._missed, self._took_part = [], [], set()
        for slot, rep in enumerate(self.replicas):
            if rep is None:
                continue
            for i in range(self.s.H):
                lr = self.lr(rep, k * self.s.H + i)
                rep.loss = train_step(rep.model, rep.opt, next(rep.batches), lr, 1.0)
                rep.steps += 1
                rep.tokens += self.c.inner_tokens
            if not math.isfinite(rep.loss):
                raise FloatingPointError(f"replica {slot}: training loss {rep.loss} in round {k}")
            missed = self.churn_rng.random() < self.s.churn
            if isinstance(rep.batches, PooledBatches):
                rep.batches.round_start()
            if self.kills.get(k) == slot:
                self._events.append(f"round {k}: replica {slot} killed, a fresh one joins")
                if not isinstance(rep.batches, RandomBatches):
                    rep.batches.release()
                self.joining[slot] = self._fresh()
                self.replicas[slot] = None
                self.feedback.pop(slot, None)  # the joiner starts with no residual
                continue
            if missed:
                self._missed.append(slot)
                continue
            self._took_part.add(slot)
            slots.append(slot)
            contribs.append(
                Contribution(
                    delta=pseudo_gradient(self.state.theta_g, flat_params(rep.model)),
                    tokens=rep.tokens,
                )
            )
        codec = self.s.outer_compression
        if len(contribs) > 1 and codec in SPARSE_CODECS:
            for slot, c in zip(slots, contribs, strict=True):
                ef = self.feedback.setdefault(slot, ErrorFeedback(*SPARSE_CODECS[codec]))
                c.delta = ef.encode(c.delta)
        elif len(contribs) > 1 and codec != "none":
            for c in contribs:
                c.delta = _wire(c.delta, codec)
        return contribs

    def apply(self, k: int, contribs: Sequence[Contribution]) -> RoundLog:
        """The real outer step, then every replica (and any joiner) takes the new theta_g."""
        cos = None
        if len(contribs) == 2:
            a, b = contribs[0].delta, contribs[1].delta
            cos = float(
                torch.dot(a, b) / (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
            )
        rep_: StepReport | None = outer_step(self.state, contribs, self.dcfg) if contribs else None
        for slot, joiner in self.joining.items():
            self.replicas[slot] = joiner
        self.joining = {}
        applied = rep_ is not None and rep_.applied
        losses = []
        for slot, rep in enumerate(self.replicas):
            assert rep is not None
            if isinstance(rep.batches, PooledBatches):
                rep.batches.round_end(applied=applied, contributed=slot in self._took_part)
            _load_flat(rep.model, self.state.theta_g)
            rep.tokens = 0
            if math.isfinite(rep.loss):
                losses.append(rep.loss)
        return RoundLog(
            round=k,
            participants=len(contribs),
            applied=applied,
            eta_r=rep_.eta_r if rep_ is not None else 0.0,
            tokens=rep_.tokens if rep_ is not None else 0,
            train_loss=sum(losses) / len(losses) if losses else float("nan"),
            events=list(self._events),
            pair_cos=cos,
            rejected=len(rep_.rejected) if rep_ is not None else 0,
        )

    def round(self, k: int) -> RoundLog:
        return self.apply(k, self.train(k))

    def evaluate(self) -> float:
        model = ChainedStages(self.mcfg, 1, None)
        _load_flat(model, self.state.theta_g)
        held = eval_batches(
            self.dataset.heldout, self.c.batch_size, self.c.seq_len, self.c.eval_batches
        )
        return evaluate(model, held)

    def run(self, on_round: Callable[[int], None] | None = None) -> RunResult:
        t0 = time.perf_counter()
        logs = []
        for k in range(self.rounds):
            logs.append(self.round(k))
            if on_round is not None:
                on_round(k + 1)
        loss = self.evaluate()
        applied = [r for r in logs if r.applied]
        return RunResult(
            eval_loss=loss,
            rounds=self.rounds,
            rounds_applied=len(applied),
            tokens_trained=self.rounds * self.s.H * self.c.inner_tokens * self.c.replicas,
            tokens_applied=sum(r.tokens for r in applied),
            mean_eta_r=sum(r.eta_r for r in applied) / len(applied) if applied else 0.0,
            final_train_loss=logs[-1].train_loss,
            seconds=time.perf_counter() - t0,
            events=[e for r in logs for e in r.events],
            log=logs,
        )


def central(common: Common, dataset: Dataset, tokens: int) -> tuple[float, int, float]:
    """`node.baseline.train` for `tokens` tokens: (eval loss, tokens, seconds). Its lr
    after warm-up is constant (`common.central_schedule`), as the nodes' inner lr is:
    a cosine decay over these short runs made it a weaker reference by 7-8 %."""
    steps = max(1, round(tokens / common.central_tokens))
    cfg = TrainConfig(
        preset=common.preset, steps=steps, batch_size=common.batch_size, seq_len=common.seq_len,
        lr=common.lr, warmup=common.warmup, min_lr_ratio=CENTRAL_FLOOR[common.central_schedule],
        weight_decay=common.weight_decay, seed=common.seed, eval_every=steps,
        eval_batches=common.eval_batches, threads=1,
    )  # fmt: skip
    t0 = time.perf_counter()
    res, _ = train(cfg, dataset, model_config=common.model_config())
    return res.eval_loss, res.tokens, time.perf_counter() - t0
