"""The inner optimizer step, one function for a stage replica and the central trainer.

The centralised baseline every swarm claim is measured against must take exactly the
swarm's step, so both call this: project the gradients of the residual writes and the
embedding onto span(U) (what a compressed boundary carries), clip their global norm,
step at the given learning rate, clear the gradients, and project the weights back
onto span(U). A step whose gradient norm is not finite is skipped, with the gradients
cleared: one NaN or Inf would otherwise leave the weights and AdamW's state NaN for good.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from node.model import Stage
from node.subspace import project_, project_grads_


def inner_step(
    stages: Sequence[Stage], opt: torch.optim.Optimizer, *, lr: float, grad_clip: float
) -> bool:
    """One step from the accumulated gradients of `stages` (`grad_clip` 0 = no clipping);
    False when it was skipped for a non-finite gradient norm."""
    for stage in stages:
        project_grads_(stage)
    params = [p for s in stages for p in s.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    if not bool(torch.isfinite(norm)):
        opt.zero_grad(set_to_none=True)
        return False
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    for stage in stages:
        project_(stage)
    return True
