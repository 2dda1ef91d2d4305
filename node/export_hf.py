"""`agora export --format hf`: the whole model as a Hugging Face Llama directory.

Owns the mapping from node.model's weights to transformers' `LlamaForCausalLM` and the
files around them, so `LlamaForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load the export with no Agora code:
- `hf_state_dict(model)`: HF tensor names; the fused `qkv` projection split (d, kv, kv)
  into q/k/v, `gate_up` split in halves into gate/up, and with a subspace the frozen E0
  folded into the token embedding (`embed.weight + e0`, what `Stage.embed_tokens` adds;
  U only constrains training, it is no part of the forward). RoPE needs no permutation:
  node.model rotates the halves of each head as HF's `rotate_half` does.
- `hf_config(config)`: `config.json` (a LlamaConfig; rope written both as transformers
  5's `rope_parameters` and as 4.x's top-level `rope_theta`) and `generation_config.json`.
- The tokenizer: `tokenizer.json` (the run's BPE as given, or `byte_tokenizer_json()`,
  whose ids are the byte values) and a `tokenizer_config.json`; `resolve_tokenizer`
  picks it and checks its vocabulary (and the run's tokenizer hash) against the model.
- `save_hf` writes everything into a temporary sibling of OUT and renames it into place,
  so a failed export never leaves a directory that looks complete.
Only torch, safetensors and `tokenizers` are needed; transformers is not imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ingest.tokenizer import END_OF_TEXT_NAMES, TOKENIZER_FILE
from node.model import Block, ModelConfig, Stage
from protocol.corpus import VOCAB_SIZE

HF_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    TOKENIZER_FILE,
    "tokenizer_config.json",
)


class HFExportError(ValueError):
    """The model or its tokenizer cannot be written as an HF export (the message says why)."""


# --- the tokenizer ---------------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table, the symbols `tokenizers`' ByteLevel maps bytes to:
    printable bytes stand for themselves, the rest move up to U+0100 and beyond."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in symbols)
    for n, b in enumerate(shifted):
        symbols[b] = chr(256 + n)
    return [symbols[b] for b in range(256)]


def byte_tokenizer_json() -> bytes:
    """The byte tokenizer as a `tokenizers` tokenizer.json: a BPE over the 256 byte-level
    symbols with no merges (symbol of byte b has id b), a ByteLevel pre-tokenizer without
    prefix space or regex, and the ByteLevel decoder, so `encode(text).ids ==
    list(text.encode())` and decoding the ids gives the text back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    data: bytes = tok.to_str().encode()
    return data


def load_tokenizer(data: bytes, where: str) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json's bytes; HFExportError naming `where`."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # tokenizers raises plain Exception
        raise HFExportError(f"{where}: not a tokenizers tokenizer.json ({exc})") from exc


def check_tokenizer(data: bytes, where: str, vocab_size: int, tokenizer_hash: str = "") -> Any:
    """Load the tokenizer and check it fits the model: the same vocabulary size and, when
    the run recorded one (`tokenizer_hash`, sha256 of its tokenizer.json), the same file."""
    tok = load_tokenizer(data, where)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have != vocab_size:
        raise HFExportError(
            f"{where}: the tokenizer has a vocabulary of {have} tokens, the model's"
            f" vocab_size is {vocab_size}"
        )
    if tokenizer_hash:
        digest = hashlib.sha256(data).hexdigest()
        if digest != tokenizer_hash:
            raise HFExportError(
                f"{where}: sha256 {digest} is not the run's tokenizer_hash {tokenizer_hash}"
            )
    return tok


def _source_tokenizer(source_dirs: Sequence[Path]) -> Path | None:
    """The one `tokenizer.json` beside the sources (first found; files must agree)."""
    found = [d / TOKENIZER_FILE for d in source_dirs if (d / TOKENIZER_FILE).is_file()]
    for other in found[1:]:
        if other.read_bytes() != found[0].read_bytes():
            raise HFExportError(
                f"{found[0]} and {other} differ; choose the run's tokenizer with --tokenizer"
            )
    return found[0] if found else None


def resolve_tokenizer(
    vocab_size: int,
    *,
    explicit: Path | None = None,
    served: bytes | None = None,
    source_dirs: Sequence[Path] = (),
    tokenizer_hash: str = "",
) -> tuple[bytes, str]:
    """The tokenizer.json bytes to export and where they came from, checked against the
    model. In order: `explicit` (--tokenizer FILE), `served` (bytes the source carried,
    e.g. the coordinator's), `tokenizer.json` in one of `source_dirs`, and the byte
    tokenizer when the vocabulary is 256 and the run recorded no tokenizer hash."""
    where: str
    if explicit is not None:
        if not explicit.is_file():
            raise HFExportError(f"--tokenizer {explicit} is not a file")
        data, where = explicit.read_bytes(), str(explicit)
    elif served is not None:
        data, where = served, "the tokenizer.json the source served"
    elif (found := _source_tokenizer(source_dirs)) is not None:
        data, where = found.read_bytes(), str(found)
    elif vocab_size == VOCAB_SIZE and not tokenizer_hash:
        data, where = byte_tokenizer_json(), "the byte tokenizer"
    else:
        looked = ", ".join(str(d / TOKENIZER_FILE) for d in source_dirs) or "no source directory"
        run = f" (the run's has sha256 {tokenizer_hash})" if tokenizer_hash else ""
        raise HFExportError(
            f"the model's vocab_size is {vocab_size}, not the byte tokenizer's {VOCAB_SIZE},"
            f" and no tokenizer.json was found ({looked}); give the run's tokenizer with"
            f" --tokenizer FILE{run}"
        )
    check_tokenizer(data, where, vocab_size, tokenizer_hash)
    return data, where


def end_of_text(tok: Any) -> str | None:
    """The tokenizer's end-of-text token, if it has one of END_OF_TEXT_NAMES."""
    return next((n for n in END_OF_TEXT_NAMES if tok.token_to_id(n) is not None), None)


def tokenizer_config(tok: Any, config: ModelConfig) -> dict[str, Any]:
    """`tokenizer_config.json`: load tokenizer.json as it is (no model-specific class that
    would rebuild it), no tokens added around the text."""
    eot = end_of_text(tok)
    doc: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_seq_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if eot is not None:
        doc["eos_token"] = eot
    return doc


# --- the model --------------------------------------------------------------------------------


def hf_config(config: ModelConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """`config.json`: the LlamaConfig of node.model's architecture."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
        "rope_theta": config.rope_base,  # transformers 4.x reads it here
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "dtype": "float32",
        "torch_dtype": "float32",  # transformers 4.x reads it here
    }


def generation_config(eos_token_id: int | None) -> dict[str, Any]:
    return {"bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": None}


def _block_tensors(i: int, block: Block, config: ModelConfig) -> dict[str, torch.Tensor]:
    d, kv = config.d_model, config.kv_heads * config.head_dim
    q, k, v = torch.split(block.qkv.weight, [d, kv, kv], dim=0)
    gate, up = block.gate_up.weight.chunk(2, dim=0)
    pre = f"model.layers.{i}."
    return {
        pre + "self_attn.q_proj.weight": q,
        pre + "self_attn.k_proj.weight": k,
        pre + "self_attn.v_proj.weight": v,
        pre + "self_attn.o_proj.weight": block.out_proj.weight,
        pre + "mlp.gate_proj.weight": gate,
        pre + "mlp.up_proj.weight": up,
        pre + "mlp.down_proj.weight": block.down_proj.weight,
        pre + "input_layernorm.weight": block.attn_norm.weight,
        pre + "post_attention_layernorm.weight": block.mlp_norm.weight,
    }


@torch.no_grad()
def hf_state_dict(model: Stage) -> dict[str, torch.Tensor]:
    """The whole model's weights under LlamaForCausalLM's names, fp32, contiguous, on CPU."""
    if not (model.is_first and model.is_last):
        raise HFExportError(
            f"an HF export needs the whole model, got stage {model.stage} of {model.n_stages}"
        )
    config = model.config
    embed = model.embed.weight
    if model.subspace is not None:
        embed = embed + model.subspace.e0  # the frozen part of every token's embedding
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in model.layers:
        block = model.blocks[str(i)]
        assert isinstance(block, Block)
        tensors |= _block_tensors(i, block, config)
    tensors["model.norm.weight"] = model.norm.weight
    tensors["lm_head.weight"] = model.head.weight
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}


# --- writing ----------------------------------------------------------------------------------


def write_hf_files(model: Stage, tokenizer_json: bytes, directory: Path) -> None:
    """Every file of the HF export into `directory` (which must exist)."""
    from safetensors.torch import save_file

    tok = load_tokenizer(tokenizer_json, "the tokenizer")
    eot = end_of_text(tok)
    eos_id = tok.token_to_id(eot) if eot is not None else None
    save_file(hf_state_dict(model), str(directory / "model.safetensors"), {"format": "pt"})
    docs = {
        "config.json": hf_config(model.config, eos_id),
        "generation_config.json": generation_config(eos_id),
        "tokenizer_config.json": tokenizer_config(tok, model.config),
    }
    for name, doc in docs.items():
        (directory / name).write_text(json.dumps(doc, indent=2) + "\n")
    (directory / TOKENIZER_FILE).write_bytes(tokenizer_json)


def _replaceable(out: Path) -> bool:
    """`out` may be replaced: absent, an empty directory, or an earlier HF export."""
    if not out.exists():
        return True
    if not out.is_dir():
        return False
    if not any(out.iterdir()):
        return True
    try:
        meta = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("model_type") == "llama"


def save_hf(
    model: Stage,
    tokenizer_json: bytes,
    out: Path,
    extra: Callable[[Path], object] | None = None,
) -> None:
    """Write the HF export to `out` atomically: into a temporary sibling directory, renamed
    into place once complete (`extra(dir)` may add files first, e.g. lineage.json). `out`
    must be absent, an empty directory or an earlier HF export, which is replaced."""
    out = Path(out)
    if not _replaceable(out):
        raise HFExportError(
            f"{out} exists and is neither empty nor an earlier HF export; not overwriting it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write_hf_files(model, tokenizer_json, tmp)
        if extra is not None:
            extra(tmp)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`, moving an earlier `out` aside first."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old / out.name, out)  # put the earlier export back
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
