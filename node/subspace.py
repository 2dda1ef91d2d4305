"""The subspace parametrisation that makes stage boundaries cheap to send.

Every peer derives, from (run seed, d, k) alone, the same orthonormal basis `U` (d, k) and
the same frozen random token embedding `E0` (256, d). The learnt token embedding and every
write into the residual stream (attention output projection, MLP down projection) are
kept inside span(U) by `project_(stage)` after each optimizer step (and once at build
time); `project_grads_(stage)` before each step keeps the update inside it too. The
residual stream at every depth is then `E0[tokens] + U c`, so a boundary needs
to send only the k coefficients `c` (plus the tokens) forward and `U^T g` backward.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

E0_STD = 1.0  # per-entry std of the frozen token embedding (RMS of one E0 row)


def derive_seed(seed: int, *labels: object) -> int:
    """A 63-bit seed from the run seed and labels, identical on every machine."""
    text = "/".join(str(x) for x in (seed, *labels)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


@dataclass(frozen=True, slots=True)
class Subspace:
    """`basis` U: (d, k) with orthonormal columns; `e0`: (vocab, d) frozen embedding."""

    basis: torch.Tensor
    e0: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    @property
    def d_model(self) -> int:
        return int(self.basis.shape[0])

    def coefficients(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """c = U^T (h - E0[tokens]): [B, T, d] -> [B, T, k]."""
        return (hidden - self.e0[tokens]) @ self.basis

    def reconstruct(self, coeffs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """h = E0[tokens] + U c: [B, T, k] -> [B, T, d]."""
        return self.e0[tokens] + coeffs @ self.basis.T

    def project_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """U^T g: [B, T, d] -> [B, T, k] (exact for this parametrisation)."""
        return grad @ self.basis

    def expand_grad(self, coeffs: torch.Tensor) -> torch.Tensor:
        """U (U^T g): [B, T, k] -> [B, T, d]."""
        return coeffs @ self.basis.T


def make_subspace(seed: int, d_model: int, rank: int, vocab_size: int = 256) -> Subspace:
    """Deterministic U and E0 for (seed, d, k); every peer of a run gets the same ones."""
    if not 0 < rank <= d_model:
        raise ValueError(f"subspace rank {rank} must be in 1..d_model={d_model}")
    gen = torch.Generator().manual_seed(derive_seed(seed, "subspace-basis", d_model, rank))
    gauss = torch.randn(d_model, rank, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r))  # unique QR: makes U independent of LAPACK choices
    gen_e = torch.Generator().manual_seed(
        derive_seed(seed, "frozen-embedding", d_model, vocab_size)
    )
    e0 = torch.randn(vocab_size, d_model, generator=gen_e) * E0_STD
    return Subspace(basis=q.to(torch.float32).contiguous(), e0=e0.contiguous())


class SubspaceStage(Protocol):
    """What `project_` needs from a stage (node.model.Stage provides it)."""

    @property
    def subspace(self) -> Subspace | None: ...

    def residual_writes(self) -> Iterable[torch.Tensor]:
        """Weights whose dim 0 writes into the residual stream (shape (d, fan_in))."""
        ...

    def embedding_weights(self) -> Iterable[torch.Tensor]:
        """Learnt token embeddings, shape (vocab, d)."""
        ...


@torch.no_grad()
def project_(stage: SubspaceStage) -> None:
    """Re-project the stage's residual writes and embedding onto span(U), in place.

    Call after every optimizer step (the inner loop does). A stage without a subspace
    (rank 0) is left alone.
    """
    sub = stage.subspace
    if sub is None:
        return
    u = sub.basis
    for w in stage.residual_writes():
        w.copy_(u @ (u.T @ w))
    for e in stage.embedding_weights():
        e.copy_((e @ u) @ u.T)


@torch.no_grad()
def project_grads_(stage: SubspaceStage) -> None:
    """Project the gradients of the residual writes and embedding onto span(U), in place.

    Call before every optimizer step. The out-of-span part of these gradients is what a
    compressed boundary (`U^T g`) does not carry, and projection after the step would
    discard its effect anyway; removing it first makes a pipeline with subspace
    boundaries compute exactly the gradients of the unsplit model.
    """
    sub = stage.subspace
    if sub is None:
        return
    u = sub.basis
    for w in stage.residual_writes():
        if w.grad is not None:
            w.grad.copy_(u @ (u.T @ w.grad))
    for e in stage.embedding_weights():
        if e.grad is not None:
            e.grad.copy_((e.grad @ u) @ u.T)
