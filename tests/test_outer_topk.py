"""The outer process's sparse pseudo-gradients: top-k per chunk with error feedback that
keeps what a group did not get, and the nonzeros wire format, whose decoder takes any
bytes and returns either the vector they encode or a ValueError."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.outer.sparse import (
    CHUNK,
    SPARSE,
    WIRE_BLOCK,
    ErrorFeedback,
    chunk_k,
    decode_nonzeros,
    encode_nonzeros,
    max_encoded_bytes,
    select_topk,
)


def test_it_keeps_the_largest_magnitudes_of_each_chunk_at_fp16() -> None:
    x = torch.zeros(2 * CHUNK + 7)
    x[[5, 9, 11, CHUNK + 1, 2 * CHUNK + 3]] = torch.tensor([4.0, -7.0, 0.5, 1e-3, 1.0 / 3])
    out = select_topk(x, frac=2 / CHUNK)  # two a chunk
    assert out.nonzero().flatten().tolist() == [5, 9, CHUNK + 1, 2 * CHUNK + 3]
    assert out[9] == -7.0 and out[5] == 4.0
    assert out[2 * CHUNK + 3] == torch.tensor(1.0 / 3).half().float()  # rounded to fp16


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3 * CHUNK), name=st.sampled_from(sorted(SPARSE)), seed=st.integers(0, 99))
def test_each_chunk_sends_k_values_and_feedback_loses_nothing(n: int, name: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ef = ErrorFeedback(SPARSE[name])
    total_in, total_sent = torch.zeros(n), torch.zeros(n)
    for used in (True, True, False, True):
        delta = torch.randn(n, generator=g)
        sent = ef.select(delta)
        full_chunks = n // CHUNK
        if full_chunks:
            per_chunk = (sent[: full_chunks * CHUNK].view(-1, CHUNK) != 0).sum(dim=1)
            assert bool((per_chunk <= chunk_k(SPARSE[name])).all())
        ef.settle(used)
        if used:  # a group took it: what was not sent waits in the residual
            total_in += delta
            total_sent += sent
    assert ef.residual is not None
    assert torch.allclose(total_sent + ef.residual, total_in, atol=1e-5)


def test_an_unused_round_leaves_the_residual_and_reset_clears_it() -> None:
    ef = ErrorFeedback(0.01)
    ef.select(torch.ones(CHUNK))
    ef.settle(used=False)
    assert ef.residual is None  # a lone step applied the whole delta itself
    x = torch.zeros(CHUNK)
    x[:100] = torch.arange(1.0, 101.0)  # exact at fp16
    ef.select(x)
    ef.settle(used=True)
    assert ef.residual is not None
    assert ef.residual.nonzero().flatten().tolist() == list(range(100 - chunk_k(0.01)))
    ef.reset()
    assert ef.residual is None


@st.composite
def sparse_vectors(draw: st.DrawFn) -> torch.Tensor:
    n = draw(st.integers(0, 3 * WIRE_BLOCK))
    x = torch.zeros(n)
    if n:
        idx = draw(st.lists(st.integers(0, n - 1), max_size=64, unique=True))
        vals = draw(st.lists(st.floats(-6e4, 6e4, width=16), min_size=len(idx), max_size=len(idx)))
        x[idx] = torch.tensor(vals, dtype=torch.float32)
    return x


@settings(max_examples=100, deadline=None)
@given(x=sparse_vectors())
def test_nonzeros_round_trip_exactly_at_four_bytes_each(x: torch.Tensor) -> None:
    buf = encode_nonzeros(x)
    nnz = int((x != 0).sum())
    blocks = -(-x.numel() // WIRE_BLOCK)
    assert len(buf) == 4 * blocks + 4 * nnz <= max_encoded_bytes(x.numel())
    assert torch.equal(decode_nonzeros(buf, x.numel()), x)


@settings(max_examples=300, deadline=None)
@given(buf=st.binary(max_size=600), numel=st.integers(0, 4 * WIRE_BLOCK))
def test_the_decoder_takes_any_bytes(buf: bytes, numel: int) -> None:
    try:
        out = decode_nonzeros(buf, numel)
    except ValueError:
        return
    assert out.dtype == torch.float32 and out.numel() == numel


def _message(counts: list[int], offsets: list[int], values: list[float]) -> bytes:
    return (
        struct.pack(f"<{len(counts)}I", *counts)
        + struct.pack(f"<{len(offsets)}H", *offsets)
        + struct.pack(f"<{len(values)}e", *values)
    )


@pytest.mark.parametrize(
    ("buf", "numel", "why"),
    [
        (_message([2], [7, 3], [1.0, 2.0]), 10, "out of order"),
        (_message([2], [3, 3], [1.0, 2.0]), 10, "out of order"),  # a repeated offset
        (_message([1], [10], [1.0]), 10, "past the vector's end"),
        (_message([11], [], []), 10, "more nonzeros than it holds"),
        (_message([1], [3], [1.0]) + b"\0", 10, "expected"),  # a trailing byte
        (_message([1], [3], [1.0])[:6], WIRE_BLOCK + 1, "short of 2 block counts"),
        (_message([1], [3], [1.0]), 0, "cannot encode"),
    ],
)
def test_malformed_encodings_are_refused_by_name(buf: bytes, numel: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_nonzeros(buf, numel)
