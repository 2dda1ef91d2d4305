"""Run and node configuration files written from dicts: the one TOML writer of the tools.

`write_toml(path, {"run_id": "x", "node": {"outer_every_steps": 0}})` writes the scalars
first and every nested dict as a `[table]`. Values are str, bool, int, float or lists of
them; None leaves a key out. Strings are escaped, so any path or token is safe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v))  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def toml_text(values: Mapping[str, Any]) -> str:
    """The TOML text of `values` (one level of tables)."""
    lines = [
        f"{k} = {_value(v)}"
        for k, v in values.items()
        if v is not None and not isinstance(v, Mapping)
    ]
    for table, body in values.items():
        if isinstance(body, Mapping):
            lines.append(f"[{table}]")
            lines += [f"{k} = {_value(v)}" for k, v in body.items() if v is not None]
    return "\n".join(lines) + "\n"


def write_toml(path: Path, values: Mapping[str, Any]) -> Path:
    """Write `values` as TOML to `path`; returns `path`."""
    path = Path(path)
    path.write_text(toml_text(values))
    return path
