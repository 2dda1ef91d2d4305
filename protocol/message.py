"""Versioned message dataclasses with validating `to_wire()` / `from_wire()`.

A message is a frozen, slotted, keyword-only dataclass registered under a type tag with
`@message("tag", version=N)`. Its wire form is a msgpack map holding the tag `t`, the
version `v` and one entry per field. Decoding checks every field against its annotation
and its bounds (`bounded(...)`), ignores unknown keys, and raises `ProtocolError` for
anything else. Supported field types: bool, int, float, str, bytes, `X | None`,
`list[X]`, `dict[str, X]` and nested messages.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Self, TypeVar, dataclass_transform

from protocol.errors import ProtocolError

MAX_STR = 4096  # characters, default bound for str fields
MAX_ITEMS = 1_000_000  # default bound for list and dict fields
MAX_INT = 2**63 - 1

_REGISTRY: dict[str, type[Message]] = {}


def bounded(
    *,
    ge: float | None = None,
    le: float | None = None,
    max_len: int | None = None,
    min_len: int | None = None,
    choices: tuple[str, ...] | None = None,
    each: Callable[[Any], str | None] | None = None,
    item_max_len: int | None = None,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with wire-level bounds checked by `from_wire`. `each` checks a
    str value (every item of a list of str): it returns why the value is refused, or
    None. `item_max_len` bounds each str of a list of str (default `MAX_STR`)."""
    meta: dict[str, Any] = {
        "ge": ge, "le": le, "max_len": max_len, "min_len": min_len, "choices": choices,
        "each": each, "item_max_len": item_max_len,
    }  # fmt: skip
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Message:
    """Base of every wire message. Subclasses are made with `@message`."""

    __slots__ = ()
    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1
    _SPECS: ClassVar[tuple[_FieldSpec, ...]] = ()

    def to_wire(self) -> dict[str, Any]:
        """Plain data for msgpack; records (untagged) carry no `t` / `v`."""
        out: dict[str, Any] = {"t": self.TYPE, "v": self.VERSION} if self.TYPE else {}
        out.update(self._fields_to_wire())
        return out

    def _fields_to_wire(self) -> dict[str, Any]:
        return {spec.name: _value_to_wire(getattr(self, spec.name)) for spec in self._SPECS}

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        if not isinstance(obj, dict):
            raise ProtocolError(f"{cls.TYPE or cls.__name__}: expected a map")
        if cls.TYPE:
            if obj.get("t") != cls.TYPE:
                raise ProtocolError(f"expected message type {cls.TYPE!r}, got {obj.get('t')!r}")
            version = obj.get("v")
            if type(version) is not int or version < 1:
                raise ProtocolError(f"{cls.TYPE}: bad version {version!r}")
        return cls._from_fields(obj)

    @classmethod
    def _from_fields(cls, obj: dict[str, Any]) -> Self:
        kwargs: dict[str, Any] = {}
        for spec in cls._SPECS:
            if spec.name not in obj:
                if spec.required:
                    raise ProtocolError(f"{cls.__name__}: missing field {spec.name!r}")
                continue
            kwargs[spec.name] = spec.check(obj[spec.name], f"{cls.__name__}.{spec.name}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{cls.__name__}: {exc}") from exc


_M = TypeVar("_M", bound=type[Message])


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(bounded,))
def message(tag: str, *, version: int = 1) -> Callable[[_M], _M]:
    """Register a dataclass message under `tag`; see the module docstring."""

    def wrap(cls: _M) -> _M:
        if tag in _REGISTRY:
            raise RuntimeError(f"message tag {tag!r} registered twice")
        dc = dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)
        dc.TYPE = tag
        dc.VERSION = version
        dc._SPECS = _specs_of(dc)
        _REGISTRY[tag] = dc
        return typing.cast(_M, dc)

    return wrap


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(bounded,))
def record(cls: _M) -> _M:
    """A nested, untagged record (embedded in messages, never sent on its own)."""
    dc = dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)
    dc._SPECS = _specs_of(dc)
    return typing.cast(_M, dc)


def message_class(tag: str) -> type[Message]:
    try:
        return _REGISTRY[tag]
    except KeyError:
        raise ProtocolError(f"unknown message type {tag[:64]!r}") from None


def registered_tags() -> list[str]:
    return sorted(_REGISTRY)


# --- field specs -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _FieldSpec:
    name: str
    check: Callable[[Any, str], Any]
    required: bool


def _specs_of(cls: type) -> tuple[_FieldSpec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(_FieldSpec(f.name, _checker(hints[f.name], dict(f.metadata)), required))
    return tuple(specs)


def _fail(where: str, what: str) -> ProtocolError:
    return ProtocolError(f"{where}: {what}")


def _checker(tp: Any, meta: dict[str, Any]) -> Callable[[Any, str], Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {tp}")
        sub = _checker(inner[0], meta)
        return lambda v, w: None if v is None else sub(v, w)
    if tp is bool:
        return _check_bool
    if tp is int:
        return _make_number_check(int, meta)
    if tp is float:
        return _make_number_check(float, meta)
    if tp is str:
        return _make_str_check(meta)
    if tp is bytes:
        return _make_bytes_check(meta)
    if origin is list:
        item_meta = {"each": meta.get("each"), "max_len": meta.get("item_max_len")}
        return _make_list_check(_checker(args[0], item_meta), meta)
    if origin is dict:
        if args[0] is not str:
            raise TypeError("dict fields need str keys")
        return _make_dict_check(_checker(args[1], {}), meta)
    if isinstance(tp, type) and issubclass(tp, Message):
        return lambda v, w: tp._from_fields(v) if isinstance(v, dict) else _raise(w, "not a map")
    raise TypeError(f"unsupported field type {tp}")


def _raise(where: str, what: str) -> Any:
    raise _fail(where, what)


def _check_bool(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise _fail(where, f"expected bool, got {type(v).__name__}")
    return v


def _make_number_check(kind: type, meta: dict[str, Any]) -> Callable[[Any, str], Any]:
    ge, le = meta.get("ge"), meta.get("le")

    def check(v: Any, where: str) -> Any:
        if kind is int:
            if type(v) is not int:
                raise _fail(where, f"expected int, got {type(v).__name__}")
            if not -MAX_INT - 1 <= v <= MAX_INT:
                raise _fail(where, "int out of 64-bit range")
        else:
            if type(v) not in (int, float):
                raise _fail(where, f"expected float, got {type(v).__name__}")
            v = float(v)
            if not math.isfinite(v):
                raise _fail(where, "non-finite float")
        if ge is not None and v < ge:
            raise _fail(where, f"{v} below minimum {ge}")
        if le is not None and v > le:
            raise _fail(where, f"{v} above maximum {le}")
        return v

    return check


def _make_str_check(meta: dict[str, Any]) -> Callable[[Any, str], str]:
    max_len = meta.get("max_len") or MAX_STR
    min_len = meta.get("min_len") or 0
    choices = meta.get("choices")
    each = meta.get("each")

    def check(v: Any, where: str) -> str:
        if type(v) is not str:
            raise _fail(where, f"expected str, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise _fail(where, f"length {len(v)} outside [{min_len}, {max_len}]")
        if choices is not None and v not in choices:
            raise _fail(where, f"{v[:32]!r} is not one of {choices}")
        if each is not None and (problem := each(v)) is not None:
            raise _fail(where, problem)
        return v

    return check


def _make_bytes_check(meta: dict[str, Any]) -> Callable[[Any, str], bytes]:
    max_len = meta.get("max_len")
    min_len = meta.get("min_len") or 0

    def check(v: Any, where: str) -> bytes:
        if type(v) is not bytes:
            raise _fail(where, f"expected bytes, got {type(v).__name__}")
        if len(v) < min_len or (max_len is not None and len(v) > max_len):
            raise _fail(where, f"length {len(v)} outside [{min_len}, {max_len}]")
        return v

    return check


def _make_list_check(item: Callable[[Any, str], Any], meta: dict[str, Any]) -> Callable[..., Any]:
    max_len = meta.get("max_len") or MAX_ITEMS
    min_len = meta.get("min_len") or 0

    def check(v: Any, where: str) -> list[Any]:
        if type(v) is not list:
            raise _fail(where, f"expected list, got {type(v).__name__}")
        if not min_len <= len(v) <= max_len:
            raise _fail(where, f"{len(v)} items outside [{min_len}, {max_len}]")
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return check


def _make_dict_check(item: Callable[[Any, str], Any], meta: dict[str, Any]) -> Callable[..., Any]:
    max_len = meta.get("max_len") or MAX_ITEMS

    def check(v: Any, where: str) -> dict[str, Any]:
        if type(v) is not dict:
            raise _fail(where, f"expected map, got {type(v).__name__}")
        if len(v) > max_len:
            raise _fail(where, f"{len(v)} entries exceed {max_len}")
        out = {}
        for k, x in v.items():
            if type(k) is not str or len(k) > MAX_STR:
                raise _fail(where, "bad map key")
            out[k] = item(x, f"{where}[{k[:32]!r}]")
        return out

    return check


def _value_to_wire(v: Any) -> Any:
    if isinstance(v, Message):
        return v._fields_to_wire()
    if isinstance(v, list | tuple):
        return [_value_to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: _value_to_wire(x) for k, x in v.items()}
    return v
