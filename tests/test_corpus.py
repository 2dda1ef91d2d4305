"""The dataset contract (protocol.corpus, pure), the reader of the files (ingest.sources,
which node.data and coordinator.dataset both read through), and the torch side
(node.data's batches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import coordinator.dataset
import node.data
from coordinator.config import CoordinatorConfig
from ingest.sources import read_user_documents, stdlib_documents
from node.data import RandomBatches, eval_batches, shard_batches, split_dataset
from protocol.corpus import (
    Manifest,
    build_manifest,
    embedded_documents,
    is_stdlib_source,
    jsonl_documents,
    pack_tokens,
    shard_data,
    text_files_documents,
    token_stream,
    token_width,
    unpack_tokens,
    user_dataset_layout,
)
from protocol.errors import ProtocolError


def embedded_corpus(sources: list[tuple[str, bytes]]) -> bytes:
    return embedded_documents(sources).joined()


def text_files_corpus(files: list[tuple[str, bytes]], *, where: str) -> bytes:
    return text_files_documents(files, where=where).joined()


def jsonl_corpus(lines: list[bytes], *, where: str) -> bytes:
    return jsonl_documents(lines, where=where).joined()


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
    assert embedded_corpus(list(reversed(sources))) == data
    newer = embedded_corpus([*sources[1:], ("os.py", b"import sys\n# a newer Python\n")])
    m_a = build_manifest(data, name="a", shard_tokens=16, heldout_every=2)
    m_b = build_manifest(newer, name="b", shard_tokens=16, heldout_every=2)
    assert m_a.content_hash != m_b.content_hash


def test_user_dataset_layouts() -> None:
    assert user_dataset_layout("texts", entries=["a.txt"], where="d") == "text files"
    assert user_dataset_layout("x.jsonl", entries=None, where="x") == "jsonl"
    assert user_dataset_layout("x.parquet", entries=None, where="x") == "parquet"
    assert user_dataset_layout("pq", entries=["a.parquet", "b/c.parquet"], where="d") == "parquet"
    assert user_dataset_layout("mixed", entries=["a.parquet", "b.txt"], where="d") == "text files"
    saved = ["data-00000-of-00001.arrow", "dataset_info.json", "state.json"]
    assert user_dataset_layout("ds", entries=saved, where="d") == "datasets"
    with pytest.raises(ValueError, match="DatasetDict: name one split"):
        user_dataset_layout("dd", entries=["dataset_dict.json", "train/state.json"], where="dd")
    with pytest.raises(ValueError, match="data.csv must be a directory, a .jsonl"):
        user_dataset_layout("data.csv", entries=None, where="/d/data.csv")
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


def test_a_wide_token_stream_is_cut_in_tokens_not_bytes() -> None:
    ids = [(i * 977) % 5000 for i in range(1000)]
    stream = pack_tokens(ids, 2)
    m = build_manifest(stream, name="t", shard_tokens=100, heldout_every=4, vocab_size=5000)
    assert m.token_bytes == 2 and m.total_tokens == 1000 and m.vocab_size == 5000
    assert [s.start for s in sorted(m.train + m.heldout, key=lambda s: s.shard_id)] == list(
        range(0, 1000, 100)
    )
    assert unpack_tokens(shard_data(stream, m.train[1], 2), 2) == ids[100:200]
    with pytest.raises(ProtocolError, match="sha256"):
        shard_data(stream, m.train[1], 1)
    with pytest.raises(ValueError, match="whole 2-byte tokens"):
        build_manifest(stream[:-1], name="t", shard_tokens=100, vocab_size=5000)
    assert Manifest.from_wire(m.to_wire()) == m


def test_token_stream_ends_every_document_and_bounds_the_ids() -> None:
    assert unpack_tokens(token_stream([[5, 6], [], [7]], end_of_text=0, vocab_size=300), 2) == [
        5, 6, 0, 0, 7, 0,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="outside the vocabulary of 300"):
        token_stream([[300]], end_of_text=0, vocab_size=300)


@given(
    st.sampled_from([256, 300, 1 << 16, (1 << 16) + 1, 1 << 20]).flatmap(
        lambda v: st.tuples(st.just(v), st.lists(st.integers(0, v - 1), max_size=200))
    )
)
def test_pack_and_unpack_tokens_round_trip(case: tuple[int, list[int]]) -> None:
    vocab, ids = case
    width = token_width(vocab)
    data = pack_tokens(ids, width)
    assert len(data) == width * len(ids) and unpack_tokens(data, width) == ids


@given(st.binary(max_size=64), st.sampled_from([1, 2, 4]))
def test_unpack_tokens_takes_any_bytes_or_says_why(data: bytes, width: int) -> None:
    try:
        ids = unpack_tokens(data, width)
    except ValueError as exc:
        assert "whole" in str(exc) and len(data) % width
    else:
        assert pack_tokens(ids, width) == data


# --- reading the files (ingest.sources) -------------------------------------------------------


def _fake_stdlib(root: Path, extra: str = "") -> Path:
    (root / "json").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "site-packages" / "pkg").mkdir(parents=True)
    (root / "os.py").write_text("import sys\n" + extra)
    (root / "json" / "__init__.py").write_text("def dumps(x):\n    pass\n")
    (root / "test" / "test_os.py").write_text("skipped\n")
    (root / "site-packages" / "pkg" / "m.py").write_text("skipped\n")
    return root


def test_stdlib_corpus_reads_the_sources_and_differs_between_pythons(tmp_path: Path) -> None:
    def stdlib_corpus(root: Path) -> bytes:
        return stdlib_documents(root).joined()

    a = _fake_stdlib(tmp_path / "a")
    data = stdlib_corpus(a)
    assert data.startswith(b"# ==== json/__init__.py ====\n") and b"skipped" not in data
    assert b"# ==== os.py ====\nimport sys\n" in data and stdlib_corpus(a) == data
    b = _fake_stdlib(tmp_path / "b", extra="# a newer Python\n")
    assert stdlib_corpus(b) != data


def test_user_datasets(tmp_path: Path) -> None:
    def read_user_dataset(path: Path) -> bytes:
        return read_user_documents(path).joined()

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
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="must be a directory, a .jsonl"):
        read_user_dataset(tmp_path / "data.csv")
    with pytest.raises(ValueError, match="does not exist"):
        read_user_dataset(tmp_path / "missing")


def test_directory_order_is_by_path_component(tmp_path: Path) -> None:
    for name in ("a/b", "a-b", "a/c/d", "a.b", "z"):
        (tmp_path / "ds" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ds" / name).write_text(name)
    assert read_user_documents(tmp_path / "ds").joined() == b"a/b\na/c/d\na-b\na.b\nz"


def test_node_and_coordinator_cut_the_same_stream(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "t.txt").write_bytes(bytes(range(256)) * 40)
    cfg = CoordinatorConfig(
        dataset=str(tmp_path / "ds"), shard_tokens=160, heldout_every=16, token_cache=""
    )
    manifest, data = coordinator.dataset.load_dataset(cfg)
    ds = node.data.load_dataset(tmp_path / "ds", shard_tokens=160)
    assert ds.data == data and ds.manifest == manifest


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
