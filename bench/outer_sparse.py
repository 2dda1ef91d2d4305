"""A sparse pseudo-gradient codec with error feedback, for the outer-sweep simulation.

SparseLoCo-style (Sarfi et al., 2025): each replica keeps a residual e of what it has not
sent; per round it adds its pseudo-gradient (e = beta e + delta), sends the top `frac`
of each chunk of `CHUNK` values by magnitude, each quantized to `bits` bits on a uniform
grid over [-max, max] of the chunk's selection, and keeps the rest (e -= sent). What is
sent is what every member decodes and averages. `wire_bytes` counts a chunk as its k
16-bit indices, its k codes and one fp32 scale. Pure torch. The outer process's own
sparse codecs (`node.outer.sparse`, `topk1` and `topk3`) select the same way without the
2-bit grid (docs/outer-averaging.md says what was measured with each).
"""

from __future__ import annotations

import math

import torch

from node.outer.sparse import CHUNK, chunk_k, chunk_topk, scatter_rows

# codec name -> (fraction of each chunk sent, bits a value); the simulation's names
SPARSE_CODECS = {"sparse1": (0.01, 2), "sparse3": (0.03, 2)}


def topk_quantize(x: torch.Tensor, frac: float, bits: int, chunk: int = CHUNK) -> torch.Tensor:
    """`x` (flat) as the receiver decodes it: per chunk, the top `frac` by magnitude on a
    `bits`-bit grid over [-m, m] (m: the largest selected magnitude), zeros elsewhere."""
    if not 0.0 < frac <= 1.0 or not 1 <= bits <= 8:
        raise ValueError(f"frac must be in (0, 1] and bits in 1..8, got {frac}, {bits}")
    rows, idx, sel = chunk_topk(x, frac, chunk)
    m = sel.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    levels = 2**bits - 1  # grid steps between -m and m
    q = torch.round((sel / m + 1.0) * levels / 2.0).clamp(0, levels)
    return scatter_rows(rows, idx, (q * 2.0 / levels - 1.0) * m, x.numel())


def wire_bytes(numel: int, frac: float, bits: int, chunk: int = CHUNK) -> int:
    """Bytes of one encoded pseudo-gradient of `numel` values."""
    k = chunk_k(frac, chunk)
    return math.ceil(numel / chunk) * (2 * k + math.ceil(k * bits / 8) + 4)


class ErrorFeedback:
    """One replica's residual: `encode` returns what it sends this round."""

    def __init__(self, frac: float, bits: int, beta: float = 1.0) -> None:
        self.frac, self.bits, self.beta = frac, bits, beta
        self.residual: torch.Tensor | None = None

    def encode(self, delta: torch.Tensor) -> torch.Tensor:
        e = delta.clone() if self.residual is None else self.beta * self.residual + delta
        sent = topk_quantize(e, self.frac, self.bits)
        self.residual = e - sent
        return sent
