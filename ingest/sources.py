"""A dataset's documents from disk: the embedded stdlib corpus or a user dataset.

`read_documents(dataset, text_column)` reads the files and hands them to the layout
functions of `protocol.corpus`, which fix the order and the separators. A user dataset is
a directory of text files, a `.jsonl`, a `.parquet` file or a directory of them, or a
directory `datasets`' `save_to_disk` wrote (its Arrow files, read with pyarrow; the
`datasets` package is not needed to read it).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Callable
from pathlib import Path

from protocol.corpus import (
    Documents,
    column_documents,
    embedded_documents,
    is_stdlib_source,
    jsonl_documents,
    text_files_documents,
    user_dataset_layout,
)

STDLIB = "stdlib"  # the `dataset` name of the embedded corpus
DEFAULT_TEXT_COLUMN = "text"


def read_tree(
    root: Path, keep: Callable[[str], bool] = lambda rel: True
) -> list[tuple[str, bytes]]:
    """(POSIX path relative to `root`, bytes) of every file under `root` that `keep` accepts."""
    found = ((p.relative_to(root).as_posix(), p) for p in root.rglob("*"))
    return [(rel, p.read_bytes()) for rel, p in found if keep(rel) and p.is_file()]


def stdlib_documents(root: Path | None = None) -> Documents:
    """The embedded corpus, read from this Python's standard library (or `root`)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    return embedded_documents(read_tree(base, is_stdlib_source))


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _column(table: object, column: str, where: str) -> list[object]:
    names = list(getattr(table, "column_names", []))
    if column not in names:
        raise ValueError(
            f"dataset {where} has no column {column!r} (it has {names}); set text_column"
        )
    values: list[object] = table.column(column).to_pylist()  # type: ignore[attr-defined]
    return values


def _parquet(path: Path, column: str) -> Documents:
    import pyarrow.parquet as pq
    from pyarrow.lib import ArrowException

    files = [path] if path.is_file() else [path / rel for rel in _files(path)]
    values: list[object] = []
    for f in files:
        try:
            names = pq.read_schema(f).names
            if column not in names:
                raise ValueError(
                    f"dataset {f} has no column {column!r} (it has {names}); set text_column"
                )
            table = pq.read_table(f, columns=[column])
        except (OSError, ArrowException) as exc:
            raise ValueError(f"dataset {f}: not a readable Parquet file ({exc})") from exc
        values += _column(table, column, str(f))
    return column_documents(values, where=str(path), column=column)


def _saved_dataset(path: Path, column: str) -> Documents:
    """A `datasets` `save_to_disk` directory: the Arrow stream files `state.json` lists."""
    import pyarrow as pa
    from pyarrow.lib import ArrowException

    try:
        state = json.loads((path / "state.json").read_text())
        names = [entry["filename"] for entry in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"dataset {path}: state.json does not list its data files") from exc
    values: list[object] = []
    for name in names:
        f = path / name
        if not isinstance(name, str) or "/" in name or not f.is_file():
            raise ValueError(f"dataset {path}: state.json names a missing file {name!r:.100}")
        try:
            with pa.memory_map(str(f)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, ArrowException) as exc:
            raise ValueError(f"dataset {f}: not an Arrow stream ({exc})") from exc
        values += _column(table, column, str(f))
    return column_documents(values, where=str(path), column=column)


def read_user_documents(path: Path, text_column: str = DEFAULT_TEXT_COLUMN) -> Documents:
    """A user dataset's documents (see the module docstring for the formats)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset {path} does not exist")
    entries = _files(path) if path.is_dir() else None
    layout = user_dataset_layout(path.name, entries=entries, where=str(path))
    if layout == "text files":
        return text_files_documents(read_tree(path), where=str(path))
    if layout == "parquet":
        return _parquet(path, text_column)
    if layout == "datasets":
        return _saved_dataset(path, text_column)
    with path.open("rb") as lines:
        return jsonl_documents(lines, where=str(path), column=text_column)


def read_documents(
    dataset: str | Path | None, text_column: str = DEFAULT_TEXT_COLUMN
) -> tuple[Documents, str]:
    """The documents of `dataset` (None or "stdlib": the embedded corpus) and its name."""
    if dataset is None or str(dataset) == STDLIB:
        return stdlib_documents(), STDLIB
    path = Path(dataset)
    return read_user_documents(path, text_column), path.name
