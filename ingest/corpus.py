"""The run's corpus: a dataset tokenized once into the token stream, and its manifest.

`load_corpus(...)` reads the documents (`ingest.sources`), tokenizes them with the run's
tokenizer (`ingest.tokenizer`) and cuts the stream into shards (`protocol.corpus`
`build_manifest`: token offsets and the sha256 of every shard). A BPE stream is kept in
`cache_dir` under a key of the documents' hash and the tokenizer's, so a restart (or a
second reader on the same machine) tokenizes nothing again; the byte tokenizer needs no
cache (its stream is the documents joined).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

from ingest.sources import DEFAULT_TEXT_COLUMN, read_documents
from ingest.tokenizer import Progress, RunTokenizer
from protocol.corpus import (
    DEFAULT_HELDOUT_EVERY,
    DEFAULT_SHARD_TOKENS,
    Documents,
    Manifest,
    build_manifest,
)

log = logging.getLogger(__name__)


def documents_hash(documents: Documents) -> str:
    """sha256 over every document with its length (so the split points count too)."""
    h = hashlib.sha256(documents.separator)
    for doc in documents.docs:
        h.update(len(doc).to_bytes(8, "little"))
        h.update(doc)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in its directory and a rename, so a
    reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cached_stream(
    documents: Documents,
    tokenizer: RunTokenizer,
    cache_dir: Path | None,
    progress: Progress | None,
) -> bytes:
    if tokenizer.is_bytes:
        return documents.joined()
    if cache_dir is None:
        return tokenizer.stream(documents, progress)
    key = hashlib.sha256(f"{documents_hash(documents)}:{tokenizer.sha256}".encode()).hexdigest()
    path = Path(cache_dir) / f"{key}.tokens"
    if path.is_file():
        log.info("corpus: token stream from the cache %s", path)
        return path.read_bytes()
    stream = tokenizer.stream(documents, progress)
    write_atomic(path, stream)
    log.info("corpus: cached the token stream in %s", path)
    return stream


def load_stream(
    dataset: str | Path | None,
    *,
    tokenizer: RunTokenizer,
    text_column: str = DEFAULT_TEXT_COLUMN,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> tuple[bytes, str]:
    """The token stream of `dataset` under `tokenizer`, and the dataset's name."""
    documents, name = read_documents(dataset, text_column)
    return _cached_stream(documents, tokenizer, cache_dir, progress), name


def load_corpus(
    dataset: str | Path | None,
    *,
    tokenizer: RunTokenizer | None = None,
    text_column: str = DEFAULT_TEXT_COLUMN,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    heldout_every: int = DEFAULT_HELDOUT_EVERY,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
) -> tuple[Manifest, bytes]:
    """The manifest and token stream of `dataset` (None or "stdlib": the embedded corpus)
    under `tokenizer` (None: the byte tokenizer)."""
    tokenizer = tokenizer or RunTokenizer.byte_level()
    stream, name = load_stream(
        dataset, tokenizer=tokenizer, text_column=text_column, cache_dir=cache_dir,
        progress=progress,
    )  # fmt: skip
    manifest = build_manifest(
        stream,
        name=name,
        shard_tokens=shard_tokens,
        heldout_every=heldout_every,
        vocab_size=tokenizer.vocab_size,
        tokenizer_hash=tokenizer.sha256,
    )
    return manifest, stream
