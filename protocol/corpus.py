"""The dataset contract that node and coordinator must agree on byte for byte.

Tokens are bytes (vocabulary 256). The embedded corpus is the running Python's own
standard-library source in sorted path order, so two machines with different Pythons get
different content hashes and notice. A corpus is cut into fixed-size shards; every
`heldout_every`-th shard is held out and never trained on. This module reads files but
owns no sockets, event loop or torch.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

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


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard-library .py files, sorted, with tests and site-packages left out."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p for p in base.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(base).parts[:-1])
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def stdlib_corpus(root: Path | None = None) -> bytes:
    """The embedded corpus: every stdlib source file, each preceded by its path."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    parts = []
    for p in stdlib_sources(base):
        parts.append(f"# ==== {p.relative_to(base).as_posix()} ====\n".encode())
        parts.append(p.read_bytes())
        parts.append(b"\n")
    return b"".join(parts)


def read_user_dataset(path: Path) -> bytes:
    """A directory of text files (sorted, recursive) or a .jsonl with a `text` field."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise ValueError(f"dataset directory {path} holds no files")
        return b"\n".join(p.read_bytes() for p in files)
    if path.suffix == ".jsonl":
        out = []
        with path.open("rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(
                        f"{path}:{lineno}: expected a JSON object with 'text'"
                    ) from exc
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno}: 'text' must be a string")
                out.append(text.encode())
        if not out:
            raise ValueError(f"dataset {path} holds no records")
        return b"\n".join(out)
    raise ValueError(f"dataset {path} must be a directory of text files or a .jsonl file")


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
