"""The outer optimizer (node.diloco) against hand-computed references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.diloco import (
    Contribution,
    DilocoConfig,
    OuterState,
    aggregate,
    aggregate_part,
    centered_clip,
    direction_problems,
    merge_local_progress,
    outer_step,
    pair_problem,
    part_bounds,
    part_share,
    participation_lr,
    pseudo_gradient,
    staleness_weight,
)
from node.outer.parts import needs_others


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def test_pseudo_gradient_is_theta_g_minus_theta() -> None:
    assert torch.equal(pseudo_gradient(t(1.0, 2.0), t(0.5, 3.0)), t(0.5, -1.0))
    with pytest.raises(ValueError, match="elements"):
        pseudo_gradient(t(1.0), t(1.0, 2.0))


def test_token_weighted_nesterov_step_matches_hand_computation() -> None:
    cfg = DilocoConfig(eta=0.5, mu=0.9, max_rel_norm=10.0)
    state = OuterState(theta_g=t(1.0, 1.0), m=t(0.1, -0.2), round=3)
    # w = 3 and 1 tokens: D = (3*[1,0] + 1*[0,2]) / 4 = [0.75, 0.5]
    rep = outer_step(state, [Contribution(t(1.0, 0.0), 3), Contribution(t(0.0, 2.0), 1)], cfg)
    # m = 0.9*[0.1,-0.2] + D = [0.84, 0.32]; theta_g = 1 - 0.5*(D + 0.9 m)
    m = [0.9 * 0.1 + 0.75, 0.9 * -0.2 + 0.5]
    g = [1 - 0.5 * (0.75 + 0.9 * m[0]), 1 - 0.5 * (0.5 + 0.9 * m[1])]
    assert rep.applied and rep.round == 4 and rep.tokens == 4 and rep.accepted == 2
    assert state.round == 4
    assert torch.allclose(state.m, t(*m), atol=1e-6)
    assert torch.allclose(state.theta_g, t(*g), atol=1e-6)


def test_participation_rule_scales_eta_by_sqrt_of_gathered_fraction() -> None:
    assert participation_lr(0.7, 100, 0, 0.5) == 0.7  # scaling off
    assert participation_lr(0.7, 400, 100, 0.5) == 0.7  # never above eta
    assert math.isclose(participation_lr(0.7, 25, 100, 0.5), 0.7 * 0.5)
    assert math.isclose(participation_lr(0.8, 25, 100, 1.0), 0.2)
    with pytest.raises(ValueError, match="tokens"):
        participation_lr(0.7, -1, 100, 0.5)


def test_missing_peers_shrink_the_step() -> None:
    cfg = DilocoConfig(eta=0.8, mu=0.0, target_tokens=400, max_rel_norm=10.0)
    full = OuterState(theta_g=t(10.0), m=t(0.0))
    outer_step(full, [Contribution(t(1.0), 100) for _ in range(4)], cfg)
    alone = OuterState(theta_g=t(10.0), m=t(0.0))
    rep = outer_step(alone, [Contribution(t(1.0), 100)], cfg)  # the other three missed it
    assert math.isclose(float(full.theta_g), 9.2, rel_tol=1e-6)
    assert math.isclose(rep.eta_r, 0.8 * 0.5) and math.isclose(
        float(alone.theta_g), 9.6, rel_tol=1e-6
    )


def test_staleness_discounts_then_drops() -> None:
    assert staleness_weight(0, 0.5, 2) == 1.0
    assert staleness_weight(2, 0.5, 2) == 0.25
    assert staleness_weight(3, 0.5, 2) == 0.0
    cfg = DilocoConfig(staleness_decay=0.5, max_staleness=1, max_rel_norm=10.0)
    agg = aggregate(
        [Contribution(t(1.0), 2), Contribution(t(4.0), 2, staleness=1), Contribution(t(9.0), 2, 2)],
        1.0,
        cfg,
    )
    # weights 2, 1, dropped: D = (2*1 + 1*4) / 3 = 2
    assert agg.weights == [2.0, 1.0, 0.0] and 2 in agg.rejected and "staleness" in agg.rejected[2]
    assert agg.delta is not None and math.isclose(float(agg.delta), 2.0, rel_tol=1e-6)
    assert agg.tokens == 4


def test_nan_and_huge_contributions_are_rejected() -> None:
    cfg = DilocoConfig(max_rel_norm=1.0, max_median_ratio=5.0)
    good = [
        Contribution(t(0.1, 0.0), 1),
        Contribution(t(0.0, 0.1), 1),
        Contribution(t(0.1, 0.1), 1),
    ]
    bad = [
        Contribution(t(float("nan"), 0.0), 1),
        Contribution(t(0.0, float("inf")), 1),
        Contribution(t(1e6, 0.0), 1),  # above max_rel_norm * ||theta_g||
        Contribution(t(0.9, 0.0), 1),  # under the absolute cap, but 9x the median
    ]
    agg = aggregate(good + bad, 1.0, cfg)
    assert set(agg.rejected) == {3, 4, 5, 6}
    assert "non-finite" in agg.rejected[3] and "median" in agg.rejected[6]
    assert agg.delta is not None and torch.allclose(agg.delta, t(0.2 / 3, 0.2 / 3))
    state = OuterState(theta_g=t(1.0, 0.0), m=t(0.0, 0.0))
    before = state.theta_g.clone()
    rep = outer_step(state, bad[:3], cfg)
    assert not rep.applied and rep.round == 0 and torch.equal(state.theta_g, before)


def test_centered_clipping_bounds_an_outliers_pull() -> None:
    xs = [t(0.0, 0.0), t(0.0, 0.0), t(100.0, 0.0)]
    mean, clipped = centered_clip(xs, [1.0, 1.0, 1.0], tau=1e9, iters=1)
    assert torch.allclose(mean, t(100.0 / 3, 0.0)) and clipped == 0  # the plain mean
    v, clipped = centered_clip(xs, [1.0, 1.0, 1.0], tau=0.1, iters=50)
    assert float(v[0]) < 1.0 and clipped == 1  # the mean would be 33.3
    cfg = DilocoConfig(clip_radius=0.1, clip_iters=50, max_rel_norm=1e3, max_median_ratio=1e9)
    agg = aggregate([Contribution(x, 1) for x in xs], 1.0, cfg)
    assert agg.delta is not None and float(agg.delta[0]) < 1.0


def test_clipping_that_scales_nothing_gives_the_plain_means_bits() -> None:
    """Contributions within the radius of each other are aggregated to the weighted mean's
    exact bits, as with robust aggregation off (clip_rel 0), so an honest round that
    clipping did not touch computes what the plain mean computes."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4096, generator=gen)
    contribs = [
        Contribution(delta=base + 0.1 * torch.randn(4096, generator=gen), tokens=k)
        for k in (100, 300, 700)
    ]
    robust = aggregate(contribs, 1e3, DilocoConfig())  # clip_rel 2 x the median norm
    plain = aggregate(contribs, 1e3, DilocoConfig(clip_rel=0.0))
    assert robust.clipped == 0 and robust.delta is not None and plain.delta is not None
    assert torch.equal(robust.delta, plain.delta)
    clipped = aggregate(contribs, 1e3, DilocoConfig(clip_radius=0.5))
    assert clipped.clipped > 0 and clipped.delta is not None
    assert not torch.equal(clipped.delta, plain.delta)


def test_same_inputs_give_bitwise_identical_states() -> None:
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=gen)
    deltas = [torch.randn(1000, generator=gen) * 1e-3 for _ in range(3)]
    a, b = OuterState.fresh(theta), OuterState.fresh(theta)
    cfg = DilocoConfig(target_tokens=900)
    for s in (a, b):
        outer_step(s, [Contribution(d.clone(), 100 * (i + 1)) for i, d in enumerate(deltas)], cfg)
    assert torch.equal(a.theta_g, b.theta_g) and torch.equal(a.m, b.m)


def test_merge_keeps_local_progress_since_the_snapshot() -> None:
    w1, w2 = torch.nn.Parameter(t(1.0, 2.0)), torch.nn.Parameter(t(3.0))
    snapshot = t(0.5, 1.5, 2.5)  # working copy when the round began
    new_g = t(10.0, 20.0, 30.0)
    merge_local_progress([w1, w2], snapshot, new_g)
    assert torch.allclose(w1.data, t(10.5, 20.5)) and torch.allclose(w2.data, t(30.5))
    with pytest.raises(ValueError, match="elements"):
        merge_local_progress([w1], snapshot, new_g)


def test_config_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="mu"):
        DilocoConfig(mu=1.0)
    with pytest.raises(ValueError, match="eta"):
        DilocoConfig(eta=0.0)


# ---- per-part aggregation (reduce-scatter) ---------------------------------------------


def test_part_bounds_cover_the_vector_in_order_and_shares_square_to_one() -> None:
    for numel, members in ((10, 3), (4096, 6), (7, 7), (3, 5), (1, 4), (64, 64)):
        bounds = part_bounds(numel, members)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert len(bounds) <= members and all(e - s >= min(2, numel) for s, e in bounds)
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
        assert math.isclose(sum(part_share(b, numel) ** 2 for b in bounds), 1.0)
    assert part_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert part_bounds(5, 4) == [(0, 3), (3, 5)]  # parts of at least 2 elements
    with pytest.raises(ValueError, match="members"):
        part_bounds(10, 0)


def test_a_single_part_aggregates_like_the_whole_vector() -> None:
    cfg = DilocoConfig(clip_radius=0.05)
    g = torch.Generator().manual_seed(3)
    cs = [
        Contribution(delta=torch.randn(50, generator=g) * 0.01, tokens=10 * (i + 1))
        for i in range(4)
    ]
    whole, one = aggregate(cs, 1.0, cfg), aggregate_part(cs, 1.0, 1.0, cfg)
    assert whole.delta is not None and one.delta is not None
    assert torch.equal(whole.delta, one.delta) and whole.weights == one.weights


def test_parts_of_a_mean_are_the_mean_of_the_parts() -> None:
    cfg = DilocoConfig(clip_rel=0.0)
    g = torch.Generator().manual_seed(4)
    cs = [Contribution(delta=torch.randn(30, generator=g) * 0.01, tokens=t) for t in (5, 10, 20)]
    whole = aggregate(cs, 1.0, cfg).delta
    assert whole is not None
    for s, e in part_bounds(30, 3):
        sub = [Contribution(delta=c.delta[s:e], tokens=c.tokens) for c in cs]
        part = aggregate_part(sub, 1.0, part_share((s, e), 30), cfg).delta
        assert part is not None and torch.allclose(part, whole[s:e], atol=1e-9)


def test_the_norm_bound_is_the_parts_share_of_the_reference_norm() -> None:
    """A contribution whose norm is concentrated in one part passes the whole vector's
    bound but not that part's: the bound scales with sqrt(part / whole)."""
    cfg = DilocoConfig(max_rel_norm=1.0)
    honest = Contribution(delta=torch.full((4,), 0.01), tokens=10)
    # norm 0.8 < ref 1.0 over the vector, all of it in a part of a quarter of the vector
    spike = Contribution(delta=t(0.8, 0.0, 0.0, 0.0), tokens=10)
    assert aggregate([honest, spike], 1.0, cfg).rejected == {}
    share = part_share((0, 4), 16)  # a part of 4 of 16 elements: share 0.5, bound 0.5
    agg = aggregate_part([honest, spike], 1.0, share, cfg)
    assert set(agg.rejected) == {1} and "max_rel_norm" in agg.rejected[1]
    assert agg.weights == [10.0, 0.0] and agg.tokens == 10
    assert agg.delta is not None and torch.equal(agg.delta, honest.delta)


def test_the_median_check_runs_per_part() -> None:
    cfg = DilocoConfig(max_median_ratio=5.0)
    small = [Contribution(delta=torch.full((3,), 1e-3 * (i + 1)), tokens=1) for i in range(3)]
    big = Contribution(delta=torch.full((3,), 0.05), tokens=1)  # 50x the others' norm
    agg = aggregate_part([*small, big], 10.0, 0.5, cfg)
    assert set(agg.rejected) == {3} and "median" in agg.rejected[3]
    assert agg.tokens == 3


def test_centered_clipping_radius_scales_with_the_part() -> None:
    """Clipping a part uses tau * share: an outlier's pull on a part is bounded by its
    share of the whole vector's radius."""
    cfg = DilocoConfig(clip_radius=0.4, clip_iters=1, max_median_ratio=1e9)
    honest = [Contribution(delta=torch.full((4,), 1e-3), tokens=1) for _ in range(3)]
    outlier = Contribution(delta=torch.full((4,), 1.0), tokens=1)
    share = 0.25
    agg = aggregate_part([*honest, outlier], 100.0, share, cfg)
    assert agg.delta is not None
    pull = float(torch.linalg.vector_norm(agg.delta - honest[0].delta))
    assert math.isclose(pull, 0.4 * share / 4, rel_tol=1e-5)  # tau * share * w / sum w
    with pytest.raises(ValueError, match="share"):
        aggregate_part(honest, 1.0, 0.0, cfg)


def test_relative_clipping_is_on_by_default_from_three_contributions() -> None:
    """By default a group of three or more is aggregated by centered clipping at
    `clip_rel` x the median norm: honest contributions give their weighted mean (up to
    rounding), and a member that claims twice the tokens (40 % of the weight) and sends
    15x the honest norm in the opposite direction (inside the median check's 20x) moves
    the result by at most `clip_iters * tau * w / sum w` beyond the honest spread, less
    than half of what the plain mean lets it (which turns the step around). (A member holding half the weight or more
    can be the weighted medoid the clipping starts from: clipping protects a minority of
    weight only.)"""
    cfg = DilocoConfig()
    assert cfg.clip_rel == 2.0 and cfg.clip_radius == 0.0
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, generator=g) * 0.01
    honest = [
        Contribution(delta=base + torch.randn(64, generator=g) * 0.003, tokens=100)
        for _ in range(3)
    ]
    mean = aggregate(honest, 10.0, DilocoConfig(clip_rel=0.0)).delta
    clipped = aggregate(honest, 10.0, cfg).delta
    assert mean is not None and clipped is not None
    assert torch.allclose(clipped, mean, atol=1e-8)

    attacker = Contribution(delta=-15.0 * base, tokens=200)
    plain = aggregate([*honest, attacker], 10.0, DilocoConfig(clip_rel=0.0))
    robust = aggregate([*honest, attacker], 10.0, cfg)
    assert plain.rejected == robust.rejected == {}
    assert plain.delta is not None and robust.delta is not None
    norms = sorted(float(torch.linalg.vector_norm(c.delta)) for c in [*honest, attacker])
    tau = 2.0 * norms[1]  # the lower median of four
    spread = max(float(torch.linalg.vector_norm(c.delta - mean)) for c in honest)
    bound = spread + cfg.clip_iters * tau * 200 / 500
    robust_pull = float(torch.linalg.vector_norm(robust.delta - mean))
    plain_pull = float(torch.linalg.vector_norm(plain.delta - mean))
    assert robust_pull <= bound, (robust_pull, bound)
    assert plain_pull > 2 * robust_pull, (plain_pull, robust_pull)
    assert float(torch.dot(plain.delta, base)) < 0  # the plain mean turned the step around


def test_two_contributions_are_averaged_without_clipping_by_default() -> None:
    g = torch.Generator().manual_seed(8)
    cs = [Contribution(delta=torch.randn(16, generator=g) * 0.01, tokens=t) for t in (3, 5)]
    a = aggregate(cs, 1.0, DilocoConfig()).delta
    b = aggregate(cs, 1.0, DilocoConfig(clip_rel=0.0)).delta
    assert a is not None and b is not None and torch.equal(a, b)


def _pair(seed: int, n: int = 10_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Two honest-like deltas: a shared descent plus each one's own part (cosine ~0.5)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(n, generator=g) * 0.01
    return common + torch.randn(n, generator=g) * 0.01, common + torch.randn(n, generator=g) * 0.01


def test_the_pair_bound_rejects_what_points_against_or_across_the_reducers_own() -> None:
    cfg = DilocoConfig()
    ours, theirs = _pair(1)
    mine = Contribution(delta=ours, tokens=100)
    assert pair_problem(mine, Contribution(delta=theirs, tokens=100), cfg) is None
    noise = torch.randn(ours.numel(), generator=torch.Generator().manual_seed(2))
    noise *= torch.linalg.vector_norm(theirs) / torch.linalg.vector_norm(noise)
    cases = [(-theirs, "cosine", True), (noise, "cosine", False), (theirs * 100, "norm", True)]
    for bad, what, reported in cases:
        found = pair_problem(mine, Contribution(delta=bad, tokens=100), cfg)
        assert found is not None and found[0].startswith(f"pair: {what}"), found
        assert found[1] == reported, found  # noise is rejected, not reported
    # a groupmate that trained 3 x the tokens may be up to 3 x 4 x longer
    longer = Contribution(delta=theirs * 10, tokens=300)
    assert pair_problem(mine, longer, cfg) is None
    assert pair_problem(mine, Contribution(delta=theirs * 10, tokens=100), cfg) is not None
    off = DilocoConfig(pair_max_ratio=0.0, pair_cos_sigmas=0.0)
    assert pair_problem(mine, Contribution(delta=-theirs * 100, tokens=100), off) is None


def test_the_pair_bound_applies_to_two_usable_contributions_with_the_reducers_own() -> None:
    ours, theirs = _pair(3)
    cs = [Contribution(delta=ours, tokens=100), Contribution(delta=-theirs, tokens=100)]
    agg = aggregate_part(cs, 10.0, 1.0, DilocoConfig(), own=0)
    assert agg.weights == [100.0, 0.0] and agg.suspect == {1}
    assert agg.rejected[1].startswith("pair: cosine") and agg.delta is not None
    assert torch.allclose(agg.delta, ours)
    # the reducer's own is rejected (no tokens): nothing to bound against
    stale = [Contribution(delta=ours, tokens=0), Contribution(delta=-theirs, tokens=100)]
    assert aggregate_part(stale, 10.0, 1.0, DilocoConfig(), own=0).weights == [0.0, 100.0]
    # the reducer's own part did not move (it trained nothing since its round began, as
    # at the end of a drain): nothing to judge by, so the other counts as in the plain mean
    still = [Contribution(delta=torch.zeros_like(ours), tokens=100), cs[1]]
    agg = aggregate_part(still, 10.0, 1.0, DilocoConfig(), own=0)
    off = aggregate_part(still, 10.0, 1.0, DilocoConfig(pair_max_ratio=0.0, pair_cos_sigmas=0.0))
    assert agg.weights == [100.0, 100.0] and not agg.rejected and agg.delta is not None
    assert off.delta is not None and torch.equal(agg.delta, off.delta)
    # no reducer (a lone step, the all-gather scheme): no pair bound
    assert aggregate_part(cs, 10.0, 1.0, DilocoConfig()).weights == [100.0, 100.0]
    # three contributions: the majority's direction rule instead, with or without a reducer
    third = Contribution(delta=ours.clone(), tokens=100)
    for own in (0, None):
        agg = aggregate_part([*cs, third], 10.0, 1.0, DilocoConfig(), own=own)
        assert list(agg.rejected) == [1] and agg.rejected[1].startswith("direction")
        assert agg.suspect == {1}


def test_an_honest_pair_of_the_bench_model_points_alike() -> None:
    """The floor is sigmas / sqrt(n): on a real part of the tiny model's stage (about
    10^5 elements) about 0.013, far below the cosines measured between two replicas'
    pseudo-gradients in `agora bench outer-sweep` runs (0.19-0.93, docs/outer-averaging.md),
    and far above what noise reaches (one standard deviation is 1 / sqrt(n))."""
    cfg = DilocoConfig()
    n = 100_000
    assert cfg.pair_cos_sigmas / math.sqrt(n) < 0.02


def _honest(m: int, n: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    """m honest-like deltas: one shared descent plus each one's own part (cosine ~0.5)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(n, generator=g)
    return [common + torch.randn(n, generator=g) for _ in range(m)]


@pytest.mark.parametrize("members", [3, 4, 5, 6])
def test_in_groups_of_three_or_more_what_points_against_or_across_the_majority_is_rejected(
    members: int,
) -> None:
    """The largest minority a group can hold, (m - 1) // 2 liars, one sign-flipping an
    honest delta and the rest sending noise of honest norm, is rejected; no honest one is;
    only the sign flip (opposed to every honest member) is reported."""
    liars = (members - 1) // 2
    honest = _honest(members - liars)
    bad = [-honest[0]]
    g = torch.Generator().manual_seed(7)
    for _ in range(liars - 1):
        noise = torch.randn(honest[0].numel(), generator=g)
        bad.append(noise * (torch.linalg.vector_norm(honest[0]) / torch.linalg.vector_norm(noise)))
    contribs = [Contribution(delta=d, tokens=100) for d in [*honest, *bad]]
    agg = aggregate_part(contribs, 1e6, 1.0, DilocoConfig())
    liar_ids = set(range(members - liars, members))
    assert set(agg.rejected) == liar_ids, agg.rejected
    assert all(agg.rejected[i].startswith("direction") for i in liar_ids)
    # a member whose contribution a reducer rejected so cannot re-check it alone
    assert all(needs_others(agg.rejected[i]) for i in liar_ids)
    assert agg.suspect == {members - liars}
    # turned off with the pair bound's direction setting (`--outer-robust off`)
    assert aggregate_part(contribs, 1e6, 1.0, DilocoConfig(pair_cos_sigmas=0.0)).rejected == {}


@settings(max_examples=200, deadline=None)
@given(
    members=st.integers(3, 7),
    seed=st.integers(0, 2**16),
    liars=st.lists(
        st.tuples(st.sampled_from(["flip", "noise", "scaled", "zero", "copy"]), st.floats(-5, 5)),
        max_size=3,
    ),
)
def test_a_lying_minority_never_gets_an_honest_contribution_rejected_by_direction(
    members: int, seed: int, liars: list[tuple[str, float]]
) -> None:
    """Whatever fewer than half the candidates send (flipped, noise, scaled or copied
    honest deltas, zeros), every honest one agrees with every other honest one, and so
    with enough of the group to be kept."""
    f = min(len(liars), (members - 1) // 2)
    honest = _honest(members - f, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    bad = []
    for kind, k in liars[:f]:
        base = honest[0]
        bad.append(
            {
                "flip": -base,
                "noise": torch.randn(base.numel(), generator=g),
                "scaled": base * k,
                "zero": torch.zeros_like(base),
                "copy": base.clone(),
            }[kind]
        )
    found = direction_problems([*honest, *bad], list(range(members)), 4.0)
    assert not set(found) & set(range(len(honest))), found
