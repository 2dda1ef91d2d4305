"""`agora export --format hf`: transformers' LlamaForCausalLM loads the export and computes
the same held-out loss as `agora baseline --eval-only` and the same logits as node.model
(the subspace fold and grouped-query attention included); the byte tokenizer's ids are the
bytes; a tokenizer that does not fit the model is refused; checkpoints export too; a
failed export leaves nothing that looks complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from node.baseline import TrainConfig, train
from node.baseline import main as baseline_main
from node.checkpoint import stage_checkpointer
from node.data import Dataset, eval_batches, load_dataset
from node.export import main
from node.export_hf import HFExportError, byte_tokenizer_json, save_hf
from node.model import ModelConfig, Stage, build_model, build_stage, preset, save_export
from node.subspace import project_
from protocol.control import RunInfo

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TINY = preset("tiny")  # subspace_rank 32: the E0 fold is exercised
TINY_GQA = TINY.replace(n_kv_heads=2, seed=7)
BATCH, SEQ = 4, 64  # held-out batches of the comparison (baseline's eval_batches: 8)
TEXT = "Agora trains in the open. Ünïcödé, 日本語, emoji 🙂, tabs\tand\nnewlines.\x00\x7f"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # a 2-core box shared with other work


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset()


def _perturbed(stage: Stage, seed: int = 0) -> Stage:
    """Weights well off the init (as trained ones would be), kept in the subspace."""
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in stage.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    project_(stage)
    return stage


def _model_dir(tmp: Path, config: ModelConfig) -> tuple[Path, Stage]:
    model = _perturbed(build_model(config), config.seed)
    save_export(model, config, tmp / "agora")
    return tmp / "agora", model


def _trained_dir(tmp: Path, dataset: Dataset, config: ModelConfig) -> tuple[Path, Stage]:
    """An export of the model after a few baseline steps (a loss well under log 256)."""
    cfg = TrainConfig(
        steps=20, batch_size=8, seq_len=SEQ, lr=1e-2, warmup=5, eval_every=20, eval_batches=1,
        threads=1,
    )  # fmt: skip
    _, chained = train(cfg, dataset, model_config=config)
    model = chained.stage_list()[0]
    save_export(model, config, tmp / "agora")
    return tmp / "agora", model


def _hf(directory: Path) -> torch.nn.Module:
    model = transformers.LlamaForCausalLM.from_pretrained(directory)
    model.eval()
    return model


def _bpe_json(vocab_size: int) -> bytes:
    """A small byte-level BPE with an end-of-text token, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT * 3, "the swarm trains the model " * 20], trainer=trainer)
    data: bytes = tok.to_str().encode()
    return data


@pytest.mark.parametrize("config", [TINY, TINY_GQA], ids=["tiny-subspace", "tiny-gqa"])
def test_hf_loss_and_logits_match_agora(
    tmp_path: Path, dataset: Dataset, config: ModelConfig
) -> None:
    src, model = _trained_dir(tmp_path, dataset, config)
    out = tmp_path / "hf"
    assert main(["--model", str(src), "--format", "hf", "--out", str(out)]) == 0
    assert baseline_main(
        ["--init", str(src), "--eval-only", "--batch-size", str(BATCH), "--seq-len", str(SEQ),
         "--threads", "1", "--quiet", "--json", str(tmp_path / "eval.json")]
    ) == 0  # fmt: skip
    agora_loss = json.loads((tmp_path / "eval.json").read_text())["eval_loss"]

    hf = _hf(out)
    assert hf.config.num_key_value_heads == config.kv_heads
    assert hf.config.rope_parameters["rope_theta"] == config.rope_base
    assert not hf.config.tie_word_embeddings
    held = eval_batches(dataset.heldout, BATCH, SEQ, 8)
    with torch.no_grad():
        # transformers' own loss: labels are the inputs, shifted inside the model, so the
        # window one token longer gives exactly the (inputs, targets) of the batch
        losses = []
        for x, y in held:
            seq = torch.cat([x, y[:, -1:]], dim=1)
            losses.append(float(hf(input_ids=seq, labels=seq).loss))
        hf_loss = sum(losses) / len(losses)
        x = held[0][0]
        ours, theirs = model.eval()(x), hf(input_ids=x).logits
    assert abs(hf_loss - agora_loss) < 1e-3, (hf_loss, agora_loss)
    assert agora_loss < 4.0  # trained: well under log 256 = 5.55
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


def test_byte_tokenizer_ids_are_bytes(tmp_path: Path) -> None:
    tok = tokenizers.Tokenizer.from_str(byte_tokenizer_json().decode())
    assert sorted(tok.get_vocab().values()) == list(range(256))
    assert set(tok.get_vocab()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    every_char = "".join(chr(c) for c in range(0x800)) + "\uffff\U0001f642"
    for text in (TEXT, every_char, " leading space", ""):
        ids = tok.encode(text).ids
        assert ids == list(text.encode()), text[:20]
        assert tok.decode(ids) == text

    src, _ = _model_dir(tmp_path, TINY)
    assert main(["--model", str(src), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert len(auto) == 256
    assert auto.encode(TEXT) == list(TEXT.encode())
    assert auto.decode(list(TEXT.encode())) == TEXT


def test_bpe_tokenizer_beside_the_model_is_exported(tmp_path: Path) -> None:
    data = _bpe_json(300)
    vocab = tokenizers.Tokenizer.from_str(data.decode()).get_vocab_size(with_added_tokens=True)
    src, model = _model_dir(tmp_path, TINY_GQA.replace(vocab_size=vocab))
    (src / "tokenizer.json").write_bytes(data)
    out = tmp_path / "hf"
    assert main(["--model", str(src), "--format", "hf", "--out", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == data
    auto = transformers.AutoTokenizer.from_pretrained(out)
    ids = auto.encode(TEXT)
    assert ids == tokenizers.Tokenizer.from_str(data.decode()).encode(TEXT).ids
    assert auto.decode(ids) == TEXT
    eot = auto.convert_tokens_to_ids("<|endoftext|>")
    assert auto.eos_token == "<|endoftext|>" and _hf(out).config.eos_token_id == eot
    with torch.no_grad():
        x = torch.tensor([ids[:48]])
        assert torch.allclose(model.eval()(x), _hf(out)(input_ids=x).logits, atol=1e-4)


def test_tokenizer_that_does_not_fit_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src, _ = _model_dir(tmp_path, TINY)
    bad = tmp_path / "bpe.json"
    bad.write_bytes(_bpe_json(300))
    out = tmp_path / "hf"
    args = ["--model", str(src), "--format", "hf", "--out", str(out)]
    assert main([*args, "--tokenizer", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "vocab_size is 256" in err and str(bad) in err, err
    # a 300-token model without any tokenizer file: the error says what to give
    big, _ = _model_dir(tmp_path / "big", TINY.replace(vocab_size=300))
    assert main(["--model", str(big), "--format", "hf", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "vocab_size is 300" in err and "--tokenizer FILE" in err, err
    assert main([*args, "--tokenizer", str(tmp_path / "nope.json")]) == 2
    assert "is not a file" in capsys.readouterr().err
    assert main(["--model", str(src), "--out", str(out), "--tokenizer", str(bad)]) == 2
    assert not out.exists()
    assert not [p.name for p in tmp_path.iterdir() if ".partial-" in p.name]


def _run_info() -> RunInfo:
    return RunInfo(
        run_id="r1", model_preset="tiny", n_stages=2, codec="subspace_int8", seed=0,
        heartbeat_interval_s=1.0, lease_ttl_s=10.0, dataset_name="stdlib",
        dataset_hash="0" * 64, shards=4, data_epoch=0,
    )  # fmt: skip


def test_hf_export_from_checkpoints(tmp_path: Path) -> None:
    run = _run_info()
    stages = [_perturbed(build_stage(TINY, s, 2), s) for s in range(2)]
    for s, st in enumerate(stages):
        ck = stage_checkpointer(tmp_path / f"node{s}", 1, run, s, st)
        flat = torch.cat([p.detach().flatten() for p in st.parameters()])
        ck.write(*ck.capture(flat, torch.zeros_like(flat), 3 + s))
    out = tmp_path / "hf"
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    assert main(["--checkpoints", *dirs, "--format", "hf", "--out", str(out)]) == 0
    lineage = json.loads((out / "lineage.json").read_text())
    assert {s: v["round"] for s, v in lineage["stages"].items()} == {"0": 3, "1": 4}
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chained = stages[1](stages[0](tokens))
        assert torch.allclose(_hf(out)(input_ids=tokens).logits, chained, atol=1e-4, rtol=0)


def test_failed_export_leaves_nothing_complete(tmp_path: Path) -> None:
    model = _perturbed(build_model(TINY))
    out = tmp_path / "hf"

    def fail(directory: Path) -> None:
        assert (directory / "model.safetensors").is_file()  # everything written by now
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_hf(model, byte_tokenizer_json(), out, extra=fail)
    assert list(tmp_path.iterdir()) == []
    save_hf(model, byte_tokenizer_json(), out)
    first = (out / "model.safetensors").read_bytes()
    with pytest.raises(OSError, match="disk full"):
        save_hf(_perturbed(model, 1), byte_tokenizer_json(), out, extra=fail)
    assert (out / "model.safetensors").read_bytes() == first  # the earlier export stays
    save_hf(_perturbed(model, 1), byte_tokenizer_json(), out)  # and is replaced on success
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(HFExportError, match="neither empty nor an earlier HF export"):
        save_hf(model, byte_tokenizer_json(), other)
    assert [p.name for p in other.iterdir()] == ["keep.txt"]
