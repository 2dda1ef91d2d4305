"""The dataset contract that node and coordinator must agree on byte for byte.

A dataset is a list of documents (`Documents`): the embedded corpus is the running
Python's own standard-library source in sorted path order (so two machines with different
Pythons get different content hashes and notice); a user dataset is a directory of text
files, a .jsonl file of `{"text": ...}` records, or records of a text column (Parquet, a
`datasets` directory). The run's tokenizer turns it into one token stream:
- the byte tokenizer (vocabulary 256): the documents joined by their separator, one byte a
  token, as `Documents.joined()`;
- a BPE tokenizer: each document's ids followed by the end-of-text id (`token_stream`).
A stream stores each token in `token_width(vocab_size)` little-endian bytes. It is cut
into fixed-size shards of tokens; every `heldout_every`-th shard is held out and never
trained on.

Pure: the layouts are functions over (relative path, bytes) pairs and lines, and the
reading of files and the tokenizer's encoding live in `ingest`, which passes what it read
through these functions. docs/data-path.md follows the bytes further.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from protocol.errors import ProtocolError
from protocol.message import Message, bounded, message, record

VOCAB_SIZE = 256  # the byte tokenizer's tokens
# tokens per shard: a shard holds one active lease at a time, and a stage-0 replica holds
# its open leases plus the trained ones that wait for their round, so the stdlib corpus
# needs enough shards for several replicas' pools (docs/data-path.md, "A share per
# stage-0 replica")
DEFAULT_SHARD_TOKENS = 1 << 16
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
    vocab_size: int = bounded(ge=2, le=1 << 20, default=VOCAB_SIZE)  # the tokenizer's (tokens)
    token_bytes: int = bounded(ge=1, le=4, default=1)  # bytes a token in the stream
    tokenizer_hash: str = bounded(max_len=64, default="")  # sha256 of tokenizer.json ("" bytes)

    def shard(self, shard_id: int) -> ShardInfo:
        for s in self.train:
            if s.shard_id == shard_id:
                return s
        raise KeyError(f"no training shard {shard_id} in manifest {self.name!r}")


def token_width(vocab_size: int) -> int:
    """Bytes a token takes in a stream: 1 up to 256 tokens, 2 up to 65536, else 4."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} must be >= 2")
    return 1 if vocab_size <= 1 << 8 else 2 if vocab_size <= 1 << 16 else 4


_TYPECODES = {2: "H", 4: "I"}


def pack_tokens(ids: Sequence[int] | array[int], width: int) -> bytes:
    """Token ids as a stream of `width`-byte little-endian integers."""
    if width == 1:
        return bytes(ids)
    arr = array(_TYPECODES[width], ids)
    if arr.itemsize != width:
        raise ValueError(f"this platform has no {width}-byte array type")
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def unpack_tokens(stream: bytes, width: int) -> list[int]:
    """The ids of a stream written by `pack_tokens` (for tests and small streams)."""
    if len(stream) % width:
        raise ValueError(f"a stream of {len(stream)} bytes is not whole {width}-byte tokens")
    if width == 1:
        return list(stream)
    arr = array(_TYPECODES[width])
    arr.frombytes(stream)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


@dataclass(frozen=True, slots=True)
class Documents:
    """A dataset's documents in order and the separator the byte tokenizer joins them by."""

    docs: list[bytes]
    separator: bytes

    def joined(self) -> bytes:
        """The byte tokenizer's stream (and the text a tokenizer is trained on)."""
        return self.separator.join(self.docs)


def token_stream(encoded: Iterable[Sequence[int]], *, end_of_text: int, vocab_size: int) -> bytes:
    """A BPE run's stream: each document's ids, then `end_of_text`, packed."""
    width = token_width(vocab_size)
    parts: list[bytes] = []
    eot = pack_tokens([end_of_text], width)
    for ids in encoded:
        if ids and max(ids) >= vocab_size:
            raise ValueError(f"token id {max(ids)} is outside the vocabulary of {vocab_size}")
        parts.append(pack_tokens(ids, width))
        parts.append(eot)
    return b"".join(parts)


def is_stdlib_source(relpath: str) -> bool:
    """Whether a stdlib file (POSIX path relative to the stdlib root) enters the corpus.

    Python sources only; tests, site-packages and caches are left out.
    """
    *dirs, name = relpath.split("/")
    return name.endswith(".py") and not _SKIP_DIRS.intersection(dirs)


def embedded_documents(sources: Iterable[tuple[str, bytes]]) -> Documents:
    """The embedded corpus from (relative path, bytes) pairs of the stdlib's files.

    Keeps the pairs `is_stdlib_source` accepts, sorts them by path string, and makes
    each a document: a `# ==== <path> ====` line, its bytes and a newline.
    """
    docs = [
        f"# ==== {rel} ====\n".encode() + data + b"\n"
        for rel, data in sorted((s for s in sources if is_stdlib_source(s[0])), key=lambda s: s[0])
    ]
    return Documents(docs=docs, separator=b"")


Layout = Literal["text files", "jsonl", "parquet", "datasets"]
DATASETS_MARKERS = ("state.json", "dataset_info.json")  # what `save_to_disk` writes


def user_dataset_layout(name: str, *, entries: Sequence[str] | None, where: str) -> Layout:
    """How a user dataset called `name` is read.

    `entries` is None for a file, else the POSIX paths of every file under the directory
    (relative to it). A file is a `.jsonl` or a `.parquet`; a directory is one written by
    `datasets`' `save_to_disk` (it holds `state.json` and `dataset_info.json`), a
    directory of `.parquet` files (every file one), or a directory of text files.
    `where` names the dataset in the error raised for anything else.
    """
    if entries is None:
        if name.endswith(".jsonl"):
            return "jsonl"
        if name.endswith(".parquet"):
            return "parquet"
        raise ValueError(f"dataset {where} must be a directory, a .jsonl file or a .parquet file")
    if "dataset_dict.json" in entries:
        raise ValueError(
            f"dataset {where} is a `datasets` DatasetDict: name one split's directory"
            f" (e.g. {where}/train)"
        )
    if all(m in entries for m in DATASETS_MARKERS):
        return "datasets"
    if entries and all(e.endswith(".parquet") for e in entries):
        return "parquet"
    return "text files"


def text_files_documents(files: Iterable[tuple[str, bytes]], *, where: str) -> Documents:
    """A directory of text files from (relative path, bytes): one document a file, sorted,
    joined by newlines.

    Paths sort component by component (as `pathlib` orders them), so `a/b` precedes `a-b`.
    """
    ordered = sorted(files, key=lambda f: f[0].split("/"))
    if not ordered:
        raise ValueError(f"dataset directory {where} holds no files")
    return Documents(docs=[data for _, data in ordered], separator=b"\n")


def jsonl_documents(lines: Iterable[bytes], *, where: str, column: str = "text") -> Documents:
    """A .jsonl dataset from its lines: each record's `column` string, joined by newlines.

    Blank lines are skipped; a malformed record raises ValueError naming `where:line`.
    """
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[column]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}:{lineno}: expected a JSON object with {column!r}") from exc
        if not isinstance(text, str):
            raise ValueError(f"{where}:{lineno}: {column!r} must be a string")
        out.append(text.encode())
    if not out:
        raise ValueError(f"dataset {where} holds no records")
    return Documents(docs=out, separator=b"\n")


def column_documents(values: Iterable[object], *, where: str, column: str) -> Documents:
    """Records of a table's text column (Parquet, `datasets`), in order, joined by newlines
    as .jsonl records are. A null or non-string value raises ValueError naming its row."""
    out = []
    for row, text in enumerate(values):
        if not isinstance(text, str):
            raise ValueError(
                f"dataset {where}: row {row} of column {column!r} is {type(text).__name__},"
                " not a string"
            )
        out.append(text.encode())
    if not out:
        raise ValueError(f"dataset {where} holds no records")
    return Documents(docs=out, separator=b"\n")


def build_manifest(
    data: bytes,
    *,
    name: str,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    heldout_every: int = DEFAULT_HELDOUT_EVERY,
    vocab_size: int = VOCAB_SIZE,
    tokenizer_hash: str = "",
) -> Manifest:
    """Cut the stream `data` into shards of `shard_tokens` tokens (of
    `token_width(vocab_size)` bytes); every `heldout_every`-th shard (from the 1st) is
    held out."""
    if shard_tokens < 1 or heldout_every < 2:
        raise ValueError("shard_tokens must be >= 1 and heldout_every >= 2")
    width = token_width(vocab_size)
    if len(data) % width:
        raise ValueError(f"a stream of {len(data)} bytes is not whole {width}-byte tokens")
    total = len(data) // width
    train: list[ShardInfo] = []
    heldout: list[ShardInfo] = []
    for i, start in enumerate(range(0, total, shard_tokens)):
        chunk = data[start * width : (start + shard_tokens) * width]
        info = ShardInfo(
            shard_id=i,
            start=start,
            tokens=len(chunk) // width,
            sha256=hashlib.sha256(chunk).hexdigest(),
        )
        (heldout if i % heldout_every == heldout_every - 1 else train).append(info)
    if not train or not heldout:
        raise ValueError(
            f"corpus of {total} tokens is too small for {shard_tokens}-token shards"
            f" with one held out in {heldout_every}"
        )
    return Manifest(
        name=name,
        content_hash=hashlib.sha256(data).hexdigest(),
        total_tokens=total,
        train=train,
        heldout=heldout,
        vocab_size=vocab_size,
        token_bytes=width,
        tokenizer_hash=tokenizer_hash,
    )


def shard_slice(data: bytes, shard: ShardInfo, token_bytes: int = 1) -> bytes:
    """The bytes of one shard of the stream `data` (not checked)."""
    return data[shard.start * token_bytes : (shard.start + shard.tokens) * token_bytes]


def shard_data(data: bytes, shard: ShardInfo, token_bytes: int = 1) -> bytes:
    """The bytes of one shard, checked against its sha256."""
    chunk = shard_slice(data, shard, token_bytes)
    verify_shard(chunk, shard, token_bytes)
    return chunk


def verify_shard(chunk: bytes, shard: ShardInfo, token_bytes: int = 1) -> None:
    if (
        len(chunk) != shard.tokens * token_bytes
        or hashlib.sha256(chunk).hexdigest() != shard.sha256
    ):
        raise ProtocolError(f"shard {shard.shard_id} failed its sha256 check")
