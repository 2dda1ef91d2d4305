"""The torch side of the data path: corpus bytes -> token batches.

The byte-exact dataset contract (corpus layout, shards, sha256, held-out split) lives in
`protocol.corpus`; this module reads the node's copy of the corpus and turns bytes into
int64 tensors:
- `stdlib_corpus()` and `read_user_dataset(path)` read the files and lay them out with
  `protocol.corpus` (coordinator.dataset holds the coordinator's twin of these two).
- `load_dataset(path)` reads the embedded stdlib corpus (path None) or a user dataset and
  cuts it into a `protocol.corpus.Manifest` with its train and held-out bytes.
- `RandomBatches` samples training windows from the training shards (central runs).
- `shard_batches` cuts a leased shard into consecutive micro-batches from an offset
  (the pipeline: a micro-batch is identified by (lease, offset)).
- `eval_batches` is the fixed held-out set every evaluation uses.
A batch is `(inputs, targets)`, both int64 [B, T]; targets are the inputs shifted by one.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.corpus import (
    DEFAULT_HELDOUT_EVERY,
    DEFAULT_SHARD_TOKENS,
    Manifest,
    build_manifest,
    embedded_corpus,
    is_stdlib_source,
    jsonl_corpus,
    shard_data,
    text_files_corpus,
    user_dataset_layout,
)

Batch = tuple[torch.Tensor, torch.Tensor]
MIN_SHARDS = 2 * DEFAULT_HELDOUT_EVERY  # shards a small dataset is cut into at least


@dataclass(frozen=True, slots=True)
class Dataset:
    manifest: Manifest
    train: torch.Tensor  # uint8, the training shards concatenated (tokens)
    heldout: torch.Tensor  # uint8, the held-out shards concatenated (tokens)
    data: bytes  # the whole corpus


def _read_tree(
    root: Path, keep: Callable[[str], bool] = lambda rel: True
) -> list[tuple[str, bytes]]:
    """(POSIX path relative to `root`, bytes) of every file under `root` that `keep` accepts."""
    found = ((p.relative_to(root).as_posix(), p) for p in root.rglob("*"))
    return [(rel, p.read_bytes()) for rel, p in found if keep(rel) and p.is_file()]


def stdlib_corpus(root: Path | None = None) -> bytes:
    """The embedded corpus, read from this Python's standard library (or `root`)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return embedded_corpus(_read_tree(base, is_stdlib_source))


def read_user_dataset(path: Path) -> bytes:
    """A directory of text files (sorted, recursive) or a .jsonl with a `text` field."""
    path = Path(path)
    if user_dataset_layout(path.name, is_dir=path.is_dir(), where=str(path)) == "text files":
        return text_files_corpus(_read_tree(path), where=str(path))
    with path.open("rb") as lines:
        return jsonl_corpus(lines, where=str(path))


def _as_tensor(chunk: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(chunk), dtype=torch.uint8)


def split_dataset(data: bytes, name: str, shard_tokens: int | None = None) -> Dataset:
    """Cut `data` into shards (smaller shards for small datasets) and split it."""
    if shard_tokens is None:
        shard_tokens = min(DEFAULT_SHARD_TOKENS, max(1, len(data) // MIN_SHARDS))
    manifest = build_manifest(data, name=name, shard_tokens=shard_tokens)
    train = b"".join(shard_data(data, s) for s in manifest.train)
    heldout = b"".join(shard_data(data, s) for s in manifest.heldout)
    return Dataset(
        manifest=manifest, train=_as_tensor(train), heldout=_as_tensor(heldout), data=data
    )


def load_dataset(path: Path | None = None, shard_tokens: int | None = None) -> Dataset:
    """The embedded stdlib corpus, or a directory of text files / a .jsonl with `text`."""
    if path is None:
        return split_dataset(stdlib_corpus(), "stdlib", shard_tokens)
    return split_dataset(read_user_dataset(Path(path)), Path(path).name, shard_tokens)


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
    shard: bytes, batch_size: int, seq_len: int, offset: int = 0
) -> Iterator[tuple[int, Batch]]:
    """Consecutive micro-batches of a shard from `offset`: yields (offset, batch).

    Each micro-batch covers `batch_size * seq_len` tokens of the shard (windows overlap by
    one token for the targets); a tail too short for a full micro-batch is not yielded.
    """
    data = _as_tensor(shard)
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
