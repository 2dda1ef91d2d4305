"""The torch side of one pipeline stage. Every method runs on the torch worker thread.

`StageCompute` owns the stage module, its boundary codecs, the inner AdamW optimizer and
a bounded activation cache. The trio side calls:

- `forward(mb_id, tokens, hidden)`: stage 0 (hidden=None) and middle stages return the
  encoded boundary output and keep the activations for backward; the last stage runs
  the loss and its backward at once and returns `(encoded input gradient, loss)`.
- `backward(mb_id, tokens, hidden, grad)`: finish a micro-batch with the gradient from
  the next stage. A cache miss (evicted, or a retry served by another replica)
  recomputes the forward from the encoded input the caller still holds (the backward
  message carries it, a few bytes per token, so any live replica can finish the
  micro-batch; the cache is only the fast path). A cache entry from before the last inner
  step keeps its graph: the step stashes the weights it saved (`node.weight_stash`), so
  its backward runs at the weights of its forward (a gradient one step stale). One from
  before an outer merge, or from before two inner steps, is recomputed at the current
  weights, against a downstream gradient computed at the old ones.
- `drop(mb_id)`: forget a micro-batch whose route failed.

Gradients of finished micro-batches accumulate until `inner_batch_tokens` tokens have
been processed; then one AdamW step runs and the subspace projection is re-applied.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from node import metrics
from node.compression import BoundaryCodec
from node.config import NodeConfig
from node.inner_step import inner_step
from node.model import ModelConfig, build_stage, param_groups, run_model_config
from node.weight_stash import WeightStash
from protocol.control import MAX_DEVICE_BYTES, DeviceMemory, RunInfo
from protocol.tensors import EncodedTensor

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class InnerConfig:
    lr: float  # peak AdamW learning rate
    warmup_steps: int  # inner steps of linear warm-up
    weight_decay: float  # AdamW decay on matrices
    inner_batch_tokens: int  # tokens per optimizer step
    cache_size: int  # micro-batches kept for backward
    # tokens whose activations are kept, all cached micro-batches together (a sender's
    # oversized blocks evict, and are recomputed at backward, instead of filling memory)
    cache_tokens: int = 1 << 16
    grad_clip: float = 1.0  # max global grad norm
    precision: str = "fp32"  # fp32 | bf16 (autocast: matmuls in bf16, weights and grads fp32)
    recompute: bool = False  # recompute each block's activations in backward


class StageCompute:
    def __init__(
        self,
        model_cfg: ModelConfig,
        stage: int,
        n_stages: int,
        codec: str,
        inner: InnerConfig,
        device: str = "cpu",
    ) -> None:
        if inner.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {inner.precision!r}")
        self.device = torch.device(device)
        self.model = build_stage(model_cfg, stage, n_stages).to(self.device)
        self.model.recompute = inner.recompute
        self.is_first, self.is_last = self.model.is_first, self.model.is_last
        sub = self.model.subspace
        d = model_cfg.d_model
        self.codec_in = None if self.is_first else BoundaryCodec(codec, d, sub)
        self.codec_out = None if self.is_last else BoundaryCodec(codec, d, sub)
        self.inner = inner
        self.opt = torch.optim.AdamW(
            param_groups(self.model, inner.weight_decay), lr=inner.lr, betas=(0.9, 0.95)
        )
        # mb_id -> (decoded input or None on stage 0, output, weights version it was computed at)
        self._cache: OrderedDict[str, tuple[torch.Tensor | None, torch.Tensor, int]] = OrderedDict()
        self._pending_tokens = 0  # tokens whose gradients are accumulated, not yet stepped
        self._pending_mbs = 0
        self.inner_steps = 0
        self.stash = WeightStash(list(self.model.parameters()))
        self.tokens_trained = 0  # tokens this replica has finished backward for
        self.recomputes = 0  # cache misses served by recomputation
        self.skipped_steps = 0  # inner steps skipped for a non-finite gradient norm

    @property
    def weights_version(self) -> int:
        """Bumped whenever the weights change in place."""
        return self.stash.version

    # --- helpers ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def compute_precision(self) -> Iterator[None]:
        """The stage's forward runs inside this: bf16 autocast, or nothing for fp32."""
        if self.inner.precision == "bf16":
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                yield
        else:
            yield

    def _tokens(self, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(self.device)
        return t[:, :-1], t[:, 1:]

    def _input(self, inputs: torch.Tensor, hidden: EncodedTensor | None) -> torch.Tensor:
        if self.is_first:
            return inputs
        assert self.codec_in is not None and hidden is not None
        return self.codec_in.decode_forward(hidden, inputs).to(self.device).requires_grad_(True)

    def _grad_in(self, x: torch.Tensor, inputs: torch.Tensor) -> EncodedTensor | None:
        if self.is_first:
            return None
        assert self.codec_in is not None and x.grad is not None
        return self.codec_in.encode_backward(x.grad, inputs)

    def _finished(self, n_tokens: int) -> None:
        self._pending_tokens += n_tokens
        self._pending_mbs += 1
        self.tokens_trained += n_tokens
        if self._pending_tokens >= self.inner.inner_batch_tokens:
            self.step()

    # --- the pipeline calls ----------------------------------------------------------------

    def forward(
        self, mb_id: str, tokens: np.ndarray, hidden: EncodedTensor | None
    ) -> EncodedTensor | tuple[EncodedTensor | None, float]:
        inputs, targets = self._tokens(tokens)
        self.model.train()
        x = self._input(inputs, hidden)
        if self.is_last:
            with self.compute_precision():
                loss = self.model(x, targets)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} on {mb_id}")
            loss.backward()
            grad = self._grad_in(x, inputs)
            self._finished(inputs.numel())
            return grad, float(loss.item())
        with self.compute_precision(), self.stash.hooks():
            out = self.model(x)
        self._cache[mb_id] = (x if not self.is_first else None, out, self.weights_version)
        while self._cache and (
            len(self._cache) > self.inner.cache_size
            or self._cached_tokens() > self.inner.cache_tokens
        ):
            self._cache.popitem(last=False)
        assert self.codec_out is not None
        return self.codec_out.encode_forward(out, inputs)

    def backward(
        self,
        mb_id: str,
        tokens: np.ndarray,
        hidden: EncodedTensor | None,
        grad: EncodedTensor,
    ) -> EncodedTensor | None:
        inputs, _ = self._tokens(tokens)
        assert self.codec_out is not None
        g = self.codec_out.decode_backward(grad, inputs).to(self.device)
        cached = self._cache.pop(mb_id, None)
        if cached is not None and self.stash.usable(cached[2]):
            x = inputs if cached[0] is None else cached[0]
            out = cached[1]
        else:
            # Evicted, or the weights moved since the forward in a way the stash does not
            # cover (an outer merge, a second inner step): recompute at the current
            # weights. The stale graph is let go first, so a recompute never holds two
            # micro-batches' activations (on an H200 that made stage 0 peak a fifth above
            # its estimate).
            self.recomputes += 1
            metrics.RECOMPUTES.inc()
            kept = cached[0] if cached is not None else None
            del cached
            if kept is not None:
                x = kept.detach().requires_grad_(True)
            else:
                x = self._input(inputs, hidden)
            with self.compute_precision():
                out = self.model(x)
        torch.autograd.backward(out, g.to(out.dtype))
        self._finished(inputs.numel())
        return self._grad_in(x, inputs)

    def parameters(self) -> list[torch.Tensor]:
        """The stage's parameters in a fixed order (the outer loop's flat layout)."""
        return list(self.model.parameters())

    def weights_changed(self) -> None:
        """Call after changing the weights outside `step` (an outer-step merge): cached
        graphs of earlier weights are recomputed at their backward."""
        self.stash.advance(stashed=False)

    def _cached_tokens(self) -> int:
        return sum(int(out.shape[0] * out.shape[1]) for _, out, _ in self._cache.values())

    def _stash_cached_graphs(self) -> None:
        """Before an inner step: the cached graphs of the current weights keep a copy of
        the parameters they saved; older ones (a stash ago, or unstashed) are let go now
        and recomputed at their backward, so at most one stashed copy is alive."""
        version = self.weights_version
        for mb_id in [k for k, (_, _, v) in self._cache.items() if v != version]:
            del self._cache[mb_id]
        self.stash.freeze(version)

    def drop(self, mb_id: str) -> None:
        self._cache.pop(mb_id, None)

    def step(self) -> None:
        """One inner AdamW step over the accumulated micro-batches."""
        if self._pending_mbs == 0:
            return
        scale = 1.0 / self._pending_mbs
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        warm = min(1.0, (self.inner_steps + 1) / max(1, self.inner.warmup_steps))
        self._pending_tokens = 0
        self._pending_mbs = 0
        lr = self.inner.lr * warm
        self._stash_cached_graphs()
        if not inner_step([self.model], self.opt, lr=lr, grad_clip=self.inner.grad_clip):
            self.skipped_steps += 1
            log.warning("stage: inner step skipped: the gradient norm is not finite")
            return
        self.inner_steps += 1
        self.stash.advance(stashed=True)
        if self.device.type == "cuda":
            metrics.DEVICE_PEAK.set(torch.cuda.max_memory_allocated(self.device))

    # --- reporting ---------------------------------------------------------------------------

    def bytes_counts(self) -> dict[str, int]:
        """Raw (fp32) and wire bytes this stage sent, per direction."""
        out = {"raw_fwd": 0, "wire_fwd": 0, "raw_bwd": 0, "wire_bwd": 0}
        if self.codec_out is not None:
            out["raw_fwd"] += self.codec_out.stats.raw_fwd
            out["wire_fwd"] += self.codec_out.stats.wire_fwd
        if self.codec_in is not None:
            out["raw_bwd"] += self.codec_in.stats.raw_bwd
            out["wire_bwd"] += self.codec_in.stats.wire_bwd
        return out


def throughput_probe(compute: StageCompute, micro_batch: int, seq_len: int) -> float:
    """This stage's forward+backward tokens/s on one synthetic micro-batch (for the join)."""
    tokens = np.random.default_rng(0).integers(0, 256, size=(micro_batch, seq_len + 1))
    inputs, targets = compute._tokens(tokens)
    d = compute.model.config.d_model
    t0 = time.perf_counter()
    x = (
        inputs
        if compute.is_first
        else torch.zeros(micro_batch, seq_len, d, device=compute.device, requires_grad=True)
    )
    with compute.compute_precision():
        out = (
            compute.model(x, targets) if compute.is_last else compute.model(x).float().pow(2).mean()
        )
    out.backward()
    compute.opt.zero_grad(set_to_none=True)
    return micro_batch * seq_len / max(time.perf_counter() - t0, 1e-6)


def resolve_precision(requested: str, device: str) -> str:
    """`auto` is bf16 on a CUDA device that supports it, fp32 elsewhere (bf16 autocast on a
    CPU is slower than fp32)."""
    if requested != "auto":
        return requested
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def memory_report(cfg: NodeConfig, device: str) -> DeviceMemory:
    """What the join reports of this node's device memory and the settings that size a
    stage's need of it (call on the torch worker: it may initialise CUDA). A CUDA device
    reports `torch.cuda.mem_get_info`, capped by `memory_limit_gb`; a CPU reports the cap
    as both total and free, or nothing (0: placed without regard to memory)."""
    limit = MAX_DEVICE_BYTES if cfg.memory_limit_gb is None else int(cfg.memory_limit_gb * 2**30)
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
    else:
        free = total = 0 if cfg.memory_limit_gb is None else limit
    return DeviceMemory(
        total_bytes=min(total, limit), free_bytes=min(free, limit), cuda=dev.type == "cuda",
        micro_batch=cfg.micro_batch, seq_len=cfg.seq_len, in_flight=cfg.in_flight,
        activation_cache=cfg.activation_cache, precision=resolve_precision(cfg.precision, device),
        recompute=cfg.recompute,
    )  # fmt: skip


def build_stage_compute(
    run: RunInfo, stage: int, cfg: NodeConfig, device: str
) -> tuple[StageCompute, float]:
    """This node's stage of `run` with its inner settings, and the stage's measured
    tokens/s (call on the torch worker: it builds and probes the model)."""
    inner = InnerConfig(
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        inner_batch_tokens=cfg.inner_batch_tokens,
        cache_size=cfg.activation_cache,
        # twice what this node's own micro-batches need
        cache_tokens=2 * cfg.activation_cache * cfg.micro_batch * cfg.seq_len,
        precision=resolve_precision(cfg.precision, device),
        recompute=cfg.recompute,
    )
    model_cfg = run_model_config(
        run.model_preset, seed=run.seed, vocab_size=run.vocab_size, split=run.stage_layers
    )
    compute = StageCompute(model_cfg, stage, run.n_stages, run.codec, inner, device)
    return compute, throughput_probe(compute, cfg.micro_batch, cfg.seq_len)
