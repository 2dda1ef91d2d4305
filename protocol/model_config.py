"""The model's shape, pure: `ModelConfig`, the presets, and how layers split into stages.

The coordinator reads it to size stages against the memory nodes report, and the node
builds its torch modules from it (node.model). `run_model_config` is the one place a
run's settings (`RunInfo`: preset, seed, vocabulary) turn into the config every node of
the run builds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.corpus import VOCAB_SIZE  # the byte tokenizer's vocabulary (tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    d_model: int  # width of the residual stream (features)
    n_layers: int  # transformer blocks
    n_heads: int  # attention (query) heads; d_model must divide evenly
    d_ff: int  # SwiGLU hidden width (features)
    max_seq_len: int  # longest sequence the RoPE tables cover (tokens)
    subspace_rank: int = 0  # k of the residual subspace; 0 = unconstrained model
    seed: int = 0  # run seed: U, E0 and the initial weights derive from it
    vocab_size: int = VOCAB_SIZE  # tokens (256: the byte tokenizer)
    rope_base: float = 10000.0  # RoPE frequency base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    # key/value heads (grouped-query attention, as in Llama); 0 = n_heads (plain attention)
    n_kv_heads: int = 0
    # layers of each stage when the model runs as len(stage_layers) stages, so stages can
    # fit unequal device memory; () = an even split (`stage_layers` below)
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name}={getattr(self, name)} must be >= 1")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"model config: d_model={self.d_model} must split into n_heads={self.n_heads}"
                " heads of even width"
            )
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            raise ValueError(
                f"model config: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if not 0 <= self.subspace_rank <= self.d_model:
            raise ValueError(
                f"model config: subspace_rank={self.subspace_rank} must be in 0..{self.d_model}"
            )
        if self.stage_layers:
            check_split(self.stage_layers, self.n_layers, len(self.stage_layers))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"model config: unknown fields {sorted(unknown)}")
        try:
            if "stage_layers" in data:
                data = {**data, "stage_layers": tuple(data["stage_layers"])}
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"model config: {exc}") from exc

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def layers_of(self, stage: int, n_stages: int) -> range:
        """The layers of `stage` of `n_stages`: `stage_layers` when it is set for that many
        stages, else an even split (the whole model, n_stages 1, is every layer)."""
        if self.stage_layers and n_stages != 1:
            if len(self.stage_layers) != n_stages:
                raise ValueError(
                    f"model config: stage_layers={list(self.stage_layers)} is a split into"
                    f" {len(self.stage_layers)} stages, not {n_stages}"
                )
            return stage_layers(self.n_layers, stage, n_stages, self.stage_layers)
        return stage_layers(self.n_layers, stage, n_stages)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_params(self) -> int:
        """Trainable parameters of the whole model (the frozen subspace buffers excluded)."""
        d, kv = self.d_model, self.kv_heads * self.head_dim
        attn = 2 * d * d + 2 * d * kv  # q and out, k and v
        per_layer = attn + 3 * d * self.d_ff + 2 * d
        return 2 * self.vocab_size * d + self.n_layers * per_layer + d


PRESETS: dict[str, ModelConfig] = {
    # Multi-process tests: a stage forward+backward of a small micro-batch in a few ms.
    # Ranks: twice what int8 coefficients would afford, for the 4-bit `subspace_int4`
    # codec at the same bytes (docs/compression.md).
    "tiny": ModelConfig(
        d_model=128, n_layers=4, n_heads=4, d_ff=256, max_seq_len=256, subspace_rank=32
    ),
    # The demo: 2 stages x 2 replicas on 2 CPU cores in about five minutes.
    "small": ModelConfig(
        d_model=256, n_layers=4, n_heads=4, d_ff=512, max_seq_len=256, subspace_rank=48
    ),
    # `agora bench compression`: wide enough that the subspace pays (d/k = 16 at 4 bits
    # a coefficient: 110x), small enough to train three times on 2 CPU cores in minutes.
    "bench": ModelConfig(
        d_model=512, n_layers=4, n_heads=8, d_ff=512, max_seq_len=256, subspace_rank=32
    ),
    # The Llama-shaped family at test size (grouped-query attention, no subspace): the
    # tests run a tokenizer, a Parquet dataset and the Hugging Face export through it.
    "llama-tiny": ModelConfig(
        d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=352, max_seq_len=256
    ),
    # Llama-shaped presets for GPUs (grouped-query attention, SwiGLU of about 8/3 d, RoPE).
    # No residual subspace: run them with a non-subspace boundary codec (fp16 or int8).
    # Sizes with the byte vocabulary; a 32k-token tokenizer adds 2 x 32k x d_model. Device
    # memory per stage: protocol.memory (`agora memory`); the figures below are its
    # estimates at the node's defaults with bf16 (largest stage; README.md, "consumer GPU").
    # 76M (125M with 32k tokens): the whole model needs 2.7 GiB, an 8 GB card holds it.
    "llama-125m": ModelConfig(
        d_model=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        d_ff=2048,
        max_seq_len=2048,
        rope_base=10000.0,
    ),  # fmt: skip
    # 284M (349M with 32k tokens): whole 8.3 GiB (12 GB card), a stage of two 7.3 GiB.
    "llama-350m": ModelConfig(
        d_model=1024,
        n_layers=24,
        n_heads=16,
        n_kv_heads=8,
        d_ff=2816,
        max_seq_len=2048,
        rope_base=10000.0,
    ),  # fmt: skip
    # 974M (1.1B with 32k tokens; Llama 3.2 1B's shape): a stage of two 18.8 GiB (24 GB
    # card); a stage of four 6.7 GiB with --recompute (8 GB).
    "llama-1b": ModelConfig(
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        d_ff=8192,
        max_seq_len=2048,
        rope_base=500000.0,
    ),  # fmt: skip
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}") from None


def stage_layers(n_layers: int, stage: int, n_stages: int, split: Sequence[int] = ()) -> range:
    """The contiguous layers of `stage`.

    `split` gives the layer count of every stage (the run's `stage_layers`); empty means
    an even split where earlier stages take the remainder first.
    """
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"n_stages={n_stages} must be in 1..n_layers={n_layers}")
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage={stage} must be in 0..{n_stages - 1}")
    if split:
        check_split(split, n_layers, n_stages)
        start = sum(split[:stage])
        return range(start, start + split[stage])
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_split(split: Sequence[int], n_layers: int, n_stages: int) -> None:
    """`ValueError` unless `split` gives each of `n_stages` stages >= 1 of `n_layers` layers."""
    if len(split) != n_stages or min(split) < 1 or sum(split) != n_layers:
        raise ValueError(
            f"stage_layers={list(split)} must give each of the {n_stages} stages at least one"
            f" layer, {n_layers} in all"
        )


def run_model_config(
    preset_name: str, *, seed: int, vocab_size: int = 0, split: Sequence[int] = ()
) -> ModelConfig:
    """The config every node of a run builds: the preset with the run's seed, vocabulary
    (0 keeps the preset's, the byte vocabulary) and layers per stage (() = even)."""
    cfg = preset(preset_name).replace(seed=seed, stage_layers=tuple(split))
    return cfg.replace(vocab_size=vocab_size) if vocab_size else cfg
