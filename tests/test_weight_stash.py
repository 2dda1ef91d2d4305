"""Weight stashing: a micro-batch that is downstream while an inner step runs finishes
its backward at the weights its forward used, without running the forward again."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from node.model import preset
from node.stage_compute import InnerConfig, StageCompute
from protocol.memory import NodeSettings, stage_need
from protocol.tensors import EncodedTensor

SEQ = 32


def _inner(**kw: object) -> InnerConfig:
    return InnerConfig(lr=1e-2, warmup_steps=1, weight_decay=0.0, inner_batch_tokens=10**9,
                       cache_size=8, **kw)  # type: ignore[arg-type]  # fmt: skip


class Chain:
    """Stages 0..k+1 of a k+2-stage model: `s` (stage k) under test, the last one to
    turn its output into a gradient, stage 0 in front of a middle stage."""

    def __init__(self, k: int, **kw: object) -> None:
        torch.manual_seed(0)
        n = k + 2
        self.stages = [StageCompute(preset("tiny"), i, n, "fp16", _inner(**kw)) for i in range(n)]
        self.s, self.last = self.stages[k], self.stages[-1]

    def hidden(self, mb: str, rows: np.ndarray) -> EncodedTensor | None:
        """The input of `s` for `rows` (None on stage 0)."""
        if self.s is self.stages[0]:
            return None
        return self.stages[0].forward(mb, rows, None)  # type: ignore[return-value]

    def grad(self, mb: str, rows: np.ndarray, out: EncodedTensor) -> EncodedTensor:
        g, _ = self.last.forward(mb, rows, out)  # type: ignore[misc]
        return g  # type: ignore[no-any-return]

    def train_one(self, mb: str, rows: np.ndarray) -> None:
        """One micro-batch through `s` and back, then an inner step of `s`."""
        hidden = self.hidden(mb, rows)
        out = self.s.forward(mb, rows, hidden)
        self.s.backward(mb, rows, hidden, self.grad(mb, rows, out))  # type: ignore[arg-type]
        self.s.step()


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(2, SEQ + 1), dtype=np.uint8)


def _grads(s: StageCompute) -> list[torch.Tensor]:
    return [p.grad.clone() for p in s.parameters() if p.grad is not None]


@pytest.mark.parametrize("stage", [0, 1])
def test_a_micro_batch_downstream_during_a_step_gets_the_gradient_of_its_own_weights(
    stage: int,
) -> None:
    c, ref = Chain(stage), Chain(stage)  # ref: the same weights, and no inner step
    rows = _rows(1)
    hidden = c.hidden("m", rows)
    out = c.s.forward("m", rows, hidden)
    ref.s.forward("m", rows, ref.hidden("m", rows))
    before = ref.s
    c.train_one("other", _rows(2))  # an inner step runs while "m" is downstream
    assert c.s.inner_steps == 1
    grad = c.grad("m", rows, out)  # type: ignore[arg-type]
    for s in (c.s, before):
        for p in s.parameters():
            p.grad = None
        s.backward("m", rows, hidden, grad)
    assert c.s.recomputes == 0 and before.recomputes == 0
    want, got = _grads(before), _grads(c.s)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    # the weights did move: a recompute at them would have given another gradient
    assert any(
        not torch.equal(a, b) for a, b in zip(c.s.parameters(), before.parameters(), strict=True)
    )


def test_only_the_last_stash_is_kept_and_an_outer_merge_is_recomputed() -> None:
    c = Chain(0)
    s0, rows = c.s, _rows(3)
    out = s0.forward("two-steps-ago", rows, None)
    c.train_one("a", _rows(4))
    out2 = s0.forward("one-step-ago", rows, None)
    c.train_one("b", _rows(5))
    assert "two-steps-ago" not in s0._cache  # let go at the second step
    s0.backward("two-steps-ago", rows, None, c.grad("x", rows, out))  # type: ignore[arg-type]
    assert s0.recomputes == 1
    s0.backward("one-step-ago", rows, None, c.grad("y", rows, out2))  # type: ignore[arg-type]
    assert s0.recomputes == 1  # stashed
    out3 = s0.forward("before-merge", rows, None)
    with torch.no_grad():
        for p in s0.parameters():
            p.mul_(0.5)  # an outer merge changes the weights in place
    s0.weights_changed()
    s0.backward("before-merge", rows, None, c.grad("z", rows, out3))  # type: ignore[arg-type]
    assert s0.recomputes == 2


def test_the_copies_live_only_as_long_as_the_graphs_that_need_them() -> None:
    c = Chain(0)
    s0, rows = c.s, _rows(6)
    out = s0.forward("m", rows, None)
    c.train_one("other", _rows(7))
    blocks = sum(p.numel() * 4 for n, p in s0.model.named_parameters() if n.startswith("blocks."))
    assert s0.stash.copied_bytes == blocks  # one copy of what the graph saved: no embedding
    live = [weakref.ref(s.tensor) for s in s0.stash._live]
    assert live and all(r() is not None for r in live)
    s0.backward("m", rows, None, c.grad("m", rows, out))  # type: ignore[arg-type]
    gc.collect()
    assert all(r() is None for r in live)


def _activations() -> int:
    """Plain tensors alive in this process (not parameters): saved activations among them."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor)


def test_a_graph_let_go_without_its_backward_frees_its_activations() -> None:
    """An outer merge makes stage 0's cached graphs stale: their backwards recompute, and
    the stale graphs are dropped without ever running backward. They must be freed then;
    a saved tensor held through the stash's hooks may not keep its own graph alive (a
    reference cycle through autograd that Python's collector does not see), which grew a
    stage-0 node by about 0.65 KB per trained token with outer rounds on."""
    c = Chain(0)
    s0 = c.s
    s0.forward("warm", _rows(8), None)
    s0.drop("warm")
    base = _activations()
    for i in range(6):
        rows = _rows(10 + i)
        out = s0.forward(f"m{i}", rows, None)
        with torch.no_grad():
            for p in s0.parameters():
                p.mul_(0.999)  # an outer merge, in place
        s0.weights_changed()
        s0.backward(f"m{i}", rows, None, c.grad(f"m{i}", rows, out))  # type: ignore[arg-type]
        del out
    assert s0.recomputes == 6
    assert _activations() <= base, (base, _activations())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stash_copies_what_the_memory_estimate_counts(precision: str) -> None:
    """fp32: the blocks' weights; bf16: only their norm weights (the graphs keep the
    matrices' bf16 casts, which the step does not touch)."""
    c = Chain(0, precision=precision)
    c.s.forward("m", _rows(8), None)
    c.train_one("other", _rows(9))
    need = stage_need(preset("tiny"), 0, 2, NodeSettings(precision=precision))
    assert c.s.stash.copied_bytes == need.stash > 0
