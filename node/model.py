"""The model: a Llama-shaped decoder-only transformer (RMSNorm, RoPE, SwiGLU, GQA) in stages.

Interface for the pipeline (and for the central trainer, which uses one stage):

- `build_stage(config, stage, n_stages) -> Stage` builds layers
  `config.layers_of(stage, n_stages)` of the model. Parameters are initialised
  per layer from `config.seed`, so every replica of a stage starts identical and the stages
  chained together equal `build_stage(config, 0, 1)` exactly.
- Stage 0 takes int64 tokens [B, T] (values below `config.vocab_size`) and owns the
  token embedding. The config itself (shape, presets, stage split) is pure and lives in
  protocol.model_config, so the coordinator can size stages without torch.
  Later stages take the hidden state [B, T, d] (float32), which the boundary codec
  reconstructs from the wire given the tokens (see node.compression).
- A non-last stage returns the hidden state [B, T, d]. The last stage owns the final
  norm and the LM head; `stage(x, targets)` returns the loss, the mean cross-entropy in
  nats per token, and `stage(x)` returns logits [B, T, vocab_size].
- With `config.subspace_rank > 0` the stage carries the run's basis U and frozen
  embedding E0 (node.subspace) and the residual stream is `E0[tokens] + U c`; call
  `node.subspace.project_grads_(stage)` before and `node.subspace.project_(stage)` after
  every optimizer step to keep it so.

State-dict keys are global (`blocks.<layer>.…`), so the full model's weights are the
union of its stages' and a stage loads its slice from a full export with
`load_stage_weights`. The export format is a directory holding `model.safetensors`
(the full model's state dict, fp32) and `config.json` (`{"format": "agora-model",
"version": 1, "model": ModelConfig fields}`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from node.subspace import Subspace, derive_seed, make_subspace, project_
from protocol.model_config import PRESETS, ModelConfig, preset, run_model_config, stage_layers

# node code reaches the model's shape through this module
__all__ = ["PRESETS", "ModelConfig", "preset", "run_model_config", "stage_layers"]
EXPORT_FORMAT = "agora-model"
EXPORT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


# --- layers -----------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * self.weight


def rope_tables(head_dim: int, max_seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, hd]; rotate pairs (x[..., :hd/2], x[..., hd/2:])."""
    t = x.shape[-2]
    c, s = cos[:t], sin[:t]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.qkv = nn.Linear(d, d + 2 * self.n_kv * self.head_dim, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)  # writes into the residual stream
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, d, bias=False)  # writes into the residual stream

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        hd, kv = self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.qkv(self.attn_norm(h)).split((d, kv, kv), dim=-1)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k, v = (z.view(b, t, self.n_kv, hd).transpose(1, 2) for z in (k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_heads:  # grouped-query attention: each kv head serves a group
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out_proj(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        out: torch.Tensor = h + self.down_proj(F.silu(gate) * up)
        return out

    def init_weights(self, gen: torch.Generator, n_layers: int) -> None:
        std = 0.02
        with torch.no_grad():
            for lin in (self.qkv, self.gate_up):
                lin.weight.normal_(0.0, std, generator=gen)
            for lin in (self.out_proj, self.down_proj):
                lin.weight.normal_(0.0, std / math.sqrt(2 * n_layers), generator=gen)


# --- stages -----------------------------------------------------------------------------


class Stage(nn.Module):
    """One contiguous slice of the model; see the module docstring for the interface."""

    def __init__(self, config: ModelConfig, stage: int, n_stages: int) -> None:
        super().__init__()
        self.config = config
        self.stage = stage
        self.n_stages = n_stages
        self.layers = config.layers_of(stage, n_stages)
        self.is_first = stage == 0
        self.is_last = stage == n_stages - 1
        # recompute each block's activations in backward instead of keeping them
        self.recompute = False
        d = config.d_model
        if self.is_first:
            self.embed = nn.Embedding(config.vocab_size, d)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in self.layers})
        if self.is_last:
            self.norm = RMSNorm(d, config.norm_eps)
            self.head = nn.Linear(d, config.vocab_size, bias=False)
        cos, sin = rope_tables(d // config.n_heads, config.max_seq_len, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._has_subspace = config.subspace_rank > 0
        if self._has_subspace:
            sub = make_subspace(config.seed, d, config.subspace_rank, config.vocab_size)
            self.register_buffer("u_basis", sub.basis, persistent=False)
            self.register_buffer("e0", sub.e0, persistent=False)
        self._init_weights()
        project_(self)

    @property
    def subspace(self) -> Subspace | None:
        if not self._has_subspace:
            return None
        return Subspace(basis=self.get_buffer("u_basis"), e0=self.get_buffer("e0"))

    def residual_writes(self) -> Iterator[torch.Tensor]:
        for block in self.blocks.values():
            assert isinstance(block, Block)
            yield block.out_proj.weight
            yield block.down_proj.weight

    def embedding_weights(self) -> Iterable[torch.Tensor]:
        return [self.embed.weight] if self.is_first else []

    def _init_weights(self) -> None:
        cfg = self.config
        with torch.no_grad():
            if self.is_first:
                gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "embed"))
                # With E0 carrying token identity the learnt part starts small.
                std = 0.02 if self._has_subspace else 1.0
                self.embed.weight.normal_(0.0, std, generator=gen)
            for i, block in self.blocks.items():
                assert isinstance(block, Block)
                block.init_weights(
                    torch.Generator().manual_seed(derive_seed(cfg.seed, "block", i)), cfg.n_layers
                )
            if self.is_last:
                gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "head"))
                self.head.weight.normal_(0.0, 0.02, generator=gen)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.embed(tokens)
        if self._has_subspace:
            h = h + self.get_buffer("e0")[tokens]
        return h

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise ValueError(f"stage 0 takes int64 tokens [B, T], got {x.dtype}{list(x.shape)}")
            h = self.embed_tokens(x)
        else:
            if x.dim() != 3 or x.shape[-1] != self.config.d_model:
                raise ValueError(
                    f"stage {self.stage} takes hidden [B, T, {self.config.d_model}],"
                    f" got {list(x.shape)}"
                )
            h = x
        if h.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence of {h.shape[1]} exceeds max_seq_len")
        for block in self.blocks.values():
            if self.recompute and self.training and torch.is_grad_enabled():
                h = checkpoint(block, h, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                h = block(h, self.rope_cos, self.rope_sin)
        if not self.is_last:
            return h
        logits: torch.Tensor = self.head(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def build_stage(config: ModelConfig, stage: int, n_stages: int) -> Stage:
    """Layers `config.layers_of(stage, n_stages)` of the model, initialised."""
    return Stage(config, stage, n_stages)


def build_model(config: ModelConfig) -> Stage:
    """The whole model as one stage (the central trainer's model)."""
    return Stage(config, 0, 1)


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices, none on norms and embeddings."""
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and not name.startswith("embed") else plain).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


# --- export format ------------------------------------------------------------------------


def save_export(model: nn.Module, config: ModelConfig, directory: Path) -> None:
    """Write `model.safetensors` + `config.json` (the format `agora export` produces)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()
    }
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": EXPORT_FORMAT})
    meta = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "model": config.to_dict()}
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def load_export(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an export directory: the model config and the full model's tensors."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise ValueError(f"export {directory}: missing {p.name}")
    try:
        meta = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"export {directory}: config.json is not JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise ValueError(f"export {directory}: config.json format is not {EXPORT_FORMAT!r}")
    if meta.get("version") != EXPORT_VERSION:
        raise ValueError(f"export {directory}: unsupported version {meta.get('version')!r}")
    if not isinstance(meta.get("model"), dict):
        raise ValueError(f"export {directory}: config.json lacks the 'model' map")
    return ModelConfig.from_dict(meta["model"]), load_file(str(w_path))


def load_stage_weights(stage: Stage, tensors: dict[str, torch.Tensor]) -> None:
    """Copy this stage's slice out of a full model's tensors (shapes are checked)."""
    own = stage.state_dict()
    missing = [k for k in own if k not in tensors]
    if missing:
        raise ValueError(
            f"weights lack {len(missing)} tensors of stage {stage.stage}: {missing[:3]}"
        )
    for k, v in own.items():
        if tensors[k].shape != v.shape:
            raise ValueError(
                f"weight {k}: shape {list(tensors[k].shape)}, expected {list(v.shape)}"
            )
    stage.load_state_dict({k: tensors[k] for k in own})
    project_(stage)
