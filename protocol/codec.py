"""msgpack with explicit limits, and the `encode` / `decode` contract for messages.

Unpacking always bounds the buffer, refuses non-string map keys and builds no objects
from extension types: `ExtType` values that reach a message decoder are rejected there.
`UnpackLimits` bounds every string, binary, array and map while msgpack reads them,
before any object is built: a frame of tiny nested arrays would otherwise cost dozens
of bytes of memory per byte received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import ProtocolError
from protocol.message import Message, message_class

DEFAULT_MAX_FRAME = 64 * 1024 * 1024  # bytes


@dataclass(frozen=True, slots=True)
class UnpackLimits:
    """Largest single object msgpack may read (anything larger is malformed input)."""

    max_str_len: int  # bytes of one str
    max_bin_len: int  # bytes of one bin
    max_array_len: int  # items of one array
    max_map_len: int  # entries of one map


def packb(obj: Any) -> bytes:
    """Pack plain data (dicts, lists, str, bytes, numbers) to msgpack."""
    try:
        out = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot pack {type(obj).__name__}: {exc}") from exc
    assert isinstance(out, bytes)
    return out


def unpackb(
    data: bytes, *, max_size: int = DEFAULT_MAX_FRAME, limits: UnpackLimits | None = None
) -> Any:
    """Unpack one msgpack object with every limit explicit (`limits` None: each object
    is bounded by `max_size` only)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise ProtocolError(f"payload of {len(data)} bytes exceeds the limit of {max_size}")
    cap = max(max_size, 1)
    lim = limits or UnpackLimits(
        max_str_len=cap, max_bin_len=cap, max_array_len=cap, max_map_len=cap
    )
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        max_buffer_size=cap,
        max_str_len=min(lim.max_str_len, cap),
        max_bin_len=min(lim.max_bin_len, cap),
        max_array_len=min(lim.max_array_len, cap),
        max_map_len=min(lim.max_map_len, cap),
        max_ext_len=0,
        use_list=True,
    )
    try:
        unpacker.feed(data)
        obj = unpacker.unpack()
    except Exception as exc:  # msgpack raises many types; all mean "malformed"
        raise ProtocolError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc
    if unpacker.tell() != len(data):
        raise ProtocolError(f"{len(data) - unpacker.tell()} trailing bytes after the message")
    return obj


def encode(msg: Message) -> bytes:
    """Serialise a message to its wire bytes (without the length prefix)."""
    return packb(msg.to_wire())


def decode(
    data: bytes, *, max_size: int = DEFAULT_MAX_FRAME, limits: UnpackLimits | None = None
) -> Message:
    """Parse wire bytes into a validated message, or raise `ProtocolError`."""
    obj = unpackb(data, max_size=max_size, limits=limits)
    if not isinstance(obj, dict):
        raise ProtocolError(f"a message must be a map, got {type(obj).__name__}")
    tag = obj.get("t")
    if not isinstance(tag, str):
        raise ProtocolError("message has no string type tag 't'")
    return message_class(tag).from_wire(obj)
