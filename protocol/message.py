"""Versioned message dataclasses with validating `to_wire()` / `from_wire()`.

A message is a frozen, slotted, keyword-only dataclass registered under a type tag with
`@message("tag", version=N)`. Its wire form is a msgpack map holding the tag `t`, the
version `v` and one entry per field. Decoding checks every field against its annotation
and its bounds (`bounded(...)`), ignores unknown keys, and raises `ProtocolError` for
anything else. Both directions run on plans built once per class (`_plan`), not on
per-value type dispatch, as a coordinator encodes and decodes every request with them.
Supported field types: bool, int, float, str, bytes, `X | None`, `list[X]`,
`dict[str, X]` and nested messages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
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
    # (name, check, required, where) of each field, for reading (see `_plan`)
    _READ: ClassVar[tuple[tuple[str, Callable[[Any, str], Any], bool, str], ...]] = ()
    # (field names, values getter) when every field is plain data, else None (`_plan`)
    _PLAIN: ClassVar[tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]] | None] = None

    def to_wire(self) -> dict[str, Any]:
        """Plain data for msgpack; records (untagged) carry no `t` / `v`. Each class gets
        its own, built from its fields by `_plan`."""
        raise TypeError(f"{type(self).__name__} was not made with @message or @record")

    def _fields_to_wire(self) -> dict[str, Any]:
        """The fields as plain data, without `t` / `v` (a nested message's wire form)."""
        raise TypeError(f"{type(self).__name__} was not made with @message or @record")

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
        for name, check, required, where in cls._READ:
            v = obj.get(name, _ABSENT)
            if v is _ABSENT:
                if required:
                    raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
                continue
            kwargs[name] = check(v, where)
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
        _plan(dc)
        _REGISTRY[tag] = dc
        return typing.cast(_M, dc)

    return wrap


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(bounded,))
def record(cls: _M) -> _M:
    """A nested, untagged record (embedded in messages, never sent on its own)."""
    dc = dataclasses.dataclass(frozen=True, kw_only=True, slots=True)(cls)
    _plan(dc)
    return typing.cast(_M, dc)


def message_class(tag: str) -> type[Message]:
    try:
        return _REGISTRY[tag]
    except KeyError:
        raise ProtocolError(f"unknown message type {tag[:64]!r}") from None


def registered_tags() -> list[str]:
    return sorted(_REGISTRY)


# --- field specs -----------------------------------------------------------------------


_ABSENT = object()  # a field missing from the wire map


@dataclasses.dataclass(frozen=True, slots=True)
class _FieldSpec:
    """One field, with its checker and its wire converter built once per class."""

    name: str
    check: Callable[[Any, str], Any]
    required: bool
    where: str  # "Class.field", for error messages
    to_wire: Callable[[Any], Any] | None  # None: the value already is plain data


def _specs_of(cls: type) -> tuple[_FieldSpec, ...]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        tp = hints[f.name]
        check = _checker(tp, dict(f.metadata))
        specs.append(
            _FieldSpec(f.name, check, required, f"{cls.__name__}.{f.name}", _converter(tp))
        )
    return tuple(specs)


def _plan(cls: type[Message]) -> None:
    """Set the class's field specs, the tuples its reader loops over, and its `to_wire`
    and `_fields_to_wire`, built once from the field list: the field values come out
    in one `operator.attrgetter` call and are zipped with their names (C loops, no
    Python-level step per field), then each field that is not plain data goes through
    its converter (`_converter`)."""
    specs = cls._SPECS = _specs_of(cls)
    cls._READ = tuple((s.name, s.check, s.required, s.where) for s in specs)
    names = tuple(s.name for s in specs)
    get = _values(names)
    convert = tuple((s.name, s.to_wire) for s in specs if s.to_wire is not None)
    cls._PLAIN = (names, get) if not convert else None
    tagged, tag = ("t", "v", *names), (cls.TYPE, cls.VERSION)

    def fields(self: Message) -> dict[str, Any]:
        out = dict(zip(names, get(self), strict=True))
        for name, to_wire in convert:
            out[name] = to_wire(out[name])
        return out

    def wire(self: Message) -> dict[str, Any]:
        out = dict(zip(tagged, tag + get(self), strict=True))
        for name, to_wire in convert:
            out[name] = to_wire(out[name])
        return out

    for name, fn in (("to_wire", wire if cls.TYPE else fields), ("_fields_to_wire", fields)):
        fn.__name__, fn.__qualname__ = name, f"{cls.__qualname__}.{name}"
        fn.__doc__ = getattr(Message, name).__doc__
        setattr(cls, name, fn)


def _values(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """A getter of the named attributes' values, as a tuple."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda m: (one(m),)
    return lambda m: ()


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

    def bounds(v: Any, where: str) -> Any:
        if ge is not None and v < ge:
            raise _fail(where, f"{v} below minimum {ge}")
        if le is not None and v > le:
            raise _fail(where, f"{v} above maximum {le}")
        return v

    def check_int(v: Any, where: str) -> Any:
        if type(v) is not int:
            raise _fail(where, f"expected int, got {type(v).__name__}")
        if not -MAX_INT - 1 <= v <= MAX_INT:
            raise _fail(where, "int out of 64-bit range")
        return v if ge is None and le is None else bounds(v, where)

    def check_float(v: Any, where: str) -> Any:
        if type(v) is not float:
            if type(v) is not int:
                raise _fail(where, f"expected float, got {type(v).__name__}")
            v = float(v)
        if not math.isfinite(v):
            raise _fail(where, "non-finite float")
        return v if ge is None and le is None else bounds(v, where)

    return check_int if kind is int else check_float


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


# --- wire converters -------------------------------------------------------------------


def _converter(tp: Any) -> Callable[[Any], Any] | None:
    """How a value of annotation `tp` becomes plain data, chosen once per field: None for
    a scalar (bool, int, float, str, bytes: msgpack packs it as it is), a copy for a
    container of scalars, and a nested message's fields without `t` / `v`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [a for a in args if a is not type(None)]
        sub = _converter(inner)
        return None if sub is None else (lambda v: None if v is None else sub(v))
    if origin is list:
        if isinstance(args[0], type) and issubclass(args[0], Message):
            plain = args[0]._PLAIN
            if plain is None:
                return lambda v: [x._fields_to_wire() for x in v]
            zipped = functools.partial(zip, plain[0])  # records of plain fields: C loops
            return lambda v: list(map(dict, map(zipped, map(plain[1], v)))) if v else []
        item = _converter(args[0])
        return list if item is None else (lambda v: [item(x) for x in v])
    if origin is dict:
        value = _converter(args[1])
        return dict if value is None else (lambda v: {k: value(x) for k, x in v.items()})
    if isinstance(tp, type) and issubclass(tp, Message):
        return _nested_to_wire
    return None


def _nested_to_wire(v: Message) -> dict[str, Any]:
    return v._fields_to_wire()
