"""The activation cache of a stage: bounded in entries and in tokens, so a sender's
oversized blocks evict (and are recomputed at backward) instead of filling memory."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from node.model import preset
from node.stage_compute import InnerConfig, StageCompute

SEQ = 32


def test_the_cache_holds_a_token_budget_and_an_evicted_entry_is_recomputed() -> None:
    inner = InnerConfig(lr=1e-3, warmup_steps=1, weight_decay=0.0, inner_batch_tokens=10**9,
                        cache_size=8, cache_tokens=4 * SEQ)  # fmt: skip
    s0 = StageCompute(preset("tiny"), 0, 2, "subspace_int4", inner)
    s1 = StageCompute(preset("tiny"), 1, 2, "subspace_int4", inner)
    rng = np.random.default_rng(0)
    small = [rng.integers(0, 256, size=(2, SEQ + 1), dtype=np.uint8) for _ in range(2)]
    big = rng.integers(0, 256, size=(64, SEQ + 1), dtype=np.uint8)  # 64 x 32 tokens
    hidden = [s0.forward(f"m{i}", rows, None) for i, rows in enumerate(small)]
    assert list(s0._cache) == ["m0", "m1"]  # 2 x 64 tokens: within the budget
    s0.forward("big", big, None)
    assert list(s0._cache) == []  # the big block evicted everything, itself included
    grad, _ = s1.forward("m0", small[0], hidden[0])  # type: ignore[misc]
    assert s0.backward("m0", small[0], None, grad) is None  # stage 0 returns no gradient
    assert s0.recomputes == 1


def test_a_recompute_lets_the_stale_graph_go_before_it_builds_a_new_one() -> None:
    """The micro-batch's old activations are freed before its recompute runs: a stage
    holds at most its in-flight micro-batches' activations, never one more."""
    s0, s1 = _pair()
    rows = np.random.default_rng(1).integers(0, 256, size=(2, SEQ + 1), dtype=np.uint8)
    hidden = s0.forward("m", rows, None)
    stale = weakref.ref(s0._cache["m"][1])  # the forward's output: its graph's root
    s0.weights_changed()  # an inner step ran while the micro-batch was downstream
    seen: list[bool] = []
    hook = s0.model.register_forward_pre_hook(lambda *_: seen.append(stale() is None))
    grad, _ = s1.forward("m", rows, hidden)  # type: ignore[misc]
    s0.backward("m", rows, None, grad)
    hook.remove()
    assert s0.recomputes == 1 and seen == [True]


def _pair(**kw: object) -> tuple[StageCompute, StageCompute]:
    inner = InnerConfig(lr=1e-3, warmup_steps=1, weight_decay=0.0, inner_batch_tokens=10**9,
                        cache_size=8, **kw)  # type: ignore[arg-type]  # fmt: skip
    return (
        StageCompute(preset("tiny"), 0, 2, "fp16", inner),
        StageCompute(preset("tiny"), 1, 2, "fp16", inner),
    )


def _grads(s: StageCompute) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in s.parameters() if p.grad is not None])


def test_bf16_autocast_trains_with_fp32_weights_gradients_and_optimizer_state() -> None:
    rows = np.random.default_rng(3).integers(0, 256, size=(4, SEQ + 1), dtype=np.uint8)
    losses = {}
    for precision in ("fp32", "bf16"):
        s0, s1 = _pair(precision=precision)
        grad, losses[precision] = s1.forward("m", rows, s0.forward("m", rows, None))  # type: ignore[arg-type, misc]
        s0.backward("m", rows, None, grad)
        for s in (s0, s1):
            s.step()
            assert all(p.dtype == torch.float32 for p in s.parameters())
            state = [t for st in s.opt.state.values() for t in st.values() if t.dim() > 0]
            assert state and all(t.dtype == torch.float32 for t in state)
    # the same batch from the same weights: bf16 matmuls move the loss a little
    assert abs(losses["bf16"] - losses["fp32"]) < 0.02 * losses["fp32"], losses


def test_recompute_keeps_the_gradients_and_saves_far_fewer_activations() -> None:
    rows = np.random.default_rng(4).integers(0, 256, size=(4, SEQ + 1), dtype=np.uint8)
    saved: dict[bool, int] = {}
    grads: dict[bool, torch.Tensor] = {}
    for recompute in (False, True):
        s0, s1 = _pair(recompute=recompute)
        hidden = s0.forward("m", rows, None)
        saved[recompute] = s0.stash.saved_bytes  # what the graph keeps besides weights
        grad, _ = s1.forward("m", rows, hidden)  # type: ignore[arg-type, misc]
        s0.backward("m", rows, None, grad)
        grads[recompute] = _grads(s0)
    torch.testing.assert_close(grads[True], grads[False])
    assert saved[True] * 3 < saved[False], saved  # only each block's input is kept
