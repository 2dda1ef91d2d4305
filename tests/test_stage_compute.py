"""The activation cache of a stage: bounded in entries and in tokens, so a sender's
oversized blocks evict (and are recomputed at backward) instead of filling memory."""

from __future__ import annotations

import numpy as np

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
