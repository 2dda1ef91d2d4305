"""The staged model: chaining all stages equals the unsplit model, outputs and gradients."""

from __future__ import annotations

import json

import pytest
import torch

from node.model import (
    PRESETS,
    ModelConfig,
    Stage,
    build_model,
    build_stage,
    load_export,
    load_stage_weights,
    preset,
    save_export,
    stage_layers,
)
from node.subspace import project_

CFG = ModelConfig(d_model=32, n_layers=4, n_heads=4, d_ff=64, max_seq_len=32, subspace_rank=8)


def _chain(stages: list[Stage], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for s in stages[:-1]:
        h = s(h)
    out: torch.Tensor = stages[-1](h, y)
    return out


@pytest.mark.parametrize("rank,kv", [(0, 0), (8, 0), (0, 2), (0, 1)])
@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_chained_stages_equal_unsplit_model_in_loss_and_gradients(
    rank: int, kv: int, n_stages: int
) -> None:
    cfg = CFG.replace(subspace_rank=rank, n_kv_heads=kv, seed=7)
    full = build_model(cfg)
    stages = [build_stage(cfg, s, n_stages) for s in range(n_stages)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (3, 16), generator=gen)
    y = torch.randint(0, 256, (3, 16), generator=gen)
    loss_full = full(x, y)
    loss_chain = _chain(stages, x, y)
    torch.testing.assert_close(loss_chain, loss_full, rtol=0, atol=0)
    torch.autograd.backward([loss_full, loss_chain])
    grads_full = {k: p.grad for k, p in full.named_parameters()}
    seen = set()
    for s in stages:
        for k, p in s.named_parameters():
            assert p.grad is not None and grads_full[k] is not None, k
            torch.testing.assert_close(p.grad, grads_full[k], rtol=1e-5, atol=1e-7)
            seen.add(k)
    assert seen == set(grads_full)


def test_chained_logits_equal_unsplit() -> None:
    full = build_model(CFG)
    stages = [build_stage(CFG, s, 2) for s in range(2)]
    x = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(stages[1](stages[0](x)), full(x), rtol=0, atol=0)


def test_stage_layers_partition_the_model() -> None:
    for n_layers in range(1, 9):
        for n in range(1, n_layers + 1):
            got = [i for s in range(n) for i in stage_layers(n_layers, s, n)]
            assert got == list(range(n_layers))
            sizes = [len(stage_layers(n_layers, s, n)) for s in range(n)]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="n_stages"):
        stage_layers(2, 0, 3)
    with pytest.raises(ValueError, match="stage="):
        stage_layers(4, 4, 4)


def test_stage_inputs_are_checked() -> None:
    s0, s1 = build_stage(CFG, 0, 2), build_stage(CFG, 1, 2)
    with pytest.raises(ValueError, match="int64 tokens"):
        s0(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="hidden"):
        s1(torch.zeros(2, 4, 7))
    with pytest.raises(ValueError, match="max_seq_len"):
        s0(torch.zeros(1, 33, dtype=torch.int64))


def test_config_validation_and_presets() -> None:
    with pytest.raises(ValueError, match="heads"):
        ModelConfig(d_model=30, n_layers=1, n_heads=4, d_ff=8, max_seq_len=8)
    with pytest.raises(ValueError, match="subspace_rank"):
        CFG.replace(subspace_rank=33)
    with pytest.raises(ValueError, match="unknown fields"):
        ModelConfig.from_dict({**CFG.to_dict(), "bogus": 1})
    assert ModelConfig.from_dict(CFG.to_dict()) == CFG
    assert {"tiny", "small", "bench"} <= set(PRESETS)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("huge")


def test_export_round_trip_loads_every_stage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = CFG.replace(seed=3)
    full = build_model(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.01)
    project_(full)
    save_export(full, cfg, tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["format"] == "agora-model" and meta["model"]["d_model"] == 32
    cfg2, tensors = load_export(tmp_path)
    assert cfg2 == cfg
    other = build_model(cfg.replace(seed=4))
    x = torch.randint(0, 256, (2, 8))
    stages = [build_stage(cfg2, s, 2) for s in range(2)]
    for s in stages:
        load_stage_weights(s, tensors)
    torch.testing.assert_close(stages[1](stages[0](x)), full(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other(x), full(x))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="format"):
        load_export(tmp_path)


def test_replicas_of_a_stage_start_identical() -> None:
    a, b = build_stage(preset("tiny"), 1, 2), build_stage(preset("tiny"), 1, 2)
    for (ka, pa), (kb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb and torch.equal(pa, pb)


@pytest.mark.parametrize("kv", [0, 2, 1])
def test_n_params_counts_the_trainable_parameters_with_grouped_query_attention(kv: int) -> None:
    cfg = CFG.replace(n_kv_heads=kv)
    assert cfg.n_params() == sum(p.numel() for p in build_model(cfg).parameters())
    with pytest.raises(ValueError, match="n_kv_heads"):
        CFG.replace(n_kv_heads=3)


def test_grouped_query_attention_shares_each_kv_head_within_its_group() -> None:
    """With one kv head every query head attends with the same keys and values: heads
    whose query weights are equal give equal outputs."""
    cfg = CFG.replace(n_kv_heads=1, n_layers=1)
    block = build_model(cfg).blocks["0"]
    hd = cfg.head_dim
    with torch.no_grad():
        q = block.qkv.weight[: cfg.d_model]
        q[hd : 2 * hd] = q[:hd]  # head 1's queries = head 0's
    h = torch.randn(2, 8, cfg.d_model)
    model = build_model(cfg)
    cos, sin = model.rope_cos, model.rope_sin
    captured = {}
    block.out_proj.register_forward_hook(lambda m, i, o: captured.update(a=i[0]))
    block(h, cos, sin)
    a = captured["a"].view(2, 8, cfg.n_heads, hd)
    torch.testing.assert_close(a[:, :, 0], a[:, :, 1])


def test_llama_presets_have_their_sizes() -> None:
    sizes = {name: PRESETS[name].n_params() for name in ("llama-125m", "llama-350m", "llama-1b")}
    assert 70e6 < sizes["llama-125m"] < 90e6, sizes
    assert 250e6 < sizes["llama-350m"] < 400e6, sizes
    assert 0.9e9 < sizes["llama-1b"] < 1.3e9, sizes
    with_tokenizer = PRESETS["llama-125m"].replace(vocab_size=32000).n_params()
    assert 120e6 < with_tokenizer < 130e6  # the name counts a 32k-token vocabulary
