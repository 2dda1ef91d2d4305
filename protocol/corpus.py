"""The dataset contract that node and coordinator must agree on byte for byte.

Tokens are bytes (vocabulary 256). The embedded corpus is the running Python's own
standard-library source in sorted path order, so two machines with different Pythons get
different content hashes and notice. A user dataset is a directory of text files or a
.jsonl file of `{"text": ...}` records. A corpus is cut into fixed-size shards; every
`heldout_every`-th shard is held out and never trained on.

Pure: the corpus layouts are functions over (relative path, bytes) pairs and lines, and
the reading of files lives with each side (node.data, coordinator.dataset), which pass
what they read through these functions. docs/data-path.md follows the bytes further.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Literal

from protocol.errors import ProtocolError
from protocol.message import Message, bounded, message, record

VOCAB_SIZE = 256  # byte-level tokens
DEFAULT_SHARD_TOKENS = 1 << 18  # tokens (= bytes) per shard
DEFAULT_HELDOUT_EVERY = 16  # every 16th shard is held out
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


@record
class ShardInfo(Message):
    shard_id: int = bounded(ge=0)
    start: int = bounded(ge=0)  # token offset in the corpus
    tokens: int = bounded(ge=1)  # length in tokens
    sha256: str = bounded(min_len=64, max_len=64)


@message("manifest", version=1)
class Manifest(Message):
    name: str = bounded(max_len=256)
    content_hash: str = bounded(min_len=64, max_len=64)  # sha256 of the whole corpus
    total_tokens: int = bounded(ge=0)
    train: list[ShardInfo]
    heldout: list[ShardInfo]

    def shard(self, shard_id: int) -> ShardInfo:
        for s in self.train:
            if s.shard_id == shard_id:
                return s
        raise KeyError(f"no training shard {shard_id} in manifest {self.name!r}")


def is_stdlib_source(relpath: str) -> bool:
    """Whether a stdlib file (POSIX path relative to the stdlib root) enters the corpus.

    Python sources only; tests, site-packages and caches are left out.
    """
    *dirs, name = relpath.split("/")
    return name.endswith(".py") and not _SKIP_DIRS.intersection(dirs)


def embedded_corpus(sources: Iterable[tuple[str, bytes]]) -> bytes:
    """The embedded corpus from (relative path, bytes) pairs of the stdlib's files.

    Keeps the pairs `is_stdlib_source` accepts, sorts them by path string, and writes
    each as a `# ==== <path> ====` line, its bytes and a newline.
    """
    parts = []
    for rel, data in sorted((s for s in sources if is_stdlib_source(s[0])), key=lambda s: s[0]):
        parts.append(f"# ==== {rel} ====\n".encode())
        parts.append(data)
        parts.append(b"\n")
    return b"".join(parts)


def user_dataset_layout(name: str, *, is_dir: bool, where: str) -> Literal["text files", "jsonl"]:
    """How a user dataset called `name` is read: a directory of text files or a .jsonl file.

    `where` names the dataset in the error raised for anything else.
    """
    if is_dir:
        return "text files"
    if name.endswith(".jsonl"):
        return "jsonl"
    raise ValueError(f"dataset {where} must be a directory of text files or a .jsonl file")


def text_files_corpus(files: Iterable[tuple[str, bytes]], *, where: str) -> bytes:
    """A directory dataset from its files' (relative path, bytes): sorted, joined by newlines.

    Paths sort component by component (as `pathlib` orders them), so `a/b` precedes `a-b`.
    """
    ordered = sorted(files, key=lambda f: f[0].split("/"))
    if not ordered:
        raise ValueError(f"dataset directory {where} holds no files")
    return b"\n".join(data for _, data in ordered)


def jsonl_corpus(lines: Iterable[bytes], *, where: str) -> bytes:
    """A .jsonl dataset from its lines: each record's `text` (a string), joined by newlines.

    Blank lines are skipped; a malformed record raises ValueError naming `where:line`.
    """
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}:{lineno}: expected a JSON object with 'text'") from exc
        if not isinstance(text, str):
            raise ValueError(f"{where}:{lineno}: 'text' must be a string")
        out.append(text.encode())
    if not out:
        raise ValueError(f"dataset {where} holds no records")
    return b"\n".join(out)


def build_manifest(
    data: bytes,
    *,
    name: str,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    heldout_every: int = DEFAULT_HELDOUT_EVERY,
) -> Manifest:
    """Cut `data` into shards; every `heldout_every`-th shard (from the 1st) is held out."""
    if shard_tokens < 1 or heldout_every < 2:
        raise ValueError("shard_tokens must be >= 1 and heldout_every >= 2")
    train: list[ShardInfo] = []
    heldout: list[ShardInfo] = []
    for i, start in enumerate(range(0, len(data), shard_tokens)):
        chunk = data[start : start + shard_tokens]
        info = ShardInfo(
            shard_id=i, start=start, tokens=len(chunk), sha256=hashlib.sha256(chunk).hexdigest()
        )
        (heldout if i % heldout_every == heldout_every - 1 else train).append(info)
    if not train or not heldout:
        raise ValueError(
            f"corpus of {len(data)} tokens is too small for {shard_tokens}-token shards"
            f" with one held out in {heldout_every}"
        )
    return Manifest(
        name=name,
        content_hash=hashlib.sha256(data).hexdigest(),
        total_tokens=len(data),
        train=train,
        heldout=heldout,
    )


def shard_data(data: bytes, shard: ShardInfo) -> bytes:
    """The bytes of one shard, checked against its sha256."""
    chunk = data[shard.start : shard.start + shard.tokens]
    verify_shard(chunk, shard)
    return chunk


def verify_shard(chunk: bytes, shard: ShardInfo) -> None:
    if len(chunk) != shard.tokens or hashlib.sha256(chunk).hexdigest() != shard.sha256:
        raise ProtocolError(f"shard {shard.shard_id} failed its sha256 check")
