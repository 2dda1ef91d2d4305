"""The run's tokenizer: the byte tokenizer, or a BPE `tokenizer.json` of `tokenizers`.

- `RunTokenizer.load(spec)`: `"bytes"` or the path of a `tokenizer.json`;
  `RunTokenizer.from_json(data)` is the same for bytes that came over the network (a
  node checks them against the run's hash first).
- `RunTokenizer.stream(documents)` tokenizes a dataset into the run's token stream
  (`protocol.corpus`: bytes as they are, or each document's ids and the end-of-text id).
- `train_bpe(documents, vocab_size)` trains a byte-level BPE on the run's own data, with
  `<|endoftext|>` as its end-of-text token (`agora tokenizer train`).
A BPE tokenizer is identified by the sha256 of its JSON bytes, which the manifest and the
run's settings carry, so every node tokenizes the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.corpus import VOCAB_SIZE, Documents, token_stream

BYTES = "bytes"  # the `tokenizer` setting of the byte tokenizer
TOKENIZER_FILE = "tokenizer.json"  # the file name a run's tokenizer travels under
END_OF_TEXT = "<|endoftext|>"  # the end-of-text token `train_bpe` adds
# end-of-text tokens recognised in a tokenizer.json trained elsewhere, in order
END_OF_TEXT_NAMES = (END_OF_TEXT, "</s>", "<eos>", "<|end_of_text|>")
MAX_TOKENIZER_BYTES = 32 << 20  # a tokenizer.json larger than this is refused (bytes)
MIN_BPE_VOCAB = VOCAB_SIZE + 2  # the 256 byte symbols, one merge and end-of-text (tokens)
MAX_BPE_VOCAB = 1 << 20  # tokens
_BATCH_DOCS = 512  # documents encoded per call (for progress and memory)

Progress = Callable[[int, int], None]  # (documents done, documents in all)


def _decode(doc: bytes) -> str:
    # tokenizers takes str; bytes that are not UTF-8 become U+FFFD (the same on every side)
    return doc.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class RunTokenizer:
    """The byte tokenizer (`json` empty) or a loaded `tokenizers` BPE."""

    json: bytes  # the tokenizer.json bytes ("" for the byte tokenizer)
    vocab_size: int  # tokens
    end_of_text: int  # id that ends each document (-1: the byte tokenizer has none)
    backend: Any = None  # the tokenizers.Tokenizer

    @property
    def is_bytes(self) -> bool:
        return not self.json

    @property
    def sha256(self) -> str:
        """The run's `tokenizer_hash`: sha256 of the JSON bytes ("" for the byte tokenizer)."""
        return hashlib.sha256(self.json).hexdigest() if self.json else ""

    @property
    def name(self) -> str:
        return BYTES if self.is_bytes else f"bpe-{self.vocab_size}-{self.sha256[:12]}"

    @classmethod
    def byte_level(cls) -> RunTokenizer:
        return cls(json=b"", vocab_size=VOCAB_SIZE, end_of_text=-1)

    @classmethod
    def load(cls, spec: str | Path) -> RunTokenizer:
        """`"bytes"`, or a tokenizer.json file."""
        if str(spec) == BYTES:
            return cls.byte_level()
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"tokenizer {path} is not a file (give 'bytes' or a tokenizer.json)")
        if path.stat().st_size > MAX_TOKENIZER_BYTES:
            raise ValueError(f"tokenizer {path} is larger than {MAX_TOKENIZER_BYTES} bytes")
        return cls.from_json(path.read_bytes(), where=str(path))

    @classmethod
    def from_json(cls, data: bytes, *, where: str = "tokenizer.json") -> RunTokenizer:
        """A BPE tokenizer from its JSON bytes; ValueError naming `where` if unusable."""
        from tokenizers import Tokenizer

        if len(data) > MAX_TOKENIZER_BYTES:
            raise ValueError(f"{where}: larger than {MAX_TOKENIZER_BYTES} bytes")
        try:
            backend = Tokenizer.from_str(data.decode("utf-8"))
        except (UnicodeDecodeError, Exception) as exc:  # tokenizers raises plain Exception
            raise ValueError(f"{where}: not a tokenizers tokenizer.json ({exc})") from exc
        vocab = backend.get_vocab_size(with_added_tokens=True)
        if not MIN_BPE_VOCAB <= vocab <= MAX_BPE_VOCAB:
            raise ValueError(
                f"{where}: vocabulary of {vocab} tokens is outside {MIN_BPE_VOCAB}..{MAX_BPE_VOCAB}"
            )
        eot = next(
            (i for name in END_OF_TEXT_NAMES if (i := backend.token_to_id(name)) is not None),
            None,
        )
        if eot is None:
            raise ValueError(
                f"{where}: no end-of-text token (one of {list(END_OF_TEXT_NAMES)}) to end"
                " documents with"
            )
        return cls(json=data, vocab_size=vocab, end_of_text=eot, backend=backend)

    def encode(self, text: str) -> list[int]:
        if self.is_bytes:
            return list(text.encode())
        ids: list[int] = self.backend.encode(text, add_special_tokens=False).ids
        return ids

    def stream(self, documents: Documents, progress: Progress | None = None) -> bytes:
        """The run's token stream of `documents` (`protocol.corpus` says the layout)."""
        if self.is_bytes:
            return documents.joined()
        docs = documents.docs

        def encoded() -> Iterator[list[int]]:
            for i in range(0, len(docs), _BATCH_DOCS):
                batch = [_decode(d) for d in docs[i : i + _BATCH_DOCS]]
                out = self.backend.encode_batch(batch, add_special_tokens=False)
                yield from (e.ids for e in out)
                if progress is not None:
                    progress(min(i + _BATCH_DOCS, len(docs)), len(docs))

        return token_stream(encoded(), end_of_text=self.end_of_text, vocab_size=self.vocab_size)


def train_bpe(documents: Documents, vocab_size: int, *, show_progress: bool = False) -> bytes:
    """A byte-level BPE of `vocab_size` tokens (the 256 byte symbols, the merges and
    `<|endoftext|>`) trained on `documents`; its tokenizer.json bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} must be in {MIN_BPE_VOCAB}..{MAX_BPE_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    docs = documents.docs
    tok.train_from_iterator((_decode(d) for d in docs), trainer=trainer, length=len(docs))
    data: bytes = tok.to_str().encode()
    RunTokenizer.from_json(data, where="the trained tokenizer")  # it must load as ours
    return data
