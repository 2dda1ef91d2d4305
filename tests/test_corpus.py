"""The dataset contract (protocol.corpus, pure), the two readers of the files
(node.data and coordinator.dataset, which must agree byte for byte), and the torch side
(node.data's batches)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

import coordinator.dataset
import node.data
from coordinator.config import CoordinatorConfig
from node.data import RandomBatches, eval_batches, shard_batches, split_dataset
from protocol.corpus import (
    Manifest,
    build_manifest,
    embedded_corpus,
    is_stdlib_source,
    jsonl_corpus,
    shard_data,
    text_files_corpus,
    user_dataset_layout,
)
from protocol.errors import ProtocolError

# --- the pure contract (protocol.corpus) ----------------------------------------------------


def test_embedded_corpus_is_sorted_by_path_and_skips_tests() -> None:
    assert is_stdlib_source("os.py") and is_stdlib_source("json/__init__.py")
    for rel in ("test/test_os.py", "site-packages/pkg/m.py", "a/__pycache__/m.py", "README"):
        assert not is_stdlib_source(rel), rel
    sources = [
        ("os.py", b"import sys\n"),
        ("test/test_os.py", b"skipped\n"),
        ("json/__init__.py", b"def dumps(x):\n    pass\n"),
        ("site-packages/pkg/m.py", b"skipped\n"),
    ]
    data = embedded_corpus(sources)
    assert data == (
        b"# ==== json/__init__.py ====\ndef dumps(x):\n    pass\n\n"
        b"# ==== os.py ====\nimport sys\n\n"
    )
    assert embedded_corpus(reversed(sources)) == data
    newer = embedded_corpus([*sources[1:], ("os.py", b"import sys\n# a newer Python\n")])
    m_a = build_manifest(data, name="a", shard_tokens=16, heldout_every=2)
    m_b = build_manifest(newer, name="b", shard_tokens=16, heldout_every=2)
    assert m_a.content_hash != m_b.content_hash


def test_user_dataset_layouts() -> None:
    assert user_dataset_layout("texts", is_dir=True, where="d") == "text files"
    assert user_dataset_layout("x.jsonl", is_dir=False, where="x") == "jsonl"
    with pytest.raises(ValueError, match="data.csv must be a directory of text files"):
        user_dataset_layout("data.csv", is_dir=False, where="/d/data.csv")
    files = [("b.txt", b"second"), ("sub/a.txt", b"third"), ("a.txt", b"first")]
    assert text_files_corpus(files, where="d") == b"first\nsecond\nthird"
    # paths sort by component, as pathlib orders them: "a/b" before "a-b"
    assert text_files_corpus([("a-b", b"2"), ("a/b", b"1")], where="d") == b"1\n2"
    with pytest.raises(ValueError, match="d holds no files"):
        text_files_corpus([], where="d")
    lines = [json.dumps({"text": "héllo"}).encode() + b"\n", b"\n", b'{"text": "b", "id": 1}\n']
    assert jsonl_corpus(lines, where="x.jsonl") == "héllo\nb".encode()
    for bad in (b'{"no": 1}', b"[1, 2]", b'{"text": 5}', b"not json", b'"str"'):
        with pytest.raises(ValueError, match="x.jsonl:2"):
            jsonl_corpus([b"\n", bad + b"\n"], where="x.jsonl")
    with pytest.raises(ValueError, match="holds no records"):
        jsonl_corpus([b"  \n"], where="x.jsonl")


def test_manifest_shards_cover_the_corpus_and_hold_out_every_nth() -> None:
    data = bytes(range(256)) * 40
    m = build_manifest(data, name="t", shard_tokens=100, heldout_every=4)
    shards = sorted(m.train + m.heldout, key=lambda s: s.shard_id)
    assert [s.start for s in shards] == list(range(0, len(data), 100))
    assert sum(s.tokens for s in shards) == len(data) == m.total_tokens
    assert {s.shard_id for s in m.heldout} == {i for i in range(len(shards)) if i % 4 == 3}
    assert Manifest.from_wire(m.to_wire()) == m
    assert shard_data(data, m.train[0]) == data[:100]
    tampered = b"x" + data[1:]
    with pytest.raises(ProtocolError, match="sha256"):
        shard_data(tampered, m.train[0])
    with pytest.raises(ValueError, match="too small"):
        build_manifest(b"abc", name="t", shard_tokens=100)
    with pytest.raises(KeyError):
        m.shard(m.heldout[0].shard_id)


# --- reading the files (node.data and coordinator.dataset) ----------------------------------

READERS = [node.data, coordinator.dataset]


def _fake_stdlib(root: Path, extra: str = "") -> Path:
    (root / "json").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "os.py").write_text("import sys\n" + extra)
    (root / "json" / "__init__.py").write_text("def dumps(x):\n    pass\n")
    (root / "test" / "test_os.py").write_text("skipped\n")
    (root / "site-packages" / "pkg" / "m.py").write_text("skipped\n")
    return root


@pytest.mark.parametrize("reader", READERS, ids=lambda m: m.__name__)
def test_stdlib_corpus_reads_the_sources_and_differs_between_pythons(
    reader: ModuleType, tmp_path: Path
) -> None:
    stdlib_corpus: Callable[[Path], bytes] = reader.stdlib_corpus
    a = _fake_stdlib(tmp_path / "a")
    data = stdlib_corpus(a)
    assert data.startswith(b"# ==== json/__init__.py ====\n") and b"skipped" not in data
    assert b"# ==== os.py ====\nimport sys\n" in data and stdlib_corpus(a) == data
    b = _fake_stdlib(tmp_path / "b", extra="# a newer Python\n")
    assert stdlib_corpus(b) != data


@pytest.mark.parametrize("reader", READERS, ids=lambda m: m.__name__)
def test_user_datasets(reader: ModuleType, tmp_path: Path) -> None:
    read_user_dataset: Callable[[Path], bytes] = reader.read_user_dataset
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("second")
    (d / "sub" / "a.txt").write_text("third")
    (d / "a.txt").write_text("first")
    assert read_user_dataset(d) == b"first\nsecond\nthird"
    j = tmp_path / "x.jsonl"
    j.write_text(json.dumps({"text": "héllo"}) + "\n\n" + json.dumps({"text": "b", "id": 1}) + "\n")
    assert read_user_dataset(j) == "héllo\nb".encode()
    for bad in ('{"no": 1}', "[1, 2]", '{"text": 5}', "not json", '"str"'):
        j.write_text(bad + "\n")
        with pytest.raises(ValueError, match="x.jsonl:1"):
            read_user_dataset(j)
    with pytest.raises(ValueError, match="no files"):
        (tmp_path / "empty").mkdir()
        read_user_dataset(tmp_path / "empty")
    with pytest.raises(ValueError, match="directory of text files"):
        read_user_dataset(tmp_path / "data.csv")


def test_node_and_coordinator_read_the_same_bytes(tmp_path: Path) -> None:
    root = _fake_stdlib(tmp_path / "stdlib")
    assert node.data.stdlib_corpus(root) == coordinator.dataset.stdlib_corpus(root)
    for name in ("a/b", "a-b", "a/c/d", "a.b", "z"):
        (tmp_path / "ds" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ds" / name).write_text(name)
    got = node.data.read_user_dataset(tmp_path / "ds")
    assert got == coordinator.dataset.read_user_dataset(tmp_path / "ds")
    assert got == b"a/b\na/c/d\na-b\na.b\nz"


def test_coordinator_cuts_the_configured_dataset(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "t.txt").write_bytes(bytes(range(256)) * 4)
    cfg = CoordinatorConfig(dataset=str(tmp_path / "ds"), shard_tokens=100, heldout_every=4)
    manifest, data = coordinator.dataset.load_dataset(cfg)
    assert manifest.name == "ds" and manifest.total_tokens == len(data) == 1024
    assert len(manifest.train) + len(manifest.heldout) == 11 and len(manifest.heldout) == 2


# --- the torch side (node.data) ---------------------------------------------------------------


def test_batches_come_from_the_right_split() -> None:
    data = bytes((i * 7) % 256 for i in range(64_000))
    ds = split_dataset(data, "t")
    assert ds.train.numel() + ds.heldout.numel() == len(data)
    train_set = {bytes(ds.train[i : i + 9].tolist()) for i in range(0, ds.train.numel() - 9)}
    x, y = next(RandomBatches(ds.train, 4, 8, seed=0))
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y, strict=True):
        assert bytes([*row_x.tolist(), int(row_y[-1])]) in train_set
    held = eval_batches(ds.heldout, 4, 8, 3)
    assert len(held) == 3 and all(b[0].shape == (4, 8) for b in held)
    again = eval_batches(ds.heldout, 4, 8, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(held, again, strict=True))


def test_shard_batches_are_consecutive_from_an_offset() -> None:
    shard = bytes(range(200))
    got = list(shard_batches(shard, 2, 10, offset=20))
    assert [off for off, _ in got] == [20, 40, 60, 80, 100, 120, 140, 160]
    off, (x, y) = got[0]
    assert x[0].tolist() == list(range(20, 30)) and x[1].tolist() == list(range(30, 40))
    assert y[1].tolist() == list(range(31, 41))
