"""The subspace parametrisation: the residual stream stays E0[tokens] + U c at every
boundary, and compressed boundaries reproduce the uncompressed gradients."""

from __future__ import annotations

import pytest
import torch

from node.compression import BoundaryCodec, through_boundary
from node.model import ModelConfig, Stage, build_stage, param_groups
from node.subspace import Subspace, make_subspace, project_, project_grads_

CFG = ModelConfig(
    d_model=48, n_layers=4, n_heads=4, d_ff=64, max_seq_len=32, subspace_rank=6, seed=11
)


def _off_subspace(h: torch.Tensor, tokens: torch.Tensor, sub: Subspace) -> float:
    """Largest component of h - E0[tokens] outside span(U), relative to its norm."""
    r = h - sub.e0[tokens]
    outside = r - (r @ sub.basis) @ sub.basis.T
    return float(outside.abs().max() / r.abs().max())


def _train(stages: list[Stage], steps: int, project: bool) -> None:
    params = [g for s in stages for g in param_groups(s, 0.1)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 16), generator=gen)
        h = x
        for s in stages[:-1]:
            h = s(h)
        loss = stages[-1](h, torch.roll(x, -1, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if project:
            for s in stages:
                project_(s)


def _boundaries(stages: list[Stage], x: torch.Tensor) -> list[torch.Tensor]:
    out, h = [], x
    for s in stages[:-1]:
        h = s(h)
        out.append(h)
    return out


def test_basis_and_embedding_are_deterministic_and_orthonormal() -> None:
    a, b = make_subspace(5, 64, 8), make_subspace(5, 64, 8)
    assert torch.equal(a.basis, b.basis) and torch.equal(a.e0, b.e0)
    torch.testing.assert_close(a.basis.T @ a.basis, torch.eye(8), atol=1e-5, rtol=0)
    c = make_subspace(6, 64, 8)
    assert not torch.allclose(a.basis, c.basis) and not torch.allclose(a.e0, c.e0)
    assert a.e0.shape == (256, 64)
    with pytest.raises(ValueError, match="rank"):
        make_subspace(0, 8, 9)


def test_residual_stream_is_e0_plus_u_c_at_every_boundary_after_training() -> None:
    stages = [build_stage(CFG, s, 4) for s in range(4)]
    _train(stages, steps=5, project=True)
    x = torch.randint(0, 256, (2, 16))
    sub = stages[1].subspace
    assert sub is not None
    with torch.no_grad():
        for h in _boundaries(stages, x):
            assert _off_subspace(h, x, sub) < 1e-5
            c = sub.coefficients(h, x)
            torch.testing.assert_close(sub.reconstruct(c, x), h, atol=1e-5, rtol=1e-5)


def test_without_projection_the_stream_leaves_the_subspace() -> None:
    # The invariant is the projection's doing: skip it and the check above would fail.
    stages = [build_stage(CFG, s, 2) for s in range(2)]
    _train(stages, steps=3, project=False)
    x = torch.randint(0, 256, (2, 16))
    sub = stages[0].subspace
    assert sub is not None
    with torch.no_grad():
        assert _off_subspace(_boundaries(stages, x)[0], x, sub) > 1e-2


def _grads(stages: list[Stage], x: torch.Tensor, y: torch.Tensor, codec: str | None):  # type: ignore[no-untyped-def]
    for s in stages:
        s.zero_grad(set_to_none=True)
    h = x
    for i, s in enumerate(stages[:-1]):
        h = s(h)
        if codec is not None:
            nxt = stages[i + 1].subspace
            h = through_boundary(h, x, BoundaryCodec(codec, CFG.d_model, nxt))
    loss = stages[-1](h, y)
    loss.backward()
    for s in stages:
        project_grads_(s)
    grads = {
        k: p.grad.clone() for s in stages for k, p in s.named_parameters() if p.grad is not None
    }
    return float(loss.detach()), grads


def test_compressed_boundaries_reproduce_uncompressed_gradients() -> None:
    stages = [build_stage(CFG, s, 4) for s in range(4)]
    _train(stages, steps=3, project=True)
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (3, 16), generator=gen)
    y = torch.randint(0, 256, (3, 16), generator=gen)
    loss_ref, ref = _grads(stages, x, y, None)
    loss_sub, sub = _grads(stages, x, y, "subspace")
    assert abs(loss_sub - loss_ref) < 1e-5
    assert set(sub) == set(ref)
    for k in ref:
        torch.testing.assert_close(sub[k], ref[k], rtol=1e-3, atol=1e-6, msg=k)
    # 8-bit coefficients: same gradients up to quantisation noise (well under 5%).
    loss_q, quant = _grads(stages, x, y, "subspace_int8")
    assert abs(loss_q - loss_ref) / loss_ref < 1e-3
    for k in ref:
        rel = float((quant[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12))
        assert rel < 0.05, (k, rel)


def test_subspace_codec_needs_a_subspace_model() -> None:
    with pytest.raises(ValueError, match="subspace_rank"):
        BoundaryCodec("subspace_int8", 48, None)
