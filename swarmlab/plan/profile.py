"""Per-stage costs for `agora plan`: compute seconds per micro-batch and wire bytes.

Two sources, each labelled in every report:
- `measure_cpu`: the real stages (`node.stage_compute.StageCompute`, the node's own
  forward, backward, codecs and inner step) timed here on one torch thread, chained as
  the pipeline chains them; the median of `reps` micro-batches after a warm-up;
- `device_profile`: a GPU class from `fleet.DEVICES` (vendor peak TFLOPS times an
  assumed MFU), with 6 FLOPs per parameter and token plus attention. Its wire bytes still
  come from the real codec, run here on a tensor of the boundary's shape.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from node.compression import SUBSPACE_CODECS, BoundaryCodec, wire_size
from node.stage_compute import InnerConfig, StageCompute
from node.subspace import Subspace, make_subspace
from protocol.model_config import ModelConfig
from swarmlab.plan.fleet import DEVICE_SOURCE, DEVICES, NodeSettings

TOKEN_BYTES = 2  # bytes per token id in a Forward message (besides the activations)


@dataclass(kw_only=True, slots=True)
class StageCost:
    fwd_s: float  # forward of one micro-batch (last stage: forward, loss and backward) (s)
    bwd_s: float  # backward of one micro-batch (0 on the last stage) (s)
    step_s: float  # one inner optimizer step (s)
    fwd_bytes: int  # Forward message to the next stage, per micro-batch (bytes)
    bwd_bytes: int  # the input gradient sent back to the previous stage (bytes)
    params: int  # trainable parameters of the stage (count)


@dataclass(kw_only=True, slots=True)
class Profile:
    device: str  # cpu, or a fleet.DEVICES name
    source: str  # how the seconds were obtained
    stages: list[StageCost]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        return cls(
            device=str(data["device"]),
            source=str(data["source"]),
            stages=[StageCost(**s) for s in data["stages"]],
        )

    def scaled(self, factor: float) -> Profile:
        """The same stages with every compute time `factor` times as long."""
        stages = [
            dataclasses.replace(
                c, fwd_s=c.fwd_s * factor, bwd_s=c.bwd_s * factor, step_s=c.step_s * factor
            )
            for c in self.stages
        ]
        source = self.source if factor == 1.0 else f"{self.source}, x{factor:.3f}"
        return Profile(device=self.device, source=source, stages=stages)

    def averaged(self, other: Profile) -> Profile:
        """Each stage's compute times averaged with `other`'s (the same stages timed
        again); bytes and parameters are this profile's."""
        stages = [
            dataclasses.replace(
                a,
                fwd_s=(a.fwd_s + b.fwd_s) / 2,
                bwd_s=(a.bwd_s + b.bwd_s) / 2,
                step_s=(a.step_s + b.step_s) / 2,
            )
            for a, b in zip(self.stages, other.stages, strict=True)
        ]
        return dataclasses.replace(self, stages=stages, source=f"{self.source}, averaged")

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "source": self.source,
            "stages": [{k: getattr(s, k) for k in StageCost.__slots__} for s in self.stages],
        }


def _tokens(node: NodeSettings, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(node.micro_batch, node.seq_len + 1))


def measure_cpu(model: ModelConfig, n_stages: int, node: NodeSettings, *, reps: int = 8) -> Profile:
    """Time the real stages on this CPU, one torch thread, one micro-batch at a time."""
    torch.set_num_threads(1)
    inner = InnerConfig(
        lr=1e-3,
        warmup_steps=1,
        weight_decay=0.1,
        inner_batch_tokens=1 << 40,  # steps are timed on their own below
        cache_size=4,
        precision="fp32",
        recompute=node.recompute,
    )
    stages = [StageCompute(model, s, n_stages, node.codec, inner) for s in range(n_stages)]
    fwd: list[list[float]] = [[] for _ in stages]
    bwd: list[list[float]] = [[] for _ in stages]
    fwd_b, bwd_b = [0] * n_stages, [0] * n_stages
    for rep in range(reps + 2):
        tok = _tokens(node, rep)
        mb = f"mb{rep}"
        hidden: list[object] = [None]
        grad = None
        for s, st in enumerate(stages):
            t0 = time.perf_counter()
            out = st.forward(mb, tok, hidden[-1])  # type: ignore[arg-type]
            fwd[s].append(time.perf_counter() - t0)
            if st.is_last:
                grad = out[0]  # type: ignore[index]
                bwd_b[s] = wire_size(grad) if grad is not None else 0
            else:
                fwd_b[s] = wire_size(out) + tok.size * TOKEN_BYTES  # type: ignore[arg-type]
                hidden.append(out)
        for s in range(n_stages - 2, -1, -1):
            t0 = time.perf_counter()
            grad = stages[s].backward(mb, tok, hidden[s], grad)  # type: ignore[arg-type]
            bwd[s].append(time.perf_counter() - t0)
            bwd_b[s] = wire_size(grad) if grad is not None else 0
    steps = []
    for st in stages:
        t0 = time.perf_counter()
        st.step()
        steps.append(time.perf_counter() - t0)
    med = [statistics.median(x[2:]) for x in fwd]
    medb = [statistics.median(x[2:]) if x else 0.0 for x in bwd]
    return Profile(
        device="cpu",
        source=f"measured here: the node's StageCompute, 1 torch thread, median of {reps}",
        stages=[
            StageCost(
                fwd_s=med[s],
                bwd_s=medb[s],
                step_s=steps[s],
                fwd_bytes=fwd_b[s],
                bwd_bytes=bwd_b[s],
                params=sum(p.numel() for p in stages[s].parameters()),
            )
            for s in range(n_stages)
        ],
    )


@functools.lru_cache(maxsize=4)
def _subspace(model: ModelConfig) -> Subspace:
    """The run's basis (seconds to derive at 8B scale: kept for the next stage count)."""
    return make_subspace(model.seed, model.d_model, model.subspace_rank, model.vocab_size)


def codec_bytes(model: ModelConfig, n_stages: int, node: NodeSettings) -> tuple[int, int]:
    """(Forward, backward) wire bytes of one micro-batch at a boundary, from the real codec
    run on random activations of the boundary's shape (one sequence, scaled up)."""
    sub = None
    if node.codec in SUBSPACE_CODECS:
        if not model.subspace_rank:
            raise ValueError(f"codec {node.codec} needs a model with subspace_rank > 0")
        sub = _subspace(model)
    codec = BoundaryCodec(node.codec, model.d_model, sub)
    seq = min(node.seq_len, 256)
    tok = torch.randint(0, 256, (1, seq))
    x = torch.randn(1, seq, model.d_model)
    fwd = wire_size(codec.encode_forward(x, tok))
    bwd = wire_size(codec.encode_backward(x * 1e-3, tok))
    scale = node.micro_batch * node.seq_len / seq
    extra = node.micro_batch * (node.seq_len + 1) * TOKEN_BYTES
    return int(fwd * scale) + extra, int(bwd * scale)


def stage_flops(model: ModelConfig, n_stages: int, stage: int, seq_len: int) -> tuple[int, float]:
    """(Parameters, training FLOPs per token) of a stage: 6 per parameter (2 forward, 4
    backward) plus attention's 12 x layers x d_model x seq_len."""
    layers = len(model.layers_of(stage, n_stages))
    d, kv = model.d_model, model.kv_heads * model.head_dim
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * model.d_ff + 2 * d
    params = layers * per_layer
    if stage == 0:
        params += model.vocab_size * d
    if stage == n_stages - 1:
        params += model.vocab_size * d + d
    return params, 6.0 * params + 12.0 * layers * d * seq_len


def device_profile(model: ModelConfig, n_stages: int, node: NodeSettings, device: str) -> Profile:
    """A GPU class's stage costs from its published throughput (see fleet.DEVICES)."""
    spec = DEVICES[device]
    rate = spec["tflops"] * 1e12 * spec["mfu"]  # FLOP/s
    fwd_bytes, bwd_bytes = codec_bytes(model, n_stages, node)
    tokens = node.micro_batch * node.seq_len
    out = []
    for s in range(n_stages):
        params, per_token = stage_flops(model, n_stages, s, node.seq_len)
        if node.recompute:  # the forward runs again in backward
            per_token *= 4 / 3
        total = per_token * tokens / rate
        last = s == n_stages - 1
        out.append(
            StageCost(
                fwd_s=total if last else total / (4 if node.recompute else 3),
                bwd_s=0.0 if last else total * (3 / 4 if node.recompute else 2 / 3),
                # AdamW is memory-bound: about 32 bytes read or written per parameter
                step_s=32.0 * params / (spec["mem_gbps"] * 1e9),
                fwd_bytes=0 if last else fwd_bytes,
                bwd_bytes=0 if s == 0 else bwd_bytes,
                params=params,
            )
        )
    return Profile(
        device=device,
        source=f"{DEVICE_SOURCE} ({spec['mfu']:.2f}); wire bytes from the real codec",
        stages=out,
    )
