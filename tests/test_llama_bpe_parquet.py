"""The real-format path end to end: a Llama-configured 2-stage swarm trains on a Parquet
dataset with a BPE tokenizer trained by `agora tokenizer train`, and its checkpoints
export with `agora export --format hf` to a model `transformers` loads, whose held-out
loss equals `agora baseline --init --eval-only`'s within 1e-3 nats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from ingest.sources import stdlib_documents
from ingest.tokenizer import RunTokenizer
from node.data import eval_batches, load_dataset
from node.model import build_stage, load_export
from swarmlab.swarm import LocalSwarm

VOCAB = 1024  # tokens of the trained BPE
EVAL = {"batch_size": 4, "seq_len": 128, "n_batches": 8}  # agora baseline's held-out set


def _agora(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "swarmlab.cli", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


def _hf_heldout_loss(directory: Path, tokens: torch.Tensor) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    model.eval()
    losses = []
    with torch.no_grad():
        for x, y in eval_batches(tokens, EVAL["batch_size"], EVAL["seq_len"], EVAL["n_batches"]):
            logits = model(input_ids=x).logits
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    return float(torch.stack(losses).mean())


@pytest.mark.timeout(900)  # three interpreters importing torch + hivemind on a 2-core box
def test_llama_swarm_on_parquet_with_bpe_exports_to_transformers(tmp_path: Path) -> None:
    docs = stdlib_documents().docs[:160]
    data = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"content": [d.decode("utf-8", errors="replace") for d in docs]}), data)
    tok_path = tmp_path / "tokenizer.json"
    _agora("tokenizer", "train", "--dataset", str(data), "--text-column", "content",
           "--vocab-size", str(VOCAB), "--out", str(tok_path))  # fmt: skip
    tokenizer = RunTokenizer.load(tok_path)

    swarm = LocalSwarm(
        workdir=tmp_path / "run",
        preset="llama-tiny",
        codec="int8",
        run_config={
            "dataset": str(data), "text_column": "content", "tokenizer": str(tok_path),
            "shard_tokens": 8192,
        },
    )  # fmt: skip
    toml = swarm.write_node_config(
        outer_every_steps=3, inner_batch_tokens=2048, outer_matchmaking_s=2.0
    )
    swarm.node_args = ["--config", str(toml)]
    ckpt = tmp_path / "ckpt"
    try:
        swarm.start_coordinator()
        for name, stage in (("a0", 0), ("a1", 1)):
            swarm.add_node(name, stage, "--checkpoint-dir", str(ckpt / name))
        swarm.wait_for(lambda: swarm.status().committed_tokens >= 40_000, "40k tokens", 400)
        # from the live replicas too: the export fetches the tokenizer from the coordinator
        _agora("export", "--coordinator", swarm.address, "--format", "hf", "--no-progress",
               "--out", str(tmp_path / "hf-live"))  # fmt: skip
        codes = swarm.stop(timeout_s=120)
    finally:
        swarm.kill_all()
    assert codes == {"a0": 0, "a1": 0, "coordinator": 0}, swarm.tails()
    assert swarm.audit().exit_code == 0
    # the nodes fetched the tokenizer from the coordinator, checked by hash
    for name in ("a0", "a1"):
        assert (ckpt / name / "tokenizer.json").read_bytes() == tokenizer.json

    dirs = [str(ckpt / "a0"), str(ckpt / "a1")]
    _agora("export", "--checkpoints", *dirs, "--out", str(tmp_path / "agora-model"))
    _agora("export", "--checkpoints", *dirs, "--format", "hf", "--out", str(tmp_path / "hf"))
    config, tensors = load_export(tmp_path / "agora-model")
    assert config.vocab_size == VOCAB and config.n_kv_heads == 2

    proc = _agora(
        "baseline", "--init", str(tmp_path / "agora-model"), "--eval-only",
        "--dataset", str(data), "--text-column", "content", "--tokenizer", str(tok_path),
        "--batch-size", str(EVAL["batch_size"]), "--seq-len", str(EVAL["seq_len"]),
        "--json", str(tmp_path / "eval.json"), "--out", str(tmp_path / "baseline-out"),
    )  # fmt: skip
    agora_loss = json.loads((tmp_path / "eval.json").read_text())["eval_loss"]
    dataset = load_dataset(data, tokenizer=tokenizer, text_column="content")
    hf_loss = _hf_heldout_loss(tmp_path / "hf", dataset.heldout)
    assert abs(hf_loss - agora_loss) < 1e-3, (hf_loss, agora_loss, proc.stdout)

    # it trained: the swarm's model beats the one it started from
    from node.baseline import evaluate_weights

    untrained = evaluate_weights(config, build_stage(config, 0, 1).state_dict(), dataset, **EVAL)
    assert agora_loss < untrained - 0.3, (agora_loss, untrained)

    assert (tmp_path / "hf-live" / "tokenizer.json").read_bytes() == tokenizer.json
    _hf_heldout_loss(tmp_path / "hf-live", dataset.heldout)  # loads and evaluates

    # and the tokenizer travels with the export
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = docs[3].decode("utf-8", errors="replace")[:500]
    assert hf_tok.encode(text, add_special_tokens=False) == tokenizer.encode(text)
