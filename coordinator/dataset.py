"""The coordinator's copy of the dataset: read the files, cut the manifest.

The layout of the corpus bytes and the shard cut are `protocol.corpus`'s; this module only
reads files and passes them through it, so its bytes match node.data's byte for byte
(node.data holds the node's twin of `stdlib_corpus` and `read_user_dataset`; coordinator
and node never import each other, and protocol reads no files).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

from coordinator.config import CoordinatorConfig
from protocol.corpus import (
    Manifest,
    build_manifest,
    embedded_corpus,
    is_stdlib_source,
    jsonl_corpus,
    text_files_corpus,
    user_dataset_layout,
)

STDLIB = "stdlib"  # the `dataset` setting that names the embedded corpus


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


def load_dataset(cfg: CoordinatorConfig) -> tuple[Manifest, bytes]:
    """The run's corpus (`cfg.dataset`) and its manifest, cut as `cfg` says."""
    if cfg.dataset == STDLIB:
        data, name = stdlib_corpus(), STDLIB
    else:
        path = Path(cfg.dataset)
        data, name = read_user_dataset(path), path.name
    manifest = build_manifest(
        data, name=name, shard_tokens=cfg.shard_tokens, heldout_every=cfg.heldout_every
    )
    return manifest, data
