"""Bounds and field readers of the outer-process contract (`node.outer.contract`): each
reader takes one field of a decoded msgpack map and returns it checked, or raises
`protocol.errors.ProtocolError` naming the command or reply and the field. Imports
neither torch nor hivemind nor libp2p.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from node.outer.settings import finite
from protocol.codec import unpackb
from protocol.errors import ProtocolError
from protocol.lineage import Link, check_lineage, to_plain

MAX_CONTROL_FRAME = 1 << 20  # bytes; control frames are small, tensors go through shared memory
MAX_NUMEL = 2**40  # elements in one stage's flat state, a sanity bound
MAX_STAGE = 1023  # highest stage index
MAX_PEERS = 4096  # entries in a list of multiaddrs, or in a map keyed by peer id
MAX_ADDR = 1024  # characters in one multiaddr or peer id
MAX_PATH = 4096  # characters in a shared-memory path
MAX_TEXT = 4096  # characters in an error message
MAX_DIGEST = 64  # characters in a state digest
MAX_WAIT_S = 86_400.0  # longest timeout a command may ask for (s)


def tagged(payload: bytes, what: str) -> tuple[str, dict[str, Any]]:
    obj = unpackb(payload, max_size=MAX_CONTROL_FRAME)
    if type(obj) is not dict or type(obj.get("op")) is not str:
        raise ProtocolError(f"a {what} must be a map with a string 'op'")
    return obj["op"], obj


def fields_of(cls: Any, obj: Any, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """`obj` as a map tagged `cls.OP` holding exactly `cls`'s fields (less `optional`)."""
    op: str = cls.OP
    if type(obj) is not dict or obj.get("op") != op:
        raise ProtocolError(f"expected a map with op {op!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(obj) - names - {"op"}
    if unknown:
        raise ProtocolError(f"{op}: unknown keys {sorted(map(str, unknown))[:8]}")
    missing = names - set(obj) - set(optional)
    if missing:
        raise ProtocolError(f"{op}: missing keys {sorted(missing)}")
    return obj


def where(cls: type) -> str:
    return str(getattr(cls, "OP", cls.__name__))


def int_of(d: dict[str, Any], key: str, cls: type, *, lo: int, hi: int) -> int:
    v = d[key]
    if type(v) is not int or not lo <= v <= hi:
        raise ProtocolError(f"{where(cls)}: {key} must be an int in [{lo}, {hi}]")
    return v


def float_of(
    d: dict[str, Any], key: str, cls: type, *, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = finite(d[key])
    if v is None:
        raise ProtocolError(f"{where(cls)}: {key} must be a finite number")
    if v < lo or v > hi or (lo_open and v == lo):
        raise ProtocolError(f"{where(cls)}: {key} = {v} outside its range from {lo} to {hi}")
    return v


def bool_of(d: dict[str, Any], key: str) -> bool:
    v = d[key]
    if type(v) is not bool:
        raise ProtocolError(f"{key} must be a bool")
    return v


def str_of(d: dict[str, Any], key: str, cls: type, *, max_len: int, min_len: int = 0) -> str:
    v = d[key]
    if type(v) is not str or not min_len <= len(v) <= max_len:
        raise ProtocolError(f"{where(cls)}: {key} must be a str of {min_len}-{max_len} chars")
    return v


def strs_of(d: dict[str, Any], key: str, cls: type) -> list[str]:
    v = d[key]
    if type(v) is not list or len(v) > MAX_PEERS:
        raise ProtocolError(f"{where(cls)}: {key} must be a list of at most {MAX_PEERS}")
    if any(type(x) is not str or not 0 < len(x) <= MAX_ADDR for x in v):
        raise ProtocolError(f"{where(cls)}: {key} must hold strs of 1-{MAX_ADDR} chars")
    return list(v)


def lineage_of(d: dict[str, Any], cls: type) -> list[Link]:
    return check_lineage(d["lineage"], f"{where(cls)}: lineage")


def with_link(out: dict[str, Any], key: str, link: Link | None) -> dict[str, Any]:
    """`out` with the optional (round, digest) `link` under `key` (absent when None)."""
    if link is not None:
        out[key] = to_plain([link])
    return out


def link_of(d: dict[str, Any], key: str, cls: type) -> Link | None:
    """The optional (round, digest) under `key`, checked; None when absent."""
    if key not in d:
        return None
    got = check_lineage(d[key], f"{where(cls)}: {key}")
    if len(got) != 1:
        raise ProtocolError(f"{where(cls)}: {key} must be one [round, digest] pair")
    return got[0]


def path_of(d: dict[str, Any], key: str, cls: type) -> str:
    v = str_of(d, key, cls, min_len=2, max_len=MAX_PATH)
    if not v.startswith("/") or "\0" in v:
        raise ProtocolError(f"{where(cls)}: {key} must be an absolute path")
    return v


def caught(info: dict[str, Any]) -> dict[str, str]:
    """The groupmates this member caught itself in a group round (`accused`), as the
    contract carries them."""
    found = info.get("accused", {})
    items = list(found.items())[:MAX_PEERS] if isinstance(found, dict) else []
    return {str(k)[:MAX_ADDR]: str(v)[:MAX_TEXT] for k, v in items}
