"""Reading datasets in every format (ingest.sources), the run's tokenizer
(ingest.tokenizer), the tokenized corpus and its cache (ingest.corpus) and
`agora tokenizer train` (ingest.tokenizer_cli), on real files written by pyarrow and by
`datasets`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import coordinator.dataset
import node.data
from coordinator.config import CoordinatorConfig
from ingest.corpus import load_corpus
from ingest.sources import read_user_documents
from ingest.tokenizer import END_OF_TEXT, RunTokenizer, train_bpe
from ingest.tokenizer_cli import main as tokenizer_main
from protocol.corpus import Documents, unpack_tokens

TEXTS = [f"def f{i}(x):\n    return x * {i}  # héllo {i % 7}\n" for i in range(300)]


def _parquet(path: Path, texts: list[str | None], column: str = "text") -> Path:
    pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path)
    return path


def test_parquet_file_and_directory(tmp_path: Path) -> None:
    one = _parquet(tmp_path / "one.parquet", TEXTS)
    docs = read_user_documents(one)
    assert docs.docs == [t.encode() for t in TEXTS] and docs.separator == b"\n"
    (tmp_path / "dir" / "b").mkdir(parents=True)
    _parquet(tmp_path / "dir" / "a.parquet", TEXTS[:100])
    _parquet(tmp_path / "dir" / "b" / "c.parquet", TEXTS[100:])
    assert read_user_documents(tmp_path / "dir").docs == docs.docs
    body = _parquet(tmp_path / "body.parquet", TEXTS, column="body")
    assert read_user_documents(body, "body").docs == docs.docs
    with pytest.raises(ValueError, match=r"no column 'text' \(it has \['body', 'n'\]\)"):
        read_user_documents(body)
    with pytest.raises(ValueError, match="row 1 of column 'text' is NoneType"):
        read_user_documents(_parquet(tmp_path / "null.parquet", ["a", None]))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_user_documents(tmp_path / "bad.parquet")


def test_a_datasets_save_to_disk_directory(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"content": TEXTS, "id": list(range(len(TEXTS)))})
    ds.save_to_disk(str(tmp_path / "saved"), max_shard_size="8KB")
    assert len(list((tmp_path / "saved").glob("*.arrow"))) > 1  # several data files, in order
    assert read_user_documents(tmp_path / "saved", "content").docs == [t.encode() for t in TEXTS]
    with pytest.raises(ValueError, match="no column 'text'"):
        read_user_documents(tmp_path / "saved")
    dd = datasets.DatasetDict({"train": ds, "test": ds.select(range(5))})
    dd.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="DatasetDict: name one split's directory"):
        read_user_documents(tmp_path / "dict", "content")
    assert len(read_user_documents(tmp_path / "dict" / "test", "content").docs) == 5


@pytest.fixture(scope="module")
def bpe() -> RunTokenizer:
    docs = Documents(docs=[t.encode() for t in TEXTS], separator=b"\n")
    return RunTokenizer.from_json(train_bpe(docs, 300))


def test_training_is_deterministic_and_the_tokenizer_loads(bpe: RunTokenizer) -> None:
    docs = Documents(docs=[t.encode() for t in TEXTS], separator=b"\n")
    assert train_bpe(docs, 300) == bpe.json
    assert bpe.vocab_size == 300 and bpe.backend.id_to_token(bpe.end_of_text) == END_OF_TEXT
    text = "def f3(x):\n    return x * 3  # ünïcode ✓\n"
    assert bpe.backend.decode(bpe.encode(text)) == text  # byte-level: every string round-trips
    assert len(bpe.encode(TEXTS[5])) < len(TEXTS[5].encode())  # the merges compress


def test_a_bad_tokenizer_is_refused_with_the_reason(tmp_path: Path, bpe: RunTokenizer) -> None:
    with pytest.raises(ValueError, match="not a tokenizers tokenizer.json"):
        RunTokenizer.from_json(b'{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="not a tokenizers tokenizer.json"):
        RunTokenizer.from_json(b"\xff\xfe")
    spec = json.loads(bpe.json)
    spec["added_tokens"] = []
    spec["model"]["vocab"].pop(END_OF_TEXT)
    with pytest.raises(ValueError, match="no end-of-text token"):
        RunTokenizer.from_json(json.dumps(spec).encode())
    with pytest.raises(ValueError, match="is not a file"):
        RunTokenizer.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="vocab_size=100 must be in"):
        train_bpe(Documents(docs=[b"x"], separator=b""), 100)
    assert RunTokenizer.load("bytes").is_bytes


def test_the_bpe_stream_is_each_document_then_end_of_text(
    tmp_path: Path, bpe: RunTokenizer
) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    manifest, stream = load_corpus(path, tokenizer=bpe, shard_tokens=64, heldout_every=4)
    assert manifest.token_bytes == 2 and manifest.vocab_size == 300
    assert manifest.tokenizer_hash == bpe.sha256
    ids = unpack_tokens(stream, 2)
    assert manifest.total_tokens == len(ids) and ids.count(bpe.end_of_text) == len(TEXTS)
    docs, doc = [], []
    for i in ids:
        if i == bpe.end_of_text:
            docs.append(bpe.backend.decode(doc))
            doc = []
        else:
            doc.append(i)
    assert docs == TEXTS


def test_the_stream_is_cached_and_keyed_by_data_and_tokenizer(
    tmp_path: Path, bpe: RunTokenizer
) -> None:
    data = _parquet(tmp_path / "d.parquet", TEXTS)
    cache = tmp_path / "cache"
    first = load_corpus(data, tokenizer=bpe, shard_tokens=64, cache_dir=cache)
    (cached,) = cache.iterdir()
    assert cached.read_bytes() == first[1]
    calls: list[int] = []
    again = load_corpus(data, tokenizer=bpe, shard_tokens=64, cache_dir=cache,
                        progress=lambda done, total: calls.append(done))  # fmt: skip
    assert again == first and calls == []  # nothing tokenized again
    other = RunTokenizer.from_json(
        train_bpe(Documents(docs=[t.encode() for t in TEXTS], separator=b""), 290)
    )
    load_corpus(data, tokenizer=other, shard_tokens=64, cache_dir=cache)
    _parquet(data, TEXTS[:-1])
    load_corpus(data, tokenizer=bpe, shard_tokens=64, cache_dir=cache)
    assert len(list(cache.iterdir())) == 3


def test_node_and_coordinator_tokenize_alike(tmp_path: Path, bpe: RunTokenizer) -> None:
    data = _parquet(tmp_path / "d.parquet", TEXTS)
    (tmp_path / "tok.json").write_bytes(bpe.json)
    cfg = CoordinatorConfig(
        dataset=str(data), tokenizer=str(tmp_path / "tok.json"), shard_tokens=200,
        heldout_every=16, db=str(tmp_path / "c.sqlite"),
    )  # fmt: skip
    manifest, stream = coordinator.dataset.load_dataset(cfg)
    ds = node.data.load_dataset(data, shard_tokens=200, tokenizer=bpe)
    assert ds.manifest == manifest and ds.data == stream
    assert ds.train.dtype.is_floating_point is False and int(ds.train.max()) < 300
    assert (tmp_path / "c.sqlite.tokens").is_dir()  # the coordinator's cache sits by its db


def test_agora_tokenizer_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _parquet(tmp_path / "d.parquet", TEXTS)
    out = tmp_path / "tok" / "tokenizer.json"
    args = ["train", "--dataset", str(data), "--vocab-size", "320", "--out", str(out)]
    assert tokenizer_main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    tok = RunTokenizer.load(out)
    assert summary["vocab_size"] == tok.vocab_size == 320 and summary["sha256"] == tok.sha256
    assert 0 < summary["tokens_per_byte"] < 1
    before = out.read_bytes()
    assert tokenizer_main(["train", "--dataset", str(data), "--vocab-size", "300",
                           "--out", str(out)]) == 2  # fmt: skip
    assert "exists; pass --force" in capsys.readouterr().err and out.read_bytes() == before
    assert tokenizer_main(["train", "--dataset", str(tmp_path / "nope"), "--vocab-size",
                           "300", "--out", str(tmp_path / "x.json")]) == 2  # fmt: skip
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
