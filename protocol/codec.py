"""msgpack with explicit limits, and the `encode` / `decode` contract for messages.

Unpacking always bounds the buffer, refuses non-string map keys and builds no objects
from extension types: `ExtType` values that reach a message decoder are rejected there.
`UnpackLimits` bounds every string, binary, array and map while msgpack reads them,
before any object is built: a frame of tiny nested arrays would otherwise cost dozens
of bytes of memory per byte received. Per-object bounds alone still let a big frame
hold millions of small arrays, so `max_containers` also bounds the arrays and maps of
the whole object: msgpack stops at the first one past it. `schema_limits` derives all
of them from the message classes a reader expects (see `protocol.dataplane`).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import ProtocolError
from protocol.message import MAX_ITEMS, MAX_STR, Message, message_class

DEFAULT_MAX_FRAME = 64 * 1024 * 1024  # bytes


@dataclass(frozen=True, slots=True)
class UnpackLimits:
    """Largest single object msgpack may read (anything larger is malformed input)."""

    max_str_len: int  # bytes of one str
    max_bin_len: int  # bytes of one bin
    max_array_len: int  # items of one array
    max_map_len: int  # entries of one map
    max_containers: int | None = None  # arrays and maps in the whole object (None: any)
    # msgpack's options for these limits, per frame cap (bytes); filled on first use
    _options: dict[int, dict[str, Any]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def options(self, cap: int) -> dict[str, Any]:
        """The `msgpack.unpackb` keywords for these limits under a frame cap of `cap`
        bytes (the container budget's hooks are not included: they count per call)."""
        opts = self._options.get(cap)
        if opts is None:
            opts = self._options[cap] = {
                "raw": False,
                "strict_map_key": True,
                "max_str_len": min(self.max_str_len, cap),
                "max_bin_len": min(self.max_bin_len, cap),
                "max_array_len": min(self.max_array_len, cap),
                "max_map_len": min(self.max_map_len, cap),
                "max_ext_len": 0,
                "use_list": True,
            }
        return opts


def packb(obj: Any) -> bytes:
    """Pack plain data (dicts, lists, str, bytes, numbers) to msgpack."""
    try:
        out = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot pack {type(obj).__name__}: {exc}") from exc
    assert isinstance(out, bytes)
    return out


def unpackb(
    data: bytes | bytearray,
    *,
    max_size: int = DEFAULT_MAX_FRAME,
    limits: UnpackLimits | None = None,
) -> Any:
    """Unpack one msgpack object with every limit explicit (`limits` None: each object
    is bounded by `max_size` only)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise ProtocolError(f"payload of {len(data)} bytes exceeds the limit of {max_size}")
    cap = max(max_size, 1)
    lim = limits or _bounded_by(cap)
    try:  # msgpack.unpackb reads the caller's buffer in place (an Unpacker copies it)
        if lim.max_containers is None:
            obj = msgpack.unpackb(data, **lim.options(cap))
        else:
            obj = msgpack.unpackb(data, **lim.options(cap), **_container_hooks(lim.max_containers))
    except msgpack.ExtraData as exc:
        raise ProtocolError(f"{len(exc.extra)} trailing bytes after the message") from exc
    except Exception as exc:  # msgpack raises many types; all mean "malformed"
        raise ProtocolError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc
    return obj


@functools.lru_cache(maxsize=16)
def _bounded_by(cap: int) -> UnpackLimits:
    """Limits that bound each object by the frame cap only."""
    return UnpackLimits(max_str_len=cap, max_bin_len=cap, max_array_len=cap, max_map_len=cap)


def _container_hooks(budget: int) -> dict[str, Any]:
    """msgpack hooks that count finished arrays and maps and stop past `budget`."""
    seen = [0]

    def count(obj: Any) -> Any:
        seen[0] += 1
        if seen[0] > budget:
            raise ValueError(f"more than {budget} arrays and maps")
        return obj

    return {"list_hook": count, "object_hook": count}


MAP_SLACK = 8  # map entries and containers beyond the schema's, for fields a newer peer adds


def schema_limits(*classes: type[Message], max_size: int) -> UnpackLimits:
    """The tightest `UnpackLimits` every message of `classes` fits, with `MAP_SLACK`
    spare map entries and containers for fields of a newer version (ignored on read):
    the longest list and map, the longest str (field names and bounded values), bin up
    to `max_size`, and the most arrays and maps one message of them can hold."""
    shapes = [_shape(cls, {}) for cls in classes]
    return UnpackLimits(
        max_str_len=max(s.str_len for s in shapes),
        max_bin_len=max_size,
        max_array_len=max(s.array_len for s in shapes),
        max_map_len=max(s.map_len for s in shapes) + MAP_SLACK,
        max_containers=max(s.containers for s in shapes) + MAP_SLACK,
    )


@dataclass(frozen=True, slots=True)
class _Shape:
    containers: int = 0  # arrays and maps, this value included
    array_len: int = 0  # longest array inside
    map_len: int = 0  # largest map inside
    str_len: int = 0  # longest str inside (map keys included)


def _shape(tp: Any, meta: dict[str, Any]) -> _Shape:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, type(int | None)):
        inner = [_shape(a, meta) for a in args if a is not type(None)]
        return _Shape(
            containers=max(s.containers for s in inner), array_len=max(s.array_len for s in inner),
            map_len=max(s.map_len for s in inner), str_len=max(s.str_len for s in inner),
        )  # fmt: skip
    if tp is str:  # bounds count characters, msgpack bytes: up to 4 a character in UTF-8
        choices = meta.get("choices")
        chars = max(map(len, choices)) if choices else meta.get("max_len") or MAX_STR
        return _Shape(str_len=4 * chars)
    if origin is list or origin is dict:
        n = meta.get("max_len") or MAX_ITEMS
        item = _shape(args[-1], {"max_len": meta.get("item_max_len")})
        return _Shape(
            containers=1 + n * item.containers,
            array_len=max(n if origin is list else 0, item.array_len),
            map_len=max(n if origin is dict else 0, item.map_len),
            str_len=max(MAX_STR if origin is dict else 0, item.str_len),
        )
    if isinstance(tp, type) and issubclass(tp, Message):
        hints = typing.get_type_hints(tp)
        fields = [(f.name, _shape(hints[f.name], dict(f.metadata))) for f in dataclasses.fields(tp)]  # type: ignore[arg-type]
        names = [len(name.encode()) for name, _ in fields] + [len(tp.TYPE.encode()), 1]
        return _Shape(
            containers=1 + sum(s.containers for _, s in fields),
            array_len=max([s.array_len for _, s in fields], default=0),
            map_len=max([len(fields) + 2] + [s.map_len for _, s in fields]),
            str_len=max(names + [s.str_len for _, s in fields]),
        )
    return _Shape()  # bool, int, float, bytes: no container, no str


def encode(msg: Message) -> bytes:
    """Serialise a message to its wire bytes (without the length prefix)."""
    return packb(msg.to_wire())


def decode(
    data: bytes | bytearray,
    *,
    max_size: int = DEFAULT_MAX_FRAME,
    limits: UnpackLimits | None = None,
) -> Message:
    """Parse wire bytes into a validated message, or raise `ProtocolError`."""
    obj = unpackb(data, max_size=max_size, limits=limits)
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a map, got {type(obj).__name__}")
    tag = obj.get("t")
    if not isinstance(tag, str):
        raise ProtocolError("message has no string type tag 't'")
    return message_class(tag).from_wire(obj)
