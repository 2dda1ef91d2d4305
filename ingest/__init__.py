"""Reading a run's data and tokenizer from disk, for the coordinator and the node alike.

The byte-exact layouts are `protocol.corpus`'s; this package does the file I/O around them
(text files, .jsonl, Parquet, `datasets` directories: `sources`), the tokenizer
(`tokenizer`: the byte tokenizer or a `tokenizers` BPE, and training one), and the
tokenized, sharded corpus with its on-disk cache (`corpus`). It imports `protocol` only,
so `node` and `coordinator` share one reader and never each other.
"""
