"""The sparse pseudo-gradient codec of the outer-sweep simulation: top-k per chunk, a few
bits a value, and error feedback that loses nothing over rounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.outer_sparse import CHUNK, ErrorFeedback, chunk_k, topk_quantize, wire_bytes


def test_it_keeps_the_largest_of_each_chunk_on_a_grid() -> None:
    x = torch.zeros(2 * CHUNK)
    x[[5, 9, CHUNK + 1]] = torch.tensor([4.0, -1.0, 0.5])
    out = topk_quantize(x, frac=1 / CHUNK, bits=2)  # one value a chunk
    assert out.nonzero().flatten().tolist() == [5, CHUNK + 1]
    assert out[5] == 4.0 and out[CHUNK + 1] == 0.5  # the chunk's max sits on the grid
    two = topk_quantize(x, frac=2 / CHUNK, bits=2)  # levels -m, -m/3, m/3, m
    assert two[9].item() == pytest.approx(-4.0 / 3)


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 3 * CHUNK),
    frac=st.floats(0.001, 1.0),
    bits=st.integers(1, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_decoded_tensor_is_sparse_finite_and_bounded(
    n: int, frac: float, bits: int, seed: int
) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10
    out = topk_quantize(x, frac, bits)
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
    chunks = -(-n // CHUNK)
    assert int((out != 0).sum()) <= chunks * chunk_k(frac)
    assert float(out.abs().max()) <= float(x.abs().max()) * (1 + 1e-6)


def test_error_feedback_sends_everything_eventually() -> None:
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(CHUNK, generator=g)
    ef = ErrorFeedback(frac=0.01, bits=2)
    sent = sum(
        (ef.encode(delta if r == 0 else torch.zeros(CHUNK)) for r in range(400)), torch.zeros(CHUNK)
    )
    assert ef.residual is not None
    torch.testing.assert_close(sent + ef.residual, delta)  # nothing lost, ever
    assert float(ef.residual.norm()) < 0.05 * float(delta.norm())  # and it went out


def test_one_percent_at_two_bits_is_far_below_fp16() -> None:
    n = 1_000_000
    assert wire_bytes(n, 0.01, 2) * 80 < 2 * n  # fp16: 2 bytes a value
    with pytest.raises(ValueError, match="frac"):
        topk_quantize(torch.ones(4), 0.0, 2)
