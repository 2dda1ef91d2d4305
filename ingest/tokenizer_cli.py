"""`agora tokenizer`: train the run's BPE tokenizer on the run's own data (no downloads).

    agora tokenizer train --dataset D --vocab-size N --out tokenizer.json

`--dataset` takes what the coordinator's `dataset` setting takes ('stdlib', text files,
.jsonl, Parquet, a `datasets` directory). The file is written atomically and an existing
one is kept unless `--force`. Name it in the coordinator's `tokenizer` setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ingest.corpus import write_atomic
from ingest.sources import DEFAULT_TEXT_COLUMN, read_documents
from ingest.tokenizer import END_OF_TEXT, MAX_BPE_VOCAB, MIN_BPE_VOCAB, RunTokenizer, train_bpe

SAMPLE_DOCS = 200  # documents the summary's tokens-per-byte figure is measured on


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agora tokenizer",
        description="Train a byte-level BPE tokenizer (tokenizers' tokenizer.json) on a"
        f" dataset. It ends every document with {END_OF_TEXT}; the coordinator serves it"
        " to every node with its sha256.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a BPE tokenizer on a dataset")
    t.add_argument(
        "--dataset",
        required=True,
        help="'stdlib', a directory of text files, a .jsonl, a .parquet file or directory,"
        " or a directory written by datasets' save_to_disk",
    )
    t.add_argument("--text-column", default=DEFAULT_TEXT_COLUMN, help="column holding the text")
    t.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help=f"tokens in the vocabulary, {MIN_BPE_VOCAB}..{MAX_BPE_VOCAB} (e.g. 32000)",
    )
    t.add_argument("--out", type=Path, required=True, help="the tokenizer.json to write")
    t.add_argument("--force", action="store_true", help="replace an existing --out file")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        print(f"agora tokenizer: {args.out} exists; pass --force to replace it", file=sys.stderr)
        return 2
    documents, name = read_documents(args.dataset, args.text_column)
    size = sum(map(len, documents.docs))
    print(f"training a {args.vocab_size}-token BPE on {name}: {len(documents.docs)} documents,"
          f" {size} bytes", file=sys.stderr)  # fmt: skip
    data = train_bpe(documents, args.vocab_size, show_progress=sys.stderr.isatty())
    tok = RunTokenizer.from_json(data, where=str(args.out))
    sample = documents.docs[:SAMPLE_DOCS]
    ids = sum(len(tok.encode(d.decode("utf-8", errors="replace"))) for d in sample)
    write_atomic(args.out, data)
    summary = {
        "out": str(args.out),
        "vocab_size": tok.vocab_size,
        "end_of_text": tok.end_of_text,
        "sha256": tok.sha256,
        "tokens_per_byte": round(ids / max(1, sum(map(len, sample))), 4),
    }
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except ValueError as exc:
        print(f"agora tokenizer: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agora tokenizer: interrupted; nothing written", file=sys.stderr)
        return 130
