"""The one inner step: the swarm's stages and the central trainer take the same step, and
a step whose gradient is not finite is skipped with the weights and AdamW state intact."""

from __future__ import annotations

import numpy as np
import torch

from node.baseline import ChainedStages, train_step
from node.inner_step import inner_step
from node.model import build_stage, param_groups, preset
from node.stage_compute import InnerConfig, StageCompute

CFG = preset("tiny")


def test_a_non_finite_gradient_skips_the_step() -> None:
    stage = build_stage(CFG, 0, 2)
    opt = torch.optim.AdamW(param_groups(stage, 0.1), lr=1e-2)
    before = [p.detach().clone() for p in stage.parameters()]
    for p in stage.parameters():
        p.grad = torch.ones_like(p)
    next(stage.parameters()).grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
    assert not inner_step([stage], opt, lr=1e-2, grad_clip=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, stage.parameters(), strict=True))
    assert all(p.grad is None for p in stage.parameters()) and not opt.state


def test_stage_compute_counts_a_skipped_step_and_trains_on() -> None:
    inner = InnerConfig(lr=1e-2, warmup_steps=1, weight_decay=0.0, inner_batch_tokens=10**9,
                        cache_size=4)  # fmt: skip
    compute = StageCompute(CFG, 0, 1, "subspace_int4", inner)  # one stage: the whole model
    rows = np.random.default_rng(0).integers(0, 256, size=(2, 17), dtype=np.uint8)
    compute.forward("a", rows, None)
    next(compute.model.parameters()).grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
    compute.step()
    assert compute.skipped_steps == 1 and compute.inner_steps == 0
    compute.forward("b", rows, None)
    compute.step()
    assert compute.inner_steps == 1
    assert all(bool(torch.isfinite(p).all()) for p in compute.parameters())


def test_the_central_trainer_takes_the_same_step_as_a_stage() -> None:
    torch.manual_seed(0)
    rows = torch.randint(0, 256, (2, 17))
    whole = ChainedStages(CFG, 1, None)
    opt = torch.optim.AdamW(param_groups(whole, 0.1), lr=1e-2)
    inner = InnerConfig(lr=1e-2, warmup_steps=1, weight_decay=0.1, inner_batch_tokens=1,
                        cache_size=4)  # fmt: skip
    compute = StageCompute(CFG, 0, 1, "subspace_int4", inner)
    compute.model.load_state_dict(whole.stage_list()[0].state_dict())
    train_step(whole, opt, (rows[:, :-1], rows[:, 1:]), 1e-2, 1.0)
    compute.forward("a", rows.numpy().astype(np.uint8), None)  # steps at once (1 token)
    # AdamW's first step moves every weight by about lr (1e-2), so a different step rule
    # shows at that scale; float noise in near-zero gradients stays far below it.
    for a, b in zip(whole.parameters(), compute.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=0)
