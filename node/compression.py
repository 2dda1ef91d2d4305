"""Activation codecs for stage boundaries: torch tensor <-> `protocol.EncodedTensor`.

Codecs (ids as in `protocol.tensors.CODECS`):
- `raw`: fp32, the reference every ratio is measured against.
- `fp16`: half precision of the tensor over its absmax (fp32 scale), so neither small
  gradients underflow nor large activations overflow.
- `int8`: blockwise absmax int8 over the flattened tensor (blocks of 64, fp32 scales).
- `subspace`: the k coefficients `c = U^T (h - E0[tokens])` in fp32 (forward) or
  `U^T g` (backward); needs the subspace parametrisation of node.subspace.
- `subspace_int8`: the same coefficients as rowwise int8 with two-level scales (one fp32
  scale per tensor, one fp16 relative scale per token row): k + 2 bytes per token.
- `subspace_int4`: the same scales with 4-bit codes, two per byte: k/2 + 2 bytes per
  token (k even). Forward codes index `INT4_FORWARD_LEVELS`, a 16-level Lloyd-Max
  codebook over the row absmax (1.4x less squared error than uniform levels on
  Gaussian rows); backward codes are uniform levels -7..7 with stochastic rounding, so
  gradients stay unbiased. At equal bytes it carries twice the rank of `subspace_int8`,
  and the rank is what costs loss: on the `bench` preset (2 stages) int8 at k = 16 lost
  5.8 % of eval loss, int8 at k = 32 0.03 %, int4 at k = 32 with uniform rounding both
  ways 2.7 %, with stochastic rounding backward 2.3 % (both ways 5.3 %: forward noise is
  what hurts), and with the forward codebook 0.9 to 1.7 %. See docs/compression.md.

Every decoder validates codec id, logical shape, part count, part dtypes and shapes, and
that every decoded value is finite and at most `MAX_ABS` in size, and raises `protocol.ProtocolError` for anything malformed before a model
sees it. `BoundaryCodec` is what a pipeline boundary uses: the sender calls
`encode_forward(hidden, tokens)` / `encode_backward(grad, tokens)`, the receiver
`decode_forward(enc, tokens)` / `decode_backward(enc, tokens)`; it counts raw (fp32) and
wire bytes per direction. Subspace codecs need the tokens on the receiving side, so
their forward wire bytes include one byte per token. `through_boundary` simulates a
boundary in one process (encode, serialise, decode, both directions) for central runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from node.subspace import Subspace
from protocol.codec import packb, unpackb
from protocol.errors import ProtocolError
from protocol.tensors import CODECS, EncodedTensor, TensorFrame

INT8_BLOCK = 64  # elements per scale in the blockwise int8 codec
SUBSPACE_CODECS = ("subspace", "subspace_int8", "subspace_int4")
QUANT_LEVELS = {"subspace_int8": 127, "subspace_int4": 7}  # largest uniform level per codec
# Forward levels of subspace_int4, as fractions of the row absmax: Lloyd-Max for rows of 32
# standard normal values (60 iterations on 200,000 rows); code i stands for level i.
INT4_FORWARD_LEVELS = torch.tensor(
    [-0.971, -0.781, -0.627, -0.494, -0.374, -0.262, -0.155, -0.051,
     0.053, 0.157, 0.263, 0.375, 0.495, 0.627, 0.781, 0.971]
)  # fmt: skip


def _frame(t: torch.Tensor) -> TensorFrame:
    return TensorFrame.from_numpy(t.detach().contiguous().cpu().numpy())


def _part(enc: EncodedTensor, i: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    arr = enc.parts[i].to_numpy(expect_dtype=dtype, expect_shape=shape)
    return torch.from_numpy(arr.copy())


def _check_header(enc: EncodedTensor, codec: str, shape: tuple[int, ...], n_parts: int) -> None:
    if not isinstance(enc, EncodedTensor):
        raise ProtocolError(f"expected an EncodedTensor, got {type(enc).__name__}")
    if enc.codec != codec:
        raise ProtocolError(f"codec {enc.codec!r}, expected {codec!r}")
    if list(enc.shape) != list(shape):
        raise ProtocolError(f"shape {list(enc.shape)[:8]}, expected {list(shape)}")
    if len(enc.parts) != n_parts or not all(isinstance(p, TensorFrame) for p in enc.parts):
        raise ProtocolError(f"{codec}: {len(enc.parts)} parts, expected {n_parts}")


# The largest absolute value a decoded boundary tensor may hold. Activations and their
# gradients stay orders of magnitude below it in a healthy run; a sender whose values
# exceed it (finite coefficients can still expand past any bound) is refused, since
# gradient clipping alone would let every step be steered by it.
MAX_ABS = 1e6


def _finite(t: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()):
        raise ProtocolError(f"{what}: decoded tensor holds NaN or Inf")
    if t.numel() and float(t.abs().max()) > MAX_ABS:
        raise ProtocolError(f"{what}: decoded values exceed {MAX_ABS:g}")
    return t


# --- generic codecs ----------------------------------------------------------------------


def encode_raw(t: torch.Tensor) -> EncodedTensor:
    return EncodedTensor(codec="raw", shape=list(t.shape), parts=[_frame(t.float())])


def decode_raw(enc: EncodedTensor, shape: tuple[int, ...]) -> torch.Tensor:
    _check_header(enc, "raw", shape, 1)
    return _finite(_part(enc, 0, "float32", shape), "raw")


def encode_fp16(t: torch.Tensor) -> EncodedTensor:
    t = t.detach().float()
    top = t.abs().max() if t.numel() else torch.tensor(0.0, device=t.device)
    if not bool(torch.isfinite(top)):
        raise ValueError("fp16 codec: tensor holds NaN or Inf")
    scale = top.reshape(1).clamp_min(1e-30)
    half = (t / scale).to(torch.float16)
    return EncodedTensor(codec="fp16", shape=list(t.shape), parts=[_frame(half), _frame(scale)])


def decode_fp16(enc: EncodedTensor, shape: tuple[int, ...]) -> torch.Tensor:
    _check_header(enc, "fp16", shape, 2)
    half = _part(enc, 0, "float16", shape)
    scale = _part(enc, 1, "float32", (1,))
    if float(scale[0]) < 0:
        raise ProtocolError("fp16: negative scale")
    return _finite(half.float() * scale, "fp16")


def encode_int8(t: torch.Tensor, block: int = INT8_BLOCK) -> EncodedTensor:
    flat = t.detach().float().reshape(-1)
    n = flat.numel()
    n_blocks = max(1, math.ceil(n / block))
    padded = torch.zeros(n_blocks * block, device=flat.device)  # quantized where t lives
    padded[:n] = flat
    blocks = padded.view(n_blocks, block)
    scale = blocks.abs().amax(dim=1) / 127.0
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("int8 codec: tensor holds NaN or Inf")
    q = torch.where(scale[:, None] > 0, blocks / scale.clamp_min(1e-38)[:, None], 0.0)
    q8 = q.round().clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
    return EncodedTensor(codec="int8", shape=list(t.shape), parts=[_frame(q8), _frame(scale)])


def decode_int8(
    enc: EncodedTensor, shape: tuple[int, ...], block: int = INT8_BLOCK
) -> torch.Tensor:
    _check_header(enc, "int8", shape, 2)
    n = math.prod(shape)
    n_blocks = max(1, math.ceil(n / block))
    q = _part(enc, 0, "int8", (n,))
    scale = _part(enc, 1, "float32", (n_blocks,))
    if bool((scale < 0).any()):
        raise ProtocolError("int8: negative scale")
    padded = torch.zeros(n_blocks * block)
    padded[:n] = q.float()
    out = (padded.view(n_blocks, block) * scale[:, None]).reshape(-1)[:n]
    return _finite(out.reshape(shape), "int8")


# --- rowwise int8 / int4 for subspace coefficients ----------------------------------------------


def _row_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., k] -> (row absmax [...] as rel * g, fp16 relative row scale, fp32 global [1])."""
    absmax = x.abs().amax(dim=-1)
    top = absmax.max() if absmax.numel() else torch.tensor(0.0, device=x.device)
    if not bool(torch.isfinite(top)):
        raise ValueError("subspace codec: tensor holds NaN or Inf")
    g = top.reshape(1).clone()
    rel = (absmax / g.clamp_min(1e-38)).to(torch.float16) if float(top) > 0 else absmax.half() * 0
    return rel.float() * g, rel, g


def quantize_rows(
    x: torch.Tensor, levels: int = 127, rng: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., k] -> (int8 q [..., k] in -levels..levels, fp16 relative row scale [...],
    fp32 global scale [1]); rounds to nearest, or stochastically (unbiased) with `rng`."""
    x = x.detach().float()
    row, rel, g = _row_scales(x)
    step = row / levels
    y = torch.where(step[..., None] > 0, x / step.clamp_min(1e-38)[..., None], 0.0)
    y = y.round() if rng is None else torch.floor(y + torch.rand(y.shape, generator=rng))
    return y.clamp_(-levels, levels).to(torch.int8), rel, g


def dequantize_rows(
    q: torch.Tensor, rel: torch.Tensor, g: torch.Tensor, levels: int = 127
) -> torch.Tensor:
    return q.float() * (rel.float() * g / levels)[..., None]


def quantize_rows_codebook(
    x: torch.Tensor, book: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., k] -> (codes [..., k] in -8..7 for book[code + 8], rel, g) over the row absmax."""
    x = x.detach().float()
    row, rel, g = _row_scales(x)
    y = torch.where(row[..., None] > 0, x / row.clamp_min(1e-38)[..., None], 0.0)
    codes = (y[..., None] - book).abs().argmin(dim=-1) - len(book) // 2
    return codes.to(torch.int8), rel, g


def dequantize_codebook(
    codes: torch.Tensor, rel: torch.Tensor, g: torch.Tensor, book: torch.Tensor
) -> torch.Tensor:
    return book[codes.long() + len(book) // 2] * (rel.float() * g)[..., None]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 codes -8..7 [..., k] (k even) -> uint8 [..., k/2], two offset nibbles a byte."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: int8 codes -8..7."""
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def encode_coefficients(
    coeffs: torch.Tensor,
    codec: str,
    logical: list[int],
    *,
    backward: bool = False,
    rng: torch.Generator | None = None,
) -> EncodedTensor:
    """Coefficients [B, T, k] of a hidden state or gradient of logical shape [B, T, d]."""
    coeffs = coeffs.detach().float().cpu()  # bound for the wire; the codebook and rng are CPU
    if codec == "subspace":
        parts = [_frame(coeffs)]
    elif codec == "subspace_int8":
        parts = [_frame(p) for p in quantize_rows(coeffs)]
    elif codec == "subspace_int4":
        if backward:  # unbiased: stochastic rounding to uniform levels
            if rng is None:  # a fresh generator per call would repeat the same draws
                raise ValueError("subspace_int4 gradients need the boundary's rng")
            q, rel, g = quantize_rows(coeffs, QUANT_LEVELS[codec], rng)
        else:
            q, rel, g = quantize_rows_codebook(coeffs, INT4_FORWARD_LEVELS)
        parts = [_frame(pack_nibbles(q)), _frame(rel), _frame(g)]
    else:
        raise ValueError(f"{codec!r} is not a subspace codec")
    return EncodedTensor(codec=codec, shape=logical, parts=parts)


def decode_coefficients(
    enc: EncodedTensor, codec: str, logical: tuple[int, ...], rank: int, *, backward: bool = False
) -> torch.Tensor:
    """Validated coefficients [..., k] from an encoding of logical shape [..., d]."""
    rows = logical[:-1]
    if codec == "subspace":
        _check_header(enc, codec, logical, 1)
        return _part(enc, 0, "float32", (*rows, rank))
    _check_header(enc, codec, logical, 3)
    if codec == "subspace_int4":
        q = unpack_nibbles(_part(enc, 0, "uint8", (*rows, rank // 2)))
        if backward and bool((q < -7).any()):
            raise ProtocolError("subspace_int4: code -8 is not a backward level")
    else:
        q = _part(enc, 0, "int8", (*rows, rank))
    rel = _part(enc, 1, "float16", rows)
    g = _part(enc, 2, "float32", (1,))
    if bool((rel < 0).any() or (rel > 1.001).any()) or float(g[0]) < 0:
        raise ProtocolError(f"{codec}: row scales out of range")
    if codec == "subspace_int4" and not backward:
        return _finite(dequantize_codebook(q, rel, g, INT4_FORWARD_LEVELS), codec)
    return _finite(dequantize_rows(q, rel, g, QUANT_LEVELS[codec]), codec)


# --- boundary codec ----------------------------------------------------------------------


@dataclass(slots=True)
class BoundaryStats:
    """Bytes counted by one boundary; raw is the fp32 tensor, wire the serialised encoding."""

    tokens: int = 0  # tokens that crossed forward
    raw_fwd: int = 0  # bytes
    wire_fwd: int = 0  # bytes (includes the tokens when the codec needs them)
    raw_bwd: int = 0  # bytes
    wire_bwd: int = 0  # bytes

    def ratio(self) -> float:
        wire = self.wire_fwd + self.wire_bwd
        return (self.raw_fwd + self.raw_bwd) / wire if wire else float("nan")


@dataclass(slots=True)
class BoundaryCodec:
    """The codec of one stage boundary; see the module docstring."""

    codec: str
    d_model: int
    subspace: Subspace | None = None
    stats: BoundaryStats = field(default_factory=BoundaryStats)
    seed: int = 0  # seeds the stochastic rounding of subspace_int4 gradients
    rng: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = torch.Generator().manual_seed(self.seed)
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; choose from {CODECS}")
        if self.codec in SUBSPACE_CODECS:
            if self.subspace is None:
                raise ValueError(f"codec {self.codec!r} needs a model with subspace_rank > 0")
            if self.subspace.d_model != self.d_model:
                raise ValueError("subspace basis does not match d_model")
            if self.codec == "subspace_int4" and self.subspace.rank % 2:
                raise ValueError(
                    f"codec subspace_int4 needs an even rank, not {self.subspace.rank}"
                )

    @property
    def needs_tokens(self) -> bool:
        return self.codec in SUBSPACE_CODECS

    def _logical(self, tokens: torch.Tensor) -> tuple[int, ...]:
        return (*tokens.shape, self.d_model)

    def _encode(self, t: torch.Tensor, tokens: torch.Tensor, backward: bool) -> EncodedTensor:
        if tuple(t.shape) != self._logical(tokens):
            raise ValueError(f"tensor {list(t.shape)} does not match tokens {list(tokens.shape)}")
        t = t.detach()
        if self.codec == "raw":
            return encode_raw(t)
        if self.codec == "fp16":
            return encode_fp16(t)
        if self.codec == "int8":
            return encode_int8(t)
        assert self.subspace is not None
        coeffs = (
            self.subspace.project_grad(t) if backward else self.subspace.coefficients(t, tokens)
        )
        return encode_coefficients(
            coeffs, self.codec, list(t.shape), backward=backward, rng=self.rng
        )

    def _decode(self, enc: EncodedTensor, tokens: torch.Tensor, backward: bool) -> torch.Tensor:
        """Decoded and validated on the CPU (the wire's copy), returned on the device of
        `tokens` (the receiving stage's)."""
        shape = self._logical(tokens)
        if self.codec == "raw":
            return decode_raw(enc, shape).to(tokens.device)
        if self.codec == "fp16":
            return decode_fp16(enc, shape).to(tokens.device)
        if self.codec == "int8":
            return decode_int8(enc, shape).to(tokens.device)
        assert self.subspace is not None
        coeffs = decode_coefficients(enc, self.codec, shape, self.subspace.rank, backward=backward)
        coeffs = coeffs.to(self.subspace.basis.device)  # the wire's CPU copy meets the basis
        if backward:  # finite coefficients can still overflow when expanded
            return _finite(self.subspace.expand_grad(coeffs), self.codec)
        if tokens.dtype != torch.int64 or bool(((tokens < 0) | (tokens > 255)).any()):
            raise ProtocolError("tokens must be int64 bytes 0..255")
        return _finite(self.subspace.reconstruct(coeffs, tokens), self.codec)

    def encode_forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> EncodedTensor:
        enc = self._encode(hidden, tokens, backward=False)
        self.stats.tokens += tokens.numel()
        self.stats.raw_fwd += hidden.numel() * 4
        self.stats.wire_fwd += wire_size(enc) + (tokens.numel() if self.needs_tokens else 0)
        return enc

    def decode_forward(self, enc: EncodedTensor, tokens: torch.Tensor) -> torch.Tensor:
        return self._decode(enc, tokens, backward=False)

    def encode_backward(self, grad: torch.Tensor, tokens: torch.Tensor) -> EncodedTensor:
        enc = self._encode(grad, tokens, backward=True)
        self.stats.raw_bwd += grad.numel() * 4
        self.stats.wire_bwd += wire_size(enc)
        return enc

    def decode_backward(self, enc: EncodedTensor, tokens: torch.Tensor) -> torch.Tensor:
        return self._decode(enc, tokens, backward=True)


def wire_size(enc: EncodedTensor) -> int:
    """Serialised size of an encoding in bytes (msgpack, as it goes on the wire)."""
    return len(packb(enc.to_wire()))


def over_the_wire(enc: EncodedTensor) -> EncodedTensor:
    """Serialise and parse back, exactly as a receiving peer would."""
    return EncodedTensor.from_wire(unpackb(packb(enc.to_wire())))


class _Boundary(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        codec: BoundaryCodec,
    ) -> torch.Tensor:
        ctx.codec = codec  # type: ignore[attr-defined]
        ctx.save_for_backward(tokens)
        return codec.decode_forward(over_the_wire(codec.encode_forward(hidden, tokens)), tokens)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        (tokens,) = ctx.saved_tensors  # type: ignore[attr-defined]
        codec: BoundaryCodec = ctx.codec  # type: ignore[attr-defined]
        out = codec.decode_backward(over_the_wire(codec.encode_backward(grad, tokens)), tokens)
        return out, None, None


def through_boundary(
    hidden: torch.Tensor, tokens: torch.Tensor, codec: BoundaryCodec
) -> torch.Tensor:
    """The hidden state as the next stage would receive it; gradients go back encoded."""
    out: torch.Tensor = _Boundary.apply(hidden, tokens, codec)  # type: ignore[no-untyped-call]
    return out
