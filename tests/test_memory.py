"""protocol.memory, the per-stage device-memory estimate: its parameter and buffer counts
equal the torch stages' for every preset, its per-block activations equal the tensors
torch's autograd saves (fp32, bf16 autocast on the CPU, recompute), and it behaves as a
size should (hypothesis): monotonic in layers and in the micro-batch settings, never
more with recompute, the parts sum to the total."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.model import build_stage
from protocol.memory import (
    COMMON_GPUS,
    CUDA_OVERHEAD,
    GIB,
    NodeSettings,
    balanced_split,
    block_activation_bytes,
    fitting_stages,
    stage_buffer_bytes,
    stage_need,
    stage_needs,
    stage_params,
)
from protocol.model_config import PRESETS, ModelConfig, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_and_buffer_counts_equal_the_torch_stages(name: str) -> None:
    cfg = preset(name)
    splits = [(1, ()), (2, ()), (3, ())]
    if cfg.n_layers >= 6:
        splits.append((3, (1, cfg.n_layers - 3, 2)))
    for n_stages, split in splits:
        c = cfg.replace(stage_layers=split)
        for k in range(n_stages):
            with torch.device("meta"):  # shapes only: no memory, no init cost
                stage = build_stage(c, k, n_stages)
            assert stage_params(c, k, n_stages) == sum(p.numel() for p in stage.parameters())
            buffers = sum(b.numel() * b.element_size() for b in stage.buffers())
            assert stage_buffer_bytes(c) == buffers, (name, n_stages, k)
            need = stage_need(c, k, n_stages, NodeSettings())
            assert need.weights == 4 * need.params and need.optimizer == 8 * need.params


def _saved_bytes(stage: torch.nn.Module, x: torch.Tensor, precision: str) -> tuple[int, int]:
    """(activation bytes, bf16 weight-cast bytes) autograd keeps for `stage(x)`'s backward,
    each storage counted once, the stage's own parameters and buffers left out."""
    own = {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]}
    shapes = {tuple(p.shape) for p in stage.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}  # a linear keeps its weight transposed
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            cast = t.dtype == torch.bfloat16 and tuple(t.shape) in shapes
            seen[ptr] = (t.untyped_storage().nbytes(), cast)
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x)
    return sum(n for n, c in seen.values() if not c), sum(n for n, c in seen.values() if c)


# Shapes that no activation shares with a weight (so casts are told apart by shape):
# grouped-query and plain attention.
GQA = ModelConfig(d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=160, max_seq_len=64)
PLAIN = GQA.replace(n_kv_heads=0)


@pytest.mark.parametrize("cfg", [GQA, PLAIN], ids=["gqa", "plain"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [False, True])
def test_block_activations_equal_what_autograd_saves(
    cfg: ModelConfig, precision: str, recompute: bool
) -> None:
    b, t = 3, 40
    stage = build_stage(cfg, 1, 3)  # a middle stage: one block, hidden in and out
    stage.recompute = recompute
    stage.train()
    x = torch.randn(b, t, cfg.d_model, requires_grad=True)
    acts, casts = _saved_bytes(stage, x, precision)
    assert acts == b * t * block_activation_bytes(cfg, precision, recompute)
    # bf16 autocast keeps each forward's cast of every weight matrix (not with recompute)
    need = stage_need(cfg, 1, 3, NodeSettings(precision=precision, recompute=recompute))
    if precision == "fp32" or recompute:
        assert casts == 0
    else:
        assert casts == need.working_copies // need.retained


def test_a_stage_keeps_what_the_estimate_counts_per_micro_batch() -> None:
    """Whole stages at the estimate's own shape: autograd's saved tensors plus the output
    the stage keeps for backward are the estimate's activations per micro-batch, up to the
    token ids and (last stage) the norm and log-softmax it adds on top."""
    cfg = GQA.replace(n_layers=6)
    s = NodeSettings(micro_batch=2, seq_len=24, in_flight=2, activation_cache=3)
    tokens = torch.randint(0, cfg.vocab_size, (s.micro_batch, s.seq_len))
    for k in range(3):
        stage = build_stage(cfg, k, 3).train()
        x = tokens if k == 0 else torch.randn(2, 24, cfg.d_model, requires_grad=True)
        acts, _ = _saved_bytes(stage, x, "fp32")
        need = stage_need(cfg, k, 3, s)
        per_mb = need.activations // need.retained
        kept = acts + (0 if k == 2 else 4 * cfg.d_model * s.micro_batch * s.seq_len)
        assert kept <= per_mb <= 1.25 * kept, (k, kept, per_mb)


def test_the_outer_loop_copies_take_no_device_memory_and_parts_sum_to_the_total() -> None:
    need = stage_need(preset("llama-1b"), 0, 2, NodeSettings(precision="bf16"))
    assert need.outer == 0  # theta_g, momentum and snapshot live in CPU shared memory
    assert need.total == sum(b for _, b in need.parts())
    assert need.overhead == CUDA_OVERHEAD
    assert stage_need(preset("tiny"), 0, 2, NodeSettings(cuda=False)).overhead == 0
    line = need.describe()
    for part in ("weights", "gradients", "optimizer", "bf16 copies", "activations", "margin"):
        assert part in line, line


SETTINGS = st.builds(
    NodeSettings,
    micro_batch=st.integers(1, 16),
    seq_len=st.integers(1, 1024),
    in_flight=st.integers(1, 8),
    activation_cache=st.integers(1, 32),
    precision=st.sampled_from(["fp32", "bf16"]),
    recompute=st.booleans(),
)
NAMES = st.sampled_from(sorted(PRESETS))


@settings(max_examples=200, deadline=None)
@given(NAMES, SETTINGS, st.integers(1, 4), st.data())
def test_more_layers_or_a_bigger_micro_batch_never_need_less(
    name: str, s: NodeSettings, n_stages: int, data: st.DataObject
) -> None:
    cfg = preset(name)
    n_stages = min(n_stages, cfg.n_layers - 1) if cfg.n_layers > 1 else 1
    k = data.draw(st.integers(0, n_stages - 1))
    # one more layer on stage k, one fewer elsewhere
    base = [1] * n_stages
    base[k] += cfg.n_layers - n_stages - 1
    base[(k + 1) % n_stages] += 1
    more = list(base)
    more[k] += 1
    more[(k + 1) % n_stages] -= 1
    if n_stages == 1:
        base = more = [cfg.n_layers]
    small = stage_need(cfg.replace(stage_layers=tuple(base)), k, n_stages, s).total
    large = stage_need(cfg.replace(stage_layers=tuple(more)), k, n_stages, s).total
    assert large >= small
    for change in ("micro_batch", "seq_len", "in_flight", "activation_cache"):
        bigger = s.__class__(**{**_fields(s), change: getattr(s, change) + 1})
        assert stage_need(cfg, k, n_stages, bigger).total >= stage_need(cfg, k, n_stages, s).total


def _fields(s: NodeSettings) -> dict[str, object]:
    return {f: getattr(s, f) for f in s.__slots__}


@settings(max_examples=200, deadline=None)
@given(NAMES, SETTINGS, st.integers(1, 4))
def test_recompute_never_needs_more(name: str, s: NodeSettings, n_stages: int) -> None:
    cfg = preset(name)
    n_stages = min(n_stages, cfg.n_layers)
    on = NodeSettings(**{**_fields(s), "recompute": True})
    off = NodeSettings(**{**_fields(s), "recompute": False})
    for k in range(n_stages):
        assert stage_need(cfg, k, n_stages, on).total <= stage_need(cfg, k, n_stages, off).total


@settings(max_examples=60, deadline=None)
@given(NAMES, SETTINGS, st.integers(1, 4), st.integers(0, 64 * GIB))
def test_the_balanced_split_is_no_worse_than_the_even_one(
    name: str, s: NodeSettings, n_stages: int, free: int
) -> None:
    cfg = preset(name)
    n_stages = min(n_stages, cfg.n_layers)
    split = balanced_split(cfg, n_stages, s)
    assert len(split) == n_stages and sum(split) == cfg.n_layers and min(split) >= 1
    even = stage_needs(cfg, n_stages, s)
    balanced = stage_needs(cfg.replace(stage_layers=tuple(split)), n_stages, s)
    assert max(n.total for n in balanced) <= max(n.total for n in even)
    # a stage that fits some memory still fits more
    fits = fitting_stages(even, free)
    assert set(fits) <= set(fitting_stages(even, free + GIB))


# README.md's table ("A volunteer on a consumer GPU"): the largest stage in GiB, at the
# node's defaults with bf16, plain and with --recompute
README_TABLE = [
    ("llama-125m", 1, (), 2.7, 2.3),
    ("llama-350m", 1, (), 8.3, 7.0),
    ("llama-350m", 2, (), 7.3, 3.9),
    ("llama-1b", 2, (), 18.8, 11.8),
    ("llama-1b", 4, (), 23.2, 6.7),
    ("llama-1b", 4, (5, 2, 2, 7), 12.0, None),
]


@pytest.mark.parametrize(("name", "n_stages", "split", "plain", "recompute"), README_TABLE)
def test_the_figures_readme_quotes(
    name: str, n_stages: int, split: tuple[int, ...], plain: float, recompute: float | None
) -> None:
    cfg = preset(name).replace(stage_layers=split)
    for value, rec in ((plain, False), (recompute, True)):
        if value is not None:
            needs = stage_needs(cfg, n_stages, NodeSettings(precision="bf16", recompute=rec))
            assert round(max(n.total for n in needs) / GIB, 1) == value, (name, n_stages, rec)
    if split:
        s = NodeSettings(precision="bf16")
        assert balanced_split(preset(name), n_stages, s) == list(split)  # `--balance`'s
    # a middle stage keeps activation_cache micro-batches, each with its bf16 casts
    middle = stage_need(preset("llama-1b"), 1, 4, NodeSettings(precision="bf16"))
    assert middle.total > COMMON_GPUS["12 GB"] and middle.retained == 17


def test_agora_memory_prints_each_stage_and_the_cards_it_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from coordinator.memory_cli import main

    argv = ["--preset", "llama-1b", "--stages", "4", "--balance"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[1][3:5] == ["23.17", "GiB"] and rows[1][5:] == ["24", "GB"]  # a middle stage
    assert rows[3][5:] == ["8", "GB", "12", "GB", "24", "GB"]  # the last stage keeps one
    assert "stage 1/4 (4 layers, 243.3M params, activations of 17 micro-batches)" in out
    assert "balanced: stage_layers = [5, 2, 2, 7]" in out
    assert main(["--preset", "tiny", "--stages", "2", "--stage-layers", "1,1"]) == 2
    assert "stage_layers=[1, 1]" in capsys.readouterr().err
