"""Sparse pseudo-gradients for the outer loop: top-k per chunk with error feedback, and the
wire format that carries a mostly-zero vector as its nonzeros.

SparseLoCo-style (Sarfi et al., 2025): a replica adds its round's pseudo-gradient to the
residual of what it has not sent yet, sends the `frac` largest magnitudes of each chunk of
`CHUNK` values (rounded to fp16, so the wire carries them exactly), and keeps the rest
for the next round, but only once a group used the contribution. `encode_nonzeros` /
`decode_nonzeros` are the wire format of any mostly-zero vector (contributions, and a
reducer's aggregate of them, whose support is the union of theirs): per block of
`WIRE_BLOCK` values a u32 count, then every nonzero's u16 offset in its block, then its
fp16 value. The decoder bounds every length and refuses anything out of order. Pure
torch and numpy: no hivemind (the stage process may import it).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

CHUNK = 4096  # values a top-k selection runs over
WIRE_BLOCK = 65536  # values a u16 offset addresses
# codec name -> fraction of each chunk a replica sends
SPARSE = {"topk1": 0.01, "topk3": 0.03}
_F16_MAX = float(torch.finfo(torch.float16).max)


def chunk_k(frac: float, chunk: int = CHUNK) -> int:
    """Values kept per chunk: `frac` of it, at least one."""
    return max(1, min(chunk, round(frac * chunk)))


def chunk_topk(
    x: torch.Tensor, frac: float, chunk: int = CHUNK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x` (flat) zero-padded into rows of `chunk` values, and the indices and values of
    each row's `frac` largest magnitudes."""
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"frac must be in (0, 1], got {frac}")
    n = x.numel()
    v = F.pad(x.detach().flatten().to(torch.float32), (0, (-n) % chunk)).view(-1, chunk)
    idx = v.abs().topk(chunk_k(frac, chunk), dim=1).indices
    return v, idx, v.gather(1, idx)


def scatter_rows(
    rows: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, n: int
) -> torch.Tensor:
    """Zeros shaped like `rows` with `values` at `idx` per row, flat and cut to `n`."""
    out = torch.zeros_like(rows)
    out.scatter_(1, idx, values)
    return out.flatten()[:n]


def select_topk(x: torch.Tensor, frac: float) -> torch.Tensor:
    """`x` (flat) with all but the `frac` largest magnitudes of each chunk zeroed, the kept
    values rounded to fp16 (so `encode_nonzeros` carries them exactly)."""
    rows, idx, sel = chunk_topk(x, frac)
    kept = sel.clamp(-_F16_MAX, _F16_MAX).to(torch.float16).to(torch.float32)
    return scatter_rows(rows, idx, kept, x.numel())


class ErrorFeedback:
    """One replica's residual. `select(delta)` gives what to contribute this round;
    `settle(used)` keeps what was not sent once a group used the contribution, and
    forgets the round otherwise (a lone step applied the whole delta itself). With
    `frac` None (a dense codec) it contributes the whole delta and keeps nothing."""

    def __init__(self, frac: float | None) -> None:
        self.frac = frac
        self.residual: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (delta + e, sent)

    def select(self, delta: torch.Tensor) -> torch.Tensor:
        if self.frac is None:
            return delta
        e = delta.clone() if self.residual is None else self.residual + delta
        sent = select_topk(e, self.frac)
        self._pending = (e, sent)
        return sent

    def settle(self, used: bool) -> None:
        pending, self._pending = self._pending, None
        if used and pending is not None:
            self.residual = pending[0] - pending[1]

    def reset(self) -> None:
        """Forget everything (the replica took a state from elsewhere)."""
        self.residual, self._pending = None, None


def blocks(numel: int) -> int:
    return math.ceil(numel / WIRE_BLOCK)


def max_encoded_bytes(numel: int) -> int:
    """The largest encoding of `numel` values: every one nonzero."""
    return 4 * blocks(numel) + 4 * numel


def encode_nonzeros(x: torch.Tensor) -> bytes:
    """The nonzeros of `x` (flat, any float dtype; values past fp16's range are clamped)."""
    flat = x.detach().flatten().to(torch.float32)
    idx = torch.nonzero(flat).flatten()
    counts = torch.bincount(idx // WIRE_BLOCK, minlength=blocks(flat.numel()))
    values = flat[idx].clamp(-_F16_MAX, _F16_MAX).to(torch.float16)
    return b"".join(
        (
            counts.numpy().astype("<u4").tobytes(),
            (idx % WIRE_BLOCK).numpy().astype("<u2").tobytes(),
            values.numpy().astype("<f2").tobytes(),
        )
    )


def decode_nonzeros(buf: bytes, numel: int) -> torch.Tensor:
    """The flat fp32 vector of `numel` values that `buf` encodes; ValueError for any
    malformed encoding (wrong length, a count past its block, offsets out of order)."""
    if numel < 0 or len(buf) > max_encoded_bytes(numel):
        raise ValueError(f"{len(buf)} bytes cannot encode {numel} values")
    nb = blocks(numel)
    if len(buf) < 4 * nb:
        raise ValueError(f"{len(buf)} bytes: short of {nb} block counts")
    counts = np.frombuffer(buf, dtype="<u4", count=nb).astype(np.int64)
    sizes = np.minimum(WIRE_BLOCK, numel - WIRE_BLOCK * np.arange(nb, dtype=np.int64))
    if bool((counts > sizes).any()):
        raise ValueError("a block counts more nonzeros than it holds values")
    nnz = int(counts.sum())
    if len(buf) != 4 * nb + 4 * nnz:
        raise ValueError(f"{len(buf)} bytes, expected {4 * nb + 4 * nnz} for {nnz} nonzeros")
    offsets = np.frombuffer(buf, dtype="<u2", count=nnz, offset=4 * nb).astype(np.int64)
    idx = np.repeat(WIRE_BLOCK * np.arange(nb, dtype=np.int64), counts) + offsets
    if nnz and (bool((np.diff(idx) <= 0).any()) or int(idx[-1]) >= numel):
        raise ValueError("nonzero offsets out of order or past the vector's end")
    values = np.frombuffer(buf, dtype="<f2", count=nnz, offset=4 * nb + 2 * nnz)
    out = torch.zeros(numel, dtype=torch.float32)
    out[torch.from_numpy(idx)] = torch.from_numpy(values.astype(np.float32))
    return out
