"""The coordinator's copy of the dataset: the run's tokenizer and the tokenized corpus.

Reading, tokenizing and cutting are `ingest`'s and `protocol.corpus`'s (the node reads
the same way through them); this module maps the coordinator's settings onto them: the
dataset, its text column, the tokenizer, the shard cut, and the token cache beside the
database. It runs once at start-up (`coordinator/main.py`), off the event loop.
"""

from __future__ import annotations

from pathlib import Path

from coordinator.config import CoordinatorConfig
from ingest.corpus import load_corpus
from ingest.sources import STDLIB
from ingest.tokenizer import RunTokenizer
from protocol.corpus import Manifest

__all__ = ["STDLIB", "load_dataset", "load_tokenizer"]


def load_tokenizer(cfg: CoordinatorConfig) -> RunTokenizer:
    """The run's tokenizer (`cfg.tokenizer`: "bytes" or a tokenizer.json)."""
    return RunTokenizer.load(cfg.tokenizer)


def load_dataset(
    cfg: CoordinatorConfig, tokenizer: RunTokenizer | None = None
) -> tuple[Manifest, bytes]:
    """The run's token stream (`cfg.dataset` under `cfg.tokenizer`) and its manifest."""
    tokenizer = tokenizer or load_tokenizer(cfg)
    cache = None if cfg.token_cache == "" else Path(cfg.token_cache or f"{cfg.db}.tokens")
    manifest, stream = load_corpus(
        cfg.dataset,
        tokenizer=tokenizer,
        text_column=cfg.text_column,
        shard_tokens=cfg.shard_tokens,
        heldout_every=cfg.heldout_every,
        cache_dir=cache,
    )
    frame = cfg.shard_tokens * manifest.token_bytes + 4096
    if frame > cfg.max_frame_bytes:
        raise ValueError(
            f"a shard of {cfg.shard_tokens} tokens of {manifest.token_bytes} bytes needs"
            f" max_frame_bytes >= {frame} (it is {cfg.max_frame_bytes})"
        )
    return manifest, stream
