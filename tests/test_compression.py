"""Activation codecs: round trips within error bounds, byte accounting, and decoders that
only ever raise ProtocolError on hostile input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.compression import (
    BoundaryCodec,
    decode_fp16,
    decode_int8,
    decode_raw,
    encode_fp16,
    encode_int8,
    encode_raw,
    over_the_wire,
    pack_nibbles,
    unpack_nibbles,
    wire_size,
)
from node.subspace import make_subspace
from protocol.errors import ProtocolError
from protocol.tensors import DTYPES, EncodedTensor, TensorFrame

D, K = 64, 8
SUB = make_subspace(3, D, K)
SHAPE = (2, 5, D)


def _hidden(tokens: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    c = torch.randn(*tokens.shape, K) * scale
    return SUB.reconstruct(c, tokens)


def test_raw_round_trip_is_exact() -> None:
    t = torch.randn(SHAPE)
    assert torch.equal(decode_raw(over_the_wire(encode_raw(t)), SHAPE), t)


def test_fp16_round_trip_within_half_precision() -> None:
    t = torch.randn(SHAPE) * 100
    out = decode_fp16(over_the_wire(encode_fp16(t)), SHAPE)
    # half an fp16 ulp of each value, or of the smallest normal relative to the max
    top = float(t.abs().max())
    assert bool(((out - t).abs() <= t.abs() * 2**-11 + top * 2**-24 * 1.01).all())
    big = torch.tensor([1e6, -3e5, 1.0])
    out = decode_fp16(encode_fp16(big), (3,))
    assert bool(((out - big).abs() <= big.abs() * 2**-11 + 1e6 * 2**-24 * 1.01).all())
    with pytest.raises(ValueError, match="NaN or Inf"):
        encode_fp16(torch.tensor([1.0, float("inf")]))


def test_int8_round_trip_within_half_a_step_per_block() -> None:
    t = torch.randn(3, 7, 50) * torch.logspace(-6, 3, 50)  # blocks of very different size
    out = decode_int8(over_the_wire(encode_int8(t)), tuple(t.shape))
    flat, err = t.reshape(-1), (out - t).reshape(-1).abs()
    n = flat.numel()
    for start in range(0, n, 64):
        block = flat[start : start + 64]
        assert float(err[start : start + 64].max()) <= float(block.abs().max()) / 127 / 2 * 1.001
    zeros = torch.zeros(5)
    assert torch.equal(decode_int8(encode_int8(zeros), (5,)), zeros)


@pytest.mark.parametrize(
    "codec", ["raw", "fp16", "int8", "subspace", "subspace_int8", "subspace_int4"]
)
def test_boundary_round_trip_forward_and_backward(codec: str) -> None:
    tokens = torch.randint(0, 256, SHAPE[:2])
    h = _hidden(tokens)
    g = torch.randn(SHAPE) * 1e-5  # gradients are small; the codecs must keep them
    bc = BoundaryCodec(codec, D, SUB)
    h2 = bc.decode_forward(over_the_wire(bc.encode_forward(h, tokens)), tokens)
    g2 = bc.decode_backward(over_the_wire(bc.encode_backward(g, tokens)), tokens)
    g_ref = SUB.expand_grad(SUB.project_grad(g)) if codec.startswith("subspace") else g
    tol = {"raw": 1e-7, "fp16": 1e-3, "int8": 1e-2, "subspace": 1e-5, "subspace_int8": 1e-2,
           "subspace_int4": 0.2}[codec]  # fmt: skip
    assert float((h2 - h).norm() / h.norm()) < tol
    assert float((g2 - g_ref).norm() / g_ref.norm()) < tol
    c_err = (SUB.coefficients(h2, tokens) - SUB.coefficients(h, tokens)).abs()
    c_max = SUB.coefficients(h, tokens).abs().amax(-1, keepdim=True)
    if codec == "subspace_int8":  # per token: at most ~half a step of its own row scale
        assert bool((c_err <= c_max / 127 * 0.51 + 1e-5).all())
    if codec == "subspace_int4":  # at most half the widest gap of the forward codebook
        assert bool((c_err <= c_max * 0.096 + 1e-5).all())


def test_subspace_int8_bytes_per_token_and_ratio() -> None:
    tokens = torch.randint(0, 256, (16, 128))
    bc = BoundaryCodec("subspace_int8", D, SUB)
    bc.encode_forward(_hidden(tokens), tokens)
    bc.encode_backward(torch.randn(16, 128, D), tokens)
    n = tokens.numel()
    # k int8 + one fp16 row scale (+ 1 token byte forward) + a little msgpack framing
    assert K + 3 <= bc.stats.wire_fwd / n < K + 3.1
    assert K + 2 <= bc.stats.wire_bwd / n < K + 2.1
    assert bc.stats.raw_fwd == bc.stats.raw_bwd == n * D * 4
    assert bc.stats.ratio() == pytest.approx(8 * D / (2 * K + 5), rel=0.02)


def test_subspace_int4_packs_two_codes_a_byte() -> None:
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(4).reshape(4, 16)
    q = torch.cat([q, q.flip(-1)], dim=-1)  # every code, in both nibble positions
    packed = pack_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.shape == (4, 16)
    assert torch.equal(unpack_nibbles(packed), q)
    tokens = torch.randint(0, 256, (16, 128))
    bc = BoundaryCodec("subspace_int4", D, SUB)
    enc = bc.encode_backward(torch.randn(16, 128, D), tokens)
    bc.encode_forward(_hidden(tokens), tokens)
    n = tokens.numel()
    assert K // 2 + 3 <= bc.stats.wire_fwd / n < K // 2 + 3.1
    assert K // 2 + 2 <= bc.stats.wire_bwd / n < K // 2 + 2.1
    # code -8 (nibble 0) is a forward codebook entry but no backward level
    zero = TensorFrame.from_numpy(np.zeros((16, 128, K // 2), np.uint8))
    hostile = EncodedTensor(codec=enc.codec, shape=enc.shape, parts=[zero, *enc.parts[1:]])
    with pytest.raises(ProtocolError, match="backward level"):
        bc.decode_backward(hostile, tokens)
    assert bool(torch.isfinite(bc.decode_forward(hostile, tokens)).all())
    with pytest.raises(ValueError, match="even rank"):
        BoundaryCodec("subspace_int4", D, make_subspace(0, D, 3))


def test_subspace_int4_gradients_are_unbiased() -> None:
    """Stochastic rounding: the mean of many decoded gradients approaches the exact one,
    far closer than one rounding step."""
    tokens = torch.randint(0, 256, (1, 4))
    g = torch.randn(1, 4, D)
    exact = SUB.expand_grad(SUB.project_grad(g))
    bc = BoundaryCodec("subspace_int4", D, SUB, seed=1)
    mean = sum(bc.decode_backward(bc.encode_backward(g, tokens), tokens) for _ in range(400)) / 400
    step = SUB.project_grad(g).abs().amax(-1).max() / 7
    assert float((SUB.project_grad(mean) - SUB.project_grad(exact)).abs().max()) < 0.15 * step


def test_decoders_check_shape_codec_and_finiteness() -> None:
    tokens = torch.randint(0, 256, SHAPE[:2])
    bc = BoundaryCodec("subspace_int8", D, SUB)
    enc = bc.encode_forward(_hidden(tokens), tokens)
    with pytest.raises(ProtocolError, match="shape"):
        bc.decode_forward(enc, tokens[:1])
    with pytest.raises(ProtocolError, match="codec"):
        BoundaryCodec("subspace", D, SUB).decode_forward(enc, tokens)
    bad_scale = TensorFrame.from_numpy(np.array([np.inf], dtype=np.float32))
    hostile = EncodedTensor(codec=enc.codec, shape=enc.shape, parts=[*enc.parts[:2], bad_scale])
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        bc.decode_forward(hostile, tokens)
    nan = EncodedTensor(
        codec="raw", shape=[2], parts=[TensorFrame.from_numpy(np.array([1, np.nan], np.float32))]
    )
    with pytest.raises(ProtocolError):
        decode_raw(nan, (2,))
    assert wire_size(enc) > 0


# --- hypothesis: hostile encodings only ever raise ProtocolError ------------------------

CODEC_NAMES = ["raw", "fp16", "int8", "subspace", "subspace_int8", "subspace_int4"]
_frames = st.builds(
    TensorFrame,
    dtype=st.sampled_from(sorted(DTYPES)),
    shape=st.lists(st.integers(0, 70), max_size=4),
    data=st.binary(max_size=600),
)
_encodings = st.builds(
    EncodedTensor,
    codec=st.sampled_from(CODEC_NAMES),
    shape=st.one_of(st.just([1, 3, D]), st.lists(st.integers(0, 70), max_size=4)),
    parts=st.lists(_frames, max_size=4),
)
TOKENS = torch.randint(0, 256, (1, 3))


def _decode_all(enc: EncodedTensor) -> None:
    for name in CODEC_NAMES:
        bc = BoundaryCodec(name, D, SUB)
        for decode in (bc.decode_forward, bc.decode_backward):
            try:
                out = decode(enc, TOKENS)
            except ProtocolError:
                continue
            assert out.shape == (1, 3, D) and bool(torch.isfinite(out).all())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_encodings)
def test_random_encodings_only_raise_protocol_error(enc: EncodedTensor) -> None:
    _decode_all(enc)


def _valid_encodings() -> list[EncodedTensor]:
    h = _hidden(TOKENS)
    return [BoundaryCodec(n, D, SUB).encode_forward(h, TOKENS) for n in CODEC_NAMES]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(range(len(CODEC_NAMES))),
    st.integers(0, 3),
    st.integers(0, 10_000),
    st.integers(0, 255),
    st.sampled_from(sorted(DTYPES)),
    st.integers(0, 3),
)
def test_mutated_encodings_only_raise_protocol_error(
    which: int, part: int, pos: int, byte: int, dtype: str, mode: int
) -> None:
    enc = _valid_encodings()[which]
    parts = list(enc.parts)
    i = part % len(parts)
    frame = parts[i]
    if mode == 0:  # flip a payload byte (may make NaN/Inf or huge values)
        data = bytearray(frame.data)
        data[pos % len(data)] = byte
        parts[i] = TensorFrame(dtype=frame.dtype, shape=frame.shape, data=bytes(data))
    elif mode == 1:  # wrong dtype label
        parts[i] = TensorFrame(dtype=dtype, shape=frame.shape, data=frame.data)
    elif mode == 2:  # truncated payload
        parts[i] = TensorFrame(dtype=frame.dtype, shape=frame.shape, data=frame.data[: pos % 7])
    else:  # wrong shape claim
        parts[i] = TensorFrame(dtype=frame.dtype, shape=[*frame.shape, 2], data=frame.data)
    _decode_all(EncodedTensor(codec=enc.codec, shape=enc.shape, parts=parts))


def test_int8_decoded_values_cannot_overflow() -> None:
    q = TensorFrame.from_numpy(np.full(4, 127, np.int8))
    huge = TensorFrame.from_numpy(np.full(1, np.finfo(np.float32).max, np.float32))
    enc = EncodedTensor(codec="int8", shape=[4], parts=[q, huge])
    with pytest.raises(ProtocolError):
        decode_int8(enc, (4,))
