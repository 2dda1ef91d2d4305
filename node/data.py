"""The torch side of the data path: a token stream -> token batches.

Reading and tokenizing a dataset are `ingest`'s (the coordinator reads through it too) and
the byte-exact contract (layouts, token width, shards, sha256, held-out split) is
`protocol.corpus`'s; this module turns streams into tensors:
- `load_dataset(path, tokenizer=...)` reads the embedded stdlib corpus (path None) or a
  user dataset, tokenizes it and cuts it into a `protocol.corpus.Manifest` with its train
  and held-out tokens.
- `stream_tokens(chunk, token_bytes)` is a stream's ids as a numpy array (stage 0 cuts
  leased shards with it).
- `RandomBatches` samples training windows from the training shards (central runs).
- `shard_batches` cuts a leased shard into consecutive micro-batches from an offset
  (the pipeline: a micro-batch is identified by (lease, offset)).
- `eval_batches` is the fixed held-out set every evaluation uses.
A batch is `(inputs, targets)`, both int64 [B, T]; targets are the inputs shifted by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ingest.corpus import load_stream
from ingest.sources import DEFAULT_TEXT_COLUMN
from ingest.tokenizer import RunTokenizer
from protocol.corpus import (
    DEFAULT_HELDOUT_EVERY,
    DEFAULT_SHARD_TOKENS,
    VOCAB_SIZE,
    Manifest,
    build_manifest,
    shard_data,
    token_width,
)

Batch = tuple[torch.Tensor, torch.Tensor]
MIN_SHARDS = 2 * DEFAULT_HELDOUT_EVERY  # shards a small dataset is cut into at least


@dataclass(frozen=True, slots=True)
class Dataset:
    manifest: Manifest
    train: torch.Tensor  # the training shards' tokens concatenated (uint8 or int32)
    heldout: torch.Tensor  # the held-out shards' tokens concatenated (uint8 or int32)
    data: bytes  # the whole token stream


def token_dtype(vocab_size: int) -> str:
    """The numpy dtype name of a run's token ids (on the wire and in shards)."""
    return f"uint{8 * token_width(vocab_size)}"


def stream_tokens(chunk: bytes, token_bytes: int) -> np.ndarray:
    """The ids of a token stream (read-only; uint8, uint16 or uint32 little-endian)."""
    return np.frombuffer(chunk, dtype=np.dtype(f"<u{token_bytes}"))


def tokens_tensor(chunk: bytes, token_bytes: int = 1) -> torch.Tensor:
    """A stream's ids as a tensor, as `Dataset` keeps them: bytes stay uint8, wider ids
    become int32 (which every vocabulary fits)."""
    ids = stream_tokens(chunk, token_bytes)
    return torch.from_numpy(ids.copy() if token_bytes == 1 else ids.astype(np.int32))


def split_dataset(
    data: bytes,
    name: str,
    shard_tokens: int | None = None,
    *,
    vocab_size: int = VOCAB_SIZE,
    tokenizer_hash: str = "",
) -> Dataset:
    """Cut the stream `data` into shards (smaller shards for small datasets) and split it."""
    width = token_width(vocab_size)
    if shard_tokens is None:
        shard_tokens = min(DEFAULT_SHARD_TOKENS, max(1, len(data) // width // MIN_SHARDS))
    manifest = build_manifest(
        data,
        name=name,
        shard_tokens=shard_tokens,
        vocab_size=vocab_size,
        tokenizer_hash=tokenizer_hash,
    )
    train = b"".join(shard_data(data, s, width) for s in manifest.train)
    heldout = b"".join(shard_data(data, s, width) for s in manifest.heldout)
    return Dataset(
        manifest=manifest,
        train=tokens_tensor(train, width),
        heldout=tokens_tensor(heldout, width),
        data=data,
    )


def load_dataset(
    path: Path | str | None = None,
    shard_tokens: int | None = None,
    *,
    tokenizer: RunTokenizer | None = None,
    text_column: str = DEFAULT_TEXT_COLUMN,
) -> Dataset:
    """The embedded stdlib corpus (None) or a user dataset, under `tokenizer` (None: bytes)."""
    tokenizer = tokenizer or RunTokenizer.byte_level()
    stream, name = load_stream(path, tokenizer=tokenizer, text_column=text_column)
    return split_dataset(
        stream,
        name,
        shard_tokens,
        vocab_size=tokenizer.vocab_size,
        tokenizer_hash=tokenizer.sha256,
    )


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Batch:
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    win = data[idx].to(torch.int64)
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def _check_len(data: torch.Tensor, seq_len: int, what: str) -> None:
    if data.numel() < seq_len + 1:
        raise ValueError(
            f"{what} holds {data.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}"
        )


class RandomBatches:
    """Endless random training windows, reproducible from `seed`."""

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        _check_len(data, seq_len, "training data")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        high = self.data.numel() - self.seq_len
        starts = torch.randint(0, high, (self.batch_size,), generator=self.gen)
        return _windows(self.data, starts, self.seq_len)


def shard_batches(
    shard: bytes, batch_size: int, seq_len: int, offset: int = 0, token_bytes: int = 1
) -> Iterator[tuple[int, Batch]]:
    """Consecutive micro-batches of a shard's bytes from token `offset`: yields (offset,
    batch).

    Each micro-batch covers `batch_size * seq_len` tokens of the shard (windows overlap by
    one token for the targets); a tail too short for a full micro-batch is not yielded.
    """
    data = tokens_tensor(shard, token_bytes)
    step = batch_size * seq_len
    pos = offset
    while pos + step + 1 <= data.numel():
        starts = pos + torch.arange(batch_size) * seq_len
        yield pos, _windows(data, starts, seq_len)
        pos += step


def eval_batches(
    heldout: torch.Tensor, batch_size: int, seq_len: int, n_batches: int
) -> list[Batch]:
    """A fixed held-out set: `n_batches` batches of windows spread evenly over the data."""
    _check_len(heldout, seq_len, "held-out data")
    n = batch_size * n_batches
    high = heldout.numel() - seq_len - 1
    starts = torch.linspace(0, high, n).round().to(torch.int64)
    return [_windows(heldout, starts[i : i + batch_size], seq_len) for i in range(0, n, batch_size)]
