"""The inner optimizer step, one function for a stage replica and the central trainer.

The centralised baseline every swarm claim is measured against must take exactly the
swarm's step, so both call this: project the gradients of the residual writes and the
embedding onto span(U) (what a compressed boundary carries), clip their global norm,
step at the given learning rate, clear the gradients, and project the weights back
onto span(U).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from node.model import Stage
from node.subspace import project_, project_grads_


def inner_step(
    stages: Sequence[Stage], opt: torch.optim.Optimizer, *, lr: float, grad_clip: float
) -> None:
    """One step from the accumulated gradients of `stages` (`grad_clip` 0 = no clipping)."""
    for stage in stages:
        project_grads_(stage)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for s in stages for p in s.parameters()], grad_clip)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    for stage in stages:
        project_(stage)
