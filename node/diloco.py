"""The DiLoCo outer-step math: pseudo-gradients, robust token-weighted averaging (of the
whole vector, or of one part of it for a reduce-scatter), elastic Nesterov with a
participation-adaptive learning rate, staleness, and the overlap merge.

Pure torch, no I/O and no hivemind: the outer-loop process (`node.outer`) calls these
functions, and the tests check them against hand-computed references. Every tensor here
is a flat fp32 vector (one per stage: all parameters concatenated), so the order of
floating-point operations is fixed and replicas that feed the same bytes in the same
order get bitwise-identical results.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

# The settings live with the outer-loop process's settings (torch-free), which Init carries
# to that process; re-exported here beside the math they configure.
from node.outer.settings import DilocoConfig as DilocoConfig


@dataclass(slots=True)
class OuterState:
    """A replica's copy of the global state of its stage."""

    theta_g: torch.Tensor  # flat fp32 global parameters at the last outer step
    m: torch.Tensor  # flat fp32 outer momentum
    round: int = 0  # outer steps applied so far

    @classmethod
    def fresh(cls, theta: torch.Tensor) -> OuterState:
        flat = theta.detach().to(torch.float32).flatten().clone()
        return cls(theta_g=flat, m=torch.zeros_like(flat), round=0)


@dataclass(slots=True)
class Contribution:
    """One replica's pseudo-gradient for a round."""

    delta: torch.Tensor  # flat fp32, theta_g - theta
    tokens: int  # tokens trained since theta_g
    staleness: int = 0  # rounds its base theta_g lags the group head


@dataclass(slots=True)
class Aggregate:
    """The result of averaging a round's contributions."""

    delta: torch.Tensor | None  # D, or None when nothing was accepted
    tokens: int  # tokens of the accepted contributions
    weights: list[float]  # effective weight per contribution (0 when rejected)
    rejected: dict[int, str] = field(default_factory=dict)  # index -> reason
    # the rejected ones no honest replica sends (non-finite, or a norm past the bounds),
    # as opposed to stale or zero-token ones: what a member reports to the coordinator
    suspect: set[int] = field(default_factory=set)
    # contributions that centered clipping scaled down (0: the result is the plain
    # weighted mean, bit for bit)
    clipped: int = 0


@dataclass(slots=True)
class StepReport:
    applied: bool
    round: int
    eta_r: float
    tokens: int
    accepted: int
    rejected: dict[int, str]


def pseudo_gradient(theta_g: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """`delta = theta_g - theta` as a flat fp32 vector."""
    if theta_g.numel() != theta.numel():
        raise ValueError(f"theta has {theta.numel()} elements, theta_g has {theta_g.numel()}")
    return theta_g.flatten().to(torch.float32) - theta.flatten().to(torch.float32)


def participation_lr(eta: float, tokens: int, target_tokens: int, power: float) -> float:
    """Outer learning rate for a round that gathered `tokens` of its `target_tokens`.

    `eta_r = eta * min(1, tokens / target_tokens) ** power`; `target_tokens == 0` turns the
    scaling off. The default `power = 0.5` comes from the noise of the average: D averages
    `tokens` worth of gradient information, so its noise has standard deviation proportional
    to `1 / sqrt(tokens)`. Scaling the step by `sqrt(tokens / target)` keeps the noise of
    the applied step at the level of a full round, while a round with less evidence moves
    the global parameters less. `power = 1` is the linear (more conservative) rule and
    `power = 0` ignores participation. Rounds never step further than `eta`.
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if target_tokens <= 0:
        return eta
    frac = min(1.0, tokens / target_tokens)
    return float(eta * frac**power)


def staleness_weight(staleness: int, decay: float, max_staleness: int) -> float:
    """Multiplier for a contribution computed against a `theta_g` `staleness` rounds old:
    `decay ** staleness`, and 0 past `max_staleness` (dropped)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if staleness > max_staleness:
        return 0.0
    return float(decay**staleness)


def rejection_reason(delta: torch.Tensor, ref_norm: float, cfg: DilocoConfig) -> str | None:
    """Why a single contribution is unusable on its own (non-finite or absurd norm), or None."""
    if not bool(torch.isfinite(delta).all()):
        return "non-finite values"
    norm = float(torch.linalg.vector_norm(delta))
    limit = cfg.max_rel_norm * max(ref_norm, 1e-12)
    if norm > limit:
        return f"norm {norm:.3g} above max_rel_norm * ||theta_g|| = {limit:.3g}"
    return None


def centered_clip(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], tau: float, iters: int
) -> tuple[torch.Tensor, int]:
    """Weighted centered clipping (Karimireddy et al. 2021) started at the weighted medoid
    (the contribution with the least weighted distance to the others):
    `v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i`, where clip scales a vector down to
    norm `tau`. An outlier moves the result by at most `tau * w_i / sum w` per iteration.
    Also returns how many contributions were scaled down in some iteration: with none,
    the first iteration lands on the weighted mean and the others stay there."""
    total = float(sum(weights))
    live = [i for i, w in enumerate(weights) if w != 0.0]
    cost = {
        i: sum(weights[j] * float(torch.linalg.vector_norm(deltas[i] - deltas[j])) for j in live)
        for i in live
    }
    v = deltas[min(live, key=lambda i: (cost[i], i))].clone()
    clipped: set[int] = set()
    for _ in range(iters):
        acc = torch.zeros_like(v)
        for i, (x, w) in enumerate(zip(deltas, weights, strict=True)):
            if w == 0.0:
                continue
            diff = x - v
            norm = float(torch.linalg.vector_norm(diff))
            scale = min(1.0, tau / norm) if norm > 0.0 else 1.0
            if scale < 1.0:
                clipped.add(i)
            acc.add_(diff, alpha=w * scale)
        v = v + acc / total
    return v, len(clipped)


def _weighted_mean(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], total: float
) -> torch.Tensor:
    acc = torch.zeros_like(deltas[0])
    for x, w in zip(deltas, weights, strict=True):
        if w != 0.0:
            acc.add_(x, alpha=w)
    return acc / total


def aggregate(contribs: Sequence[Contribution], ref_norm: float, cfg: DilocoConfig) -> Aggregate:
    """Token- and staleness-weighted average `D = sum w_i delta_i / sum w_i` of the usable
    contributions, with `w_i = tokens_i * staleness_weight(staleness_i)`.

    Rejected: non-finite or absurd-norm deltas (see `rejection_reason`), with three or more
    candidates also those whose norm exceeds `max_median_ratio` times the median and, of
    three or more left, those pointing like too few of the others (`direction_problems`),
    zero-token ones and ones past the staleness bound. With `clip_radius > 0` the mean is replaced by
    centered clipping at that radius; otherwise, with three or more usable contributions
    and `clip_rel > 0` (the default), by centered clipping at `clip_rel` times their median
    norm: when every contribution stays within that distance of the running centre the
    result is the weighted mean, the same bits as without clipping (`Aggregate.clipped`
    is 0), and one member, however weighted, moves the result by
    at most `tau * w_i / sum w` per iteration. The result depends only on the inputs and
    their order.
    """
    return _aggregate(contribs, ref_norm, cfg.clip_radius, cfg)


def part_bounds(numel: int, members: int) -> list[tuple[int, int]]:
    """The contiguous parts `[start, end)` of a flat vector of `numel` elements that a
    group of `members` reduces, part j by its j-th member in the group's order: as many
    parts as members, but each at least 2 elements long (the 8-bit codec needs two), so a
    vector shorter than `2 * members` has fewer parts; the first `numel % parts` parts are
    one element longer."""
    if numel < 1 or members < 1:
        raise ValueError(f"numel and members must be >= 1, got {numel} and {members}")
    parts = max(1, min(members, numel // 2))
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for j in range(parts):
        end = start + base + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def part_share(bounds: tuple[int, int], numel: int) -> float:
    """The norm share of a part: `sqrt(len / numel)`, the fraction of a vector's norm that
    falls in the part when its energy is spread evenly (as Adam's per-element steps spread
    a pseudo-gradient's)."""
    start, end = bounds
    if not 0 <= start < end <= numel:
        raise ValueError(f"part [{start}, {end}) is not inside [0, {numel})")
    return math.sqrt((end - start) / numel)


def aggregate_part(
    contribs: Sequence[Contribution],
    ref_norm: float,
    share: float,
    cfg: DilocoConfig,
    own: int | None = None,
) -> Aggregate:
    """`aggregate` of one part of the vector (each `delta` is that part of a member's
    pseudo-gradient), with its bounds scaled to the part: the norm bound is
    `max_rel_norm * share * ref_norm` and the clipping radius `share * clip_radius`, where
    `share` is `part_share` of the part and `ref_norm` the whole vector's reference norm.
    The median check and the weights are the whole vector's rules, per part. A
    contribution that passes every part's norm bound passes the whole vector's, since the
    squared shares sum to 1. `own` is the index of the reducer's own contribution: when
    it and one other are usable, the other must pass `pair_problem` against it."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    return _aggregate(contribs, ref_norm * share, cfg.clip_radius * share, cfg, own)


# how the rejection reasons that only robust aggregation gives begin: the pair bound's and
# the majority direction's (with `outer_robust` off neither rule runs, so a round whose
# aggregates name neither reason computed what the plain weighted mean computes)
PAIR_REASON = "pair: "
DIRECTION_REASON = "direction: "
ROBUST_REASONS = (PAIR_REASON, DIRECTION_REASON)

# a pair-bound rejection is reported to the coordinator (`Aggregate.suspect`) only for a
# norm past the bound or a cosine below this: opposed to the reducer's own descent. Honest
# pairs reached cosines of -0.014 in a real swarm (a replica near the end of its data, one
# that had stepped alone on another state), rejected but not reported (dimensionless)
OPPOSED_COS = -0.1


def pair_problem(
    ours: Contribution, theirs: Contribution, cfg: DilocoConfig
) -> tuple[str, bool] | None:
    """Why a reducer that has only its own contribution and one other to average rejects
    the other's, or None: a norm past `pair_max_ratio` x its own (times the ratio of the
    tokens they claim, when the other claims more), or a cosine below `pair_cos_sigmas /
    sqrt(n)`, where two random directions of n elements fall with probability about
    that many standard deviations' tail: noise of any norm, a sign flip, or a descent
    unrelated to the reducer's own. Honest replicas start from one theta_g and descend
    one loss, so their pseudo-gradients point alike (docs/outer-averaging.md). Returns the
    reason and whether no honest replica sends such a contribution (a norm past the
    bound, or a cosine below `OPPOSED_COS`): only those are reported. A reducer whose own
    part did not move (it trained nothing since its round began, as at the end of a
    drain) has no descent to judge by and rejects nothing: the other contribution is
    then bounded by the single-contribution rules alone."""
    a, b = ours.delta, theirs.delta
    na, nb = float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b))
    if na == 0.0:
        return None
    if cfg.pair_max_ratio > 0.0:
        limit = cfg.pair_max_ratio * na * max(1.0, theirs.tokens / max(ours.tokens, 1))
        if nb > limit:
            return (
                f"{PAIR_REASON}norm {nb:.3g} above {cfg.pair_max_ratio} x the reducer's {na:.3g}",
                True,
            )
    if cfg.pair_cos_sigmas > 0.0 and nb > 0.0:
        cos = float(torch.dot(a, b)) / (na * nb)
        floor = cfg.pair_cos_sigmas / math.sqrt(a.numel())
        if cos < floor:
            return (
                f"{PAIR_REASON}cosine {cos:.3g} with the reducer's below {floor:.3g}",
                cos < OPPOSED_COS,
            )
    return None


# the direction check of three or more contributions needs parts long enough that its
# cosine floor (sigmas / sqrt(n)) sits well below what honest pairs reach: at 4 sigmas,
# 256 elements; shorter vectors (toy tests, not real stages) skip it (dimensionless)
DIRECTION_MAX_FLOOR = 0.25


def direction_problems(
    deltas: Sequence[torch.Tensor],
    candidates: Sequence[int],
    cos_sigmas: float,
    norms: Mapping[int, float] | None = None,
) -> dict[int, tuple[str, bool]]:
    """With three or more candidate contributions, the ones that point like too few of the
    others: contribution i agrees with j when their cosine is at least `cos_sigmas /
    sqrt(n)` (above what two random directions of n elements reach; vectors too short
    for that floor to sit below `DIRECTION_MAX_FLOOR` are not checked), and it is rejected
    when it agrees with fewer than `(m - 1) // 2` of the other m - 1. Honest replicas
    descend one loss from one theta_g, so each agrees with every other honest one, and
    fewer than half the candidates lying can neither reject an honest contribution nor
    keep one that points across or against every honest one (a sign flip, noise).
    `norms`: the candidates' L2 norms where the caller has them. Returns index -> (reason,
    whether it is opposed, cosine below `OPPOSED_COS`, to more than half of the others:
    no honest replica sends that, so it is reported)."""
    m = len(candidates)
    if m < 3 or cos_sigmas <= 0.0:
        return {}
    floor = cos_sigmas / math.sqrt(deltas[candidates[0]].numel())
    if floor > DIRECTION_MAX_FLOOR:
        return {}
    if norms is None:
        norms = {i: float(torch.linalg.vector_norm(deltas[i])) for i in candidates}
    cos: dict[tuple[int, int], float] = {}
    for a, i in enumerate(candidates):
        for j in candidates[a + 1 :]:
            den = norms[i] * norms[j]
            cos[i, j] = cos[j, i] = float(torch.dot(deltas[i], deltas[j])) / den if den else 0.0
    need = (m - 1) // 2
    found: dict[int, tuple[str, bool]] = {}
    for i in candidates:
        others = [cos[i, j] for j in candidates if j != i]
        agree = sum(1 for c in others if c >= floor)
        if agree < need:
            opposed = sum(1 for c in others if c < OPPOSED_COS) * 2 > len(others)
            reason = (
                f"{DIRECTION_REASON}agrees with {agree} of {m - 1} others (cosine >= {floor:.3g}), "
                f"needs {need}; cosines {', '.join(f'{c:.3g}' for c in others)}"
            )
            found[i] = (reason, opposed)
    return found


def _aggregate(
    contribs: Sequence[Contribution],
    ref_norm: float,
    clip_radius: float,
    cfg: DilocoConfig,
    own: int | None = None,
) -> Aggregate:
    rejected: dict[int, str] = {}
    suspect: set[int] = set()
    weights: list[float] = []
    norms: dict[int, float] = {}
    for i, c in enumerate(contribs):
        reason = rejection_reason(c.delta, ref_norm, cfg)
        if reason is not None:
            suspect.add(i)
        sw = staleness_weight(c.staleness, cfg.staleness_decay, cfg.max_staleness)
        if reason is None and c.tokens <= 0:
            reason = "no tokens"
        if reason is None and sw == 0.0:
            reason = f"staleness {c.staleness} above bound {cfg.max_staleness}"
        if reason is not None:
            rejected[i] = reason
            weights.append(0.0)
            continue
        norms[i] = float(torch.linalg.vector_norm(c.delta))
        weights.append(c.tokens * sw)
    if len(norms) >= 3:
        median = sorted(norms.values())[(len(norms) - 1) // 2]
        for i, n in norms.items():
            if n > cfg.max_median_ratio * max(median, 1e-12):
                rejected[i] = f"norm {n:.3g} above {cfg.max_median_ratio} x median {median:.3g}"
                suspect.add(i)
                weights[i] = 0.0
    pair = [i for i in norms if weights[i] > 0.0]
    for i, (reason, opposed) in direction_problems(
        [c.delta for c in contribs], pair, cfg.pair_cos_sigmas, norms
    ).items():
        rejected[i], weights[i] = reason, 0.0
        if opposed:
            suspect.add(i)
    pair = [i for i in pair if weights[i] > 0.0]
    if own in pair and len(pair) == 2:
        other = pair[0] if pair[1] == own else pair[1]
        found = pair_problem(contribs[own], contribs[other], cfg)
        if found is not None:
            rejected[other], weights[other] = found[0], 0.0
            if found[1]:
                suspect.add(other)
    total = float(sum(weights))
    tokens = sum(c.tokens for i, c in enumerate(contribs) if weights[i] > 0.0)
    if total <= 0.0:
        return Aggregate(delta=None, tokens=0, weights=weights, rejected=rejected, suspect=suspect)
    deltas = [c.delta for c in contribs]
    usable = sorted(n for i, n in norms.items() if weights[i] > 0.0)
    tau = clip_radius
    if tau <= 0.0 and cfg.clip_rel > 0.0 and len(usable) >= 3:
        tau = cfg.clip_rel * max(usable[(len(usable) - 1) // 2], 1e-12)
    clipped = 0
    if tau > 0.0:
        d, clipped = centered_clip(deltas, weights, tau, cfg.clip_iters)
    if clipped == 0:  # what clipping computes then, in exact arithmetic, in the mean's bits
        d = _weighted_mean(deltas, weights, total)
    return Aggregate(
        delta=d, tokens=tokens, weights=weights, rejected=rejected, suspect=suspect,
        clipped=clipped,
    )  # fmt: skip


def nesterov_step(state: OuterState, d: torch.Tensor, eta_r: float, mu: float) -> None:
    """Elastic Nesterov, in place: `m <- mu m + D`, `theta_g <- theta_g - eta_r (D + mu m)`."""
    state.m.mul_(mu).add_(d)
    state.theta_g.sub_(d + mu * state.m, alpha=eta_r)


def outer_step(
    state: OuterState, contribs: Sequence[Contribution], cfg: DilocoConfig
) -> StepReport:
    """Average a round's contributions and apply one elastic Nesterov step to `state`.

    A round where nothing usable arrived leaves the state untouched (round unchanged).
    """
    ref = float(torch.linalg.vector_norm(state.theta_g))
    agg = aggregate(contribs, ref, cfg)
    if agg.delta is None:
        return StepReport(False, state.round, 0.0, 0, 0, agg.rejected)
    eta_r = participation_lr(cfg.eta, agg.tokens, cfg.target_tokens, cfg.participation_power)
    nesterov_step(state, agg.delta, eta_r, cfg.mu)
    state.round += 1
    accepted = sum(1 for w in agg.weights if w > 0.0)
    return StepReport(True, state.round, eta_r, agg.tokens, accepted, agg.rejected)


def merge_local_progress(
    working: Sequence[torch.Tensor], snapshot: torch.Tensor, new_theta_g: torch.Tensor
) -> None:
    """Overlap merge, in place: every working tensor becomes `new_theta_g + (working - snapshot)`.

    `working` are the live parameters (any dtype), `snapshot` and `new_theta_g` flat fp32
    vectors in the same order: the inner steps taken while the round ran are kept.
    """
    offset = 0
    for p in working:
        n = p.numel()
        if offset + n > snapshot.numel() or snapshot.numel() != new_theta_g.numel():
            raise ValueError(
                f"parameters need {offset + n}+ elements, snapshot has {snapshot.numel()}, "
                f"theta_g {new_theta_g.numel()}"
            )
        # snapshot and theta_g are the outer process's CPU buffers; p may be on a GPU
        snap = snapshot[offset : offset + n].to(p.device)
        local = p.detach().flatten().to(torch.float32) - snap
        with torch.no_grad():
            p.copy_((new_theta_g[offset : offset + n].to(p.device) + local).view_as(p))
        offset += n
    if offset != snapshot.numel():
        raise ValueError(f"parameters hold {offset} elements, snapshot has {snapshot.numel()}")
