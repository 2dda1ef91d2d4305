"""How much device memory one pipeline stage needs: an estimate, pure (no torch, no I/O).

The coordinator places a node only on a stage whose estimate fits the free memory the
node reported at join (`protocol.control.DeviceMemory`), `agora memory` prints it, and
the run organiser picks `stage_layers` with it. `stage_need` names every part
(`StageNeed`); the figures follow from the code that allocates them:

- **Weights, gradients, optimizer state**: the stage's parameters in fp32 (4 bytes
  each), their fp32 gradients (4) and AdamW's two fp32 moments (8): 16 bytes a
  parameter, with bf16 autocast too (node/stage_compute.py keeps the master copy fp32).
  Stage 0 holds the token embedding, the last stage the final norm and the LM head
  (`ModelConfig.layers_of` gives the blocks between).
- **Buffers**: the RoPE tables, and with a residual subspace its basis U and the frozen
  embedding E0 (fp32, on every stage).
- **bf16 working copies**: autocast casts each weight matrix to bf16 inside the forward
  and the autograd graph keeps the cast, so every micro-batch whose activations are kept
  holds its own copy (2 bytes a matrix parameter each). With `recompute` only the one
  copy of the forward in progress is alive.
- **Weight stash**: an inner step that runs while micro-batches are downstream first
  copies the parameters their graphs saved (node/weight_stash.py), so their backwards
  run at the weights of their forwards: one copy of the blocks' fp32 weights (under bf16
  autocast the graphs keep the matrices' casts, so only the norm weights), on a stage
  that keeps more than one micro-batch and does not recompute its blocks.
- **Activations**: what autograd keeps of each retained micro-batch. Per token and block
  (counted from the tensors `node.model.Block` saves; tests/test_memory.py checks it
  against torch's saved tensors on the CPU): fp32 `4 (11 d + 4 d_ff + heads + 2)` bytes;
  bf16 autocast `30 d + 8 d_ff + 4 heads + 8` (the residual stream and the norms stay
  fp32); with `recompute` only the block's fp32 input, `4 d`. Without grouped-query
  attention the value heads are a view into the fused qkv output, which keeps all of it
  (`+8 d` fp32, `+4 d` bf16). Attention is the fused kernel (no T x T matrix). A stage
  also keeps its fp32 output for the backward (`4 d`), stage 0 its token ids, and the
  last stage the final norm and the log-softmax over the vocabulary. Retained
  micro-batches: stage 0 keeps its `in_flight` ones, a middle stage up to
  `activation_cache` (+1 being computed), the last stage one (it runs forward and
  backward at once). Sized at the node's own micro-batch shape (senders with longer
  sequences could fill a middle stage's cache up to its token bound, twice that).
- **Transient**: the largest of the optimizer step's temporaries (torch's foreach AdamW
  allocates one fp32 tensor a parameter), one block's backward (its gradients; with
  `recompute` also its recomputed activations; on the last stage also the loss's
  gradient over the vocabulary) and the outer merge (node/diloco.py moves one parameter
  tensor at a time to the device: four fp32 temporaries of the largest tensor).
- **Outer loop's copies**: none on the device. theta_g, the outer momentum and the round's
  snapshot are flat fp32 buffers in CPU shared memory (/dev/shm, node/outer_link.py),
  used by the outer process on the CPU.
- **Margin**: 10 % of the sum (allocator fragmentation), plus a fixed allowance for the
  CUDA context, cuBLAS workspaces and kernels loaded on first use (`CUDA_OVERHEAD`,
  counted for CUDA devices only).

It is an estimate: not yet checked against a GPU's measured peak (the parameter counts
and per-block saved tensors are checked on the CPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.control import DeviceMemory
from protocol.model_config import ModelConfig, check_split

PRECISIONS = ("fp32", "bf16")  # a node's resolved compute precision
GIB = 1 << 30  # bytes
CUDA_OVERHEAD = 512 << 20  # bytes: CUDA context, cuBLAS workspaces, lazily loaded kernels
MARGIN = 0.10  # fraction of the estimate added for allocator fragmentation
# the consumer cards `agora memory` reports against (bytes; a "GB" card holds GiB)
COMMON_GPUS: dict[str, int] = {"8 GB": 8 * GIB, "12 GB": 12 * GIB, "24 GB": 24 * GIB}

# bytes a trainable parameter holds: fp32 weight 4, gradient 4, AdamW moments 8
WEIGHT_BYTES, GRAD_BYTES, ADAM_BYTES = 4, 4, 8
STEP_BYTES = 4  # bytes a parameter of the foreach AdamW step's temporary (sqrt of v)
CAST_BYTES = 2  # bytes a matrix parameter of one bf16 autocast copy
MERGE_BYTES = 16  # bytes an element of the largest tensor during the outer merge (4 x fp32)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSettings:
    """How a node runs its stage: the settings the estimate depends on."""

    micro_batch: int = 8  # sequences per micro-batch
    seq_len: int = 128  # tokens per sequence
    in_flight: int = 4  # micro-batches stage 0 keeps in the pipeline at once
    activation_cache: int = 16  # micro-batches whose activations a later stage keeps
    precision: str = "fp32"  # fp32 | bf16 (autocast; the master weights stay fp32)
    recompute: bool = False  # recompute each block's activations in backward
    cuda: bool = True  # count the fixed CUDA allowance (a CUDA device)

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "in_flight", "activation_cache"):
            if getattr(self, name) < 1:
                raise ValueError(f"memory settings: {name}={getattr(self, name)} must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"memory settings: precision must be one of {PRECISIONS}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageNeed:
    """The device bytes one stage needs, by part (`total` is what must fit)."""

    stage: int  # the stage's index
    n_stages: int  # stages of the run
    layers: int  # transformer blocks on the stage
    params: int  # trainable parameters (count)
    retained: int  # micro-batches whose activations are kept at once (count)
    weights: int  # bytes: fp32 parameters
    gradients: int  # bytes: fp32 gradients
    optimizer: int  # bytes: AdamW's two fp32 moments
    buffers: int  # bytes: RoPE tables, subspace basis and frozen embedding
    working_copies: int  # bytes: bf16 autocast casts of the weight matrices
    stash: int  # bytes: the weights cached graphs saved, copied at an inner step
    activations: int  # bytes: saved tensors of the retained micro-batches
    transient: int  # bytes: the largest of optimizer step, one backward, outer merge
    transient_cause: str  # which of the three `transient` is
    outer: int  # bytes on the device for theta_g, momentum, snapshot: 0 (CPU shm)
    margin: int  # bytes: MARGIN of the above
    overhead: int  # bytes: the fixed CUDA allowance (0 off CUDA)

    @property
    def total(self) -> int:
        """Bytes the stage needs free on the device."""
        return sum(b for _, b in self.parts())

    def parts(self) -> list[tuple[str, int]]:
        """(name, bytes) of every part, in the order `describe` prints them."""
        return [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer", self.optimizer),
            ("buffers", self.buffers),
            ("bf16 copies", self.working_copies),
            ("weight stash", self.stash),
            ("activations", self.activations),
            (f"transient ({self.transient_cause})", self.transient),
            ("outer loop", self.outer),
            ("margin", self.margin),
            ("CUDA", self.overhead),
        ]

    def describe(self) -> str:
        """One line: the total and its parts (parts of 0 bytes left out)."""
        parts = ", ".join(f"{name} {size(b)}" for name, b in self.parts() if b)
        kept = f"{self.retained} micro-batch{'es' if self.retained != 1 else ''}"
        layers = f"{self.layers} layer{'s' if self.layers != 1 else ''}"
        return (
            f"stage {self.stage}/{self.n_stages} ({layers},"
            f" {self.params / 1e6:.1f}M params, activations of {kept}):"
            f" {size(self.total)} = {parts}"
        )


def size(n: int) -> str:
    """`n` bytes for people: GiB with two decimals, MiB or KiB below that."""
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def block_params(cfg: ModelConfig) -> tuple[int, int]:
    """(all, matrix) parameters of one transformer block."""
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    matrices = d * (d + 2 * kv) + d * d + d * 2 * cfg.d_ff + cfg.d_ff * d
    return matrices + 2 * d, matrices  # + the two RMSNorm weights


def block_activation_bytes(cfg: ModelConfig, precision: str, recompute: bool = False) -> int:
    """Bytes one block keeps for backward per token (see the module docstring)."""
    d, ff, heads = cfg.d_model, cfg.d_ff, cfg.n_heads
    if recompute:
        return 4 * d  # the checkpointed block keeps only its fp32 input
    plain_attention = cfg.kv_heads == cfg.n_heads  # v is a view into the fused qkv output
    if precision == "bf16":
        return 30 * d + 8 * ff + 4 * heads + 8 + (4 * d if plain_attention else 0)
    return 4 * (11 * d + 4 * ff + heads + 2) + (8 * d if plain_attention else 0)


def stage_params(cfg: ModelConfig, stage: int, n_stages: int) -> int:
    """Trainable parameters of `stage` (the same count as the torch stage's numel)."""
    return _params(cfg, len(cfg.layers_of(stage, n_stages)), stage == 0, stage == n_stages - 1)


def _params(cfg: ModelConfig, layers: int, first: bool, last: bool) -> int:
    n = layers * block_params(cfg)[0]
    if first:
        n += cfg.vocab_size * cfg.d_model  # token embedding
    if last:
        n += cfg.d_model + cfg.vocab_size * cfg.d_model  # final norm, LM head
    return n


def stage_buffer_bytes(cfg: ModelConfig) -> int:
    """Bytes of a stage's fp32 buffers: RoPE cos/sin, subspace U and E0 (every stage)."""
    rope = 2 * cfg.max_seq_len * (cfg.head_dim // 2) * 4
    sub = (cfg.d_model * cfg.subspace_rank + cfg.vocab_size * cfg.d_model) * 4
    return rope + (sub if cfg.subspace_rank else 0)


def retained_micro_batches(stage: int, n_stages: int, s: NodeSettings) -> int:
    """Micro-batches whose activations a node on `stage` keeps at once."""
    if stage == n_stages - 1:
        return 1  # the last stage runs each micro-batch's forward and backward at once
    if stage == 0:
        return s.in_flight
    return s.activation_cache + 1  # a full cache plus the forward that evicts from it


def stage_need(cfg: ModelConfig, stage: int, n_stages: int, s: NodeSettings) -> StageNeed:
    """The estimate for a node with settings `s` on `stage` of `n_stages`."""
    return _estimate(cfg, stage, n_stages, len(cfg.layers_of(stage, n_stages)), s)


def _estimate(
    cfg: ModelConfig, stage: int, n_stages: int, layers: int, s: NodeSettings
) -> StageNeed:
    first, last = stage == 0, stage == n_stages - 1
    d, vocab = cfg.d_model, cfg.vocab_size
    params = _params(cfg, layers, first, last)
    matrices = layers * block_params(cfg)[1] + (vocab * d if last else 0)
    retained = retained_micro_batches(stage, n_stages, s)
    tokens = s.micro_batch * s.seq_len
    per_token = layers * block_activation_bytes(cfg, s.precision, s.recompute)
    if first:
        per_token += 16  # int64 token ids and targets
    if last:
        per_token += 12 * d + 12 + 4 * vocab  # final norm; log-softmax kept for backward
    else:
        per_token += 4 * d  # the stage's output, kept for the next stage's gradient
    casts = 0
    if s.precision == "bf16":
        casts = CAST_BYTES * matrices * (1 if s.recompute else retained)
    stash = 0
    if retained > 1 and not s.recompute:  # blocks' weights the graphs saved, or their norms'
        saved = layers * (block_params(cfg)[0] if s.precision == "fp32" else 2 * d)
        stash = WEIGHT_BYTES * saved
    # one block's gradients; with recompute also its recomputed activations, less the
    # input the checkpoint already keeps
    block = block_activation_bytes(cfg, s.precision)
    grads = block + (block - 4 * d if s.recompute else 0)
    backward = tokens * (grads + 8 * d + (8 * vocab if last else 0))
    qkv, gate_up = d * (d + 2 * cfg.kv_heads * cfg.head_dim), 2 * cfg.d_ff * d
    largest = max(qkv, gate_up, vocab * d if first or last else 0)
    transients = {
        "optimizer step": STEP_BYTES * params,
        "backward": backward,
        "outer merge": MERGE_BYTES * largest,
    }
    cause = max(transients, key=lambda k: transients[k])
    parts = dict(
        weights=WEIGHT_BYTES * params,
        gradients=GRAD_BYTES * params,
        optimizer=ADAM_BYTES * params,
        buffers=stage_buffer_bytes(cfg),
        working_copies=casts,
        stash=stash,
        activations=retained * tokens * per_token,
        transient=transients[cause],
        outer=0,
    )
    return StageNeed(
        stage=stage, n_stages=n_stages, layers=layers, params=params, retained=retained,
        transient_cause=cause, margin=int(MARGIN * sum(parts.values())),
        overhead=CUDA_OVERHEAD if s.cuda else 0, **parts,
    )  # fmt: skip


def stage_needs(cfg: ModelConfig, n_stages: int, s: NodeSettings) -> list[StageNeed]:
    """`stage_need` of every stage."""
    return [stage_need(cfg, k, n_stages, s) for k in range(n_stages)]


def fitting_stages(needs: Sequence[StageNeed], free_bytes: int) -> list[int]:
    """The stages whose need fits `free_bytes`."""
    return [n.stage for n in needs if n.total <= free_bytes]


def settings_of(report: DeviceMemory) -> NodeSettings:
    """The estimate's settings from what a node reported at join."""
    return NodeSettings(
        micro_batch=report.micro_batch, seq_len=report.seq_len, in_flight=report.in_flight,
        activation_cache=report.activation_cache, precision=report.precision,
        recompute=report.recompute, cuda=report.cuda,
    )  # fmt: skip


def refusal(needs: Sequence[StageNeed], report: DeviceMemory, asked: int | None = None) -> str:
    """Why a node that reported `report` gets no stage (`asked`: the stage it wanted): the
    need of that stage, or of the smallest, with its parts, the memory reported, and what
    would shrink the need."""
    need = needs[asked] if asked is not None else min(needs, key=lambda n: n.total)
    which = f"stage {asked}, asked for," if asked is not None else "the smallest stage"
    hints = [] if report.recompute else ["--recompute"]
    if need.retained > 1:
        hints.append("a smaller in_flight or activation_cache")
    hints += ["a smaller micro_batch or seq_len", "a run with more stages"]
    return (
        f"{which} needs {size(need.total)} but the device reports {size(report.free_bytes)}"
        f" free ({size(report.total_bytes)} total). {need.describe()}. To need less:"
        f" {', '.join(hints)}"
    )


def balanced_split(cfg: ModelConfig, n_stages: int, s: NodeSettings) -> list[int]:
    """Layers per stage (a `stage_layers` for `n_stages`) whose largest stage need is the
    smallest: the stages that hold the embedding, the head or more micro-batches get fewer
    blocks. Among equally good splits, one with a small spread of layer counts."""
    n = cfg.n_layers
    if not 1 <= n_stages <= n:
        raise ValueError(f"n_stages={n_stages} must be in 1..n_layers={n}")
    memo: dict[tuple[int, int], tuple[int, int, tuple[int, ...]]] = {}

    def best(k: int, m: int) -> tuple[int, int, tuple[int, ...]]:
        """(largest need, spread, split) of stages k.. holding the last m layers."""
        if (k, m) not in memo:
            left = n_stages - k
            options = []
            for c in [m] if left == 1 else range(1, m - left + 2):
                top, _, tail = best(k + 1, m - c) if left > 1 else (0, 0, ())
                split = (c, *tail)
                own = _estimate(cfg, k, n_stages, c, s).total
                options.append((max(own, top), max(split) - min(split), split))
            memo[(k, m)] = min(options)
        return memo[(k, m)]

    split = list(best(0, n)[2])
    check_split(split, n, n_stages)
    return split
