"""The dataset contract (protocol.corpus) and its torch side (node.data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from node.data import RandomBatches, eval_batches, shard_batches, split_dataset
from protocol.corpus import (
    Manifest,
    build_manifest,
    read_user_dataset,
    shard_data,
    stdlib_corpus,
    stdlib_sources,
)
from protocol.errors import ProtocolError


def _fake_stdlib(root: Path, extra: str = "") -> Path:
    (root / "json").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "os.py").write_text("import sys\n" + extra)
    (root / "json" / "__init__.py").write_text("def dumps(x):\n    pass\n")
    (root / "test" / "test_os.py").write_text("skipped\n")
    (root / "site-packages" / "pkg" / "m.py").write_text("skipped\n")
    return root


def test_stdlib_corpus_is_sorted_skips_tests_and_differs_between_pythons(tmp_path: Path) -> None:
    a = _fake_stdlib(tmp_path / "a")
    names = [p.relative_to(a).as_posix() for p in stdlib_sources(a)]
    assert names == ["json/__init__.py", "os.py"]
    data = stdlib_corpus(a)
    assert data.startswith(b"# ==== json/__init__.py ====\n") and b"skipped" not in data
    assert stdlib_corpus(a) == data
    b = _fake_stdlib(tmp_path / "b", extra="# a newer Python\n")
    m_a = build_manifest(data, name="a", shard_tokens=16, heldout_every=2)
    m_b = build_manifest(stdlib_corpus(b), name="b", shard_tokens=16, heldout_every=2)
    assert m_a.content_hash != m_b.content_hash


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


def test_user_datasets(tmp_path: Path) -> None:
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
