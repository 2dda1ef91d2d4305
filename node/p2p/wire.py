"""Reading and writing length-prefixed protocol frames on a byte stream.

Works with any stream that has `async read(n) -> bytes` (at most n bytes; b"" or an
exception at end of stream) and `async write(data)`, such as a libp2p stream. The
header is checked against `max_frame` before any payload byte is read or allocated,
and the payload is decoded under the `UnpackLimits` of the kinds the reader expects
(`protocol.dataplane`). A payload of `OFFLOAD_BYTES` or more is decoded on a worker
thread (`decode_payload`), so the event loop keeps serving while it is parsed.
"""

from __future__ import annotations

from typing import Protocol

import trio

from protocol.codec import UnpackLimits, decode, encode
from protocol.errors import ProtocolError
from protocol.framing import HEADER, HEADER_SIZE, read_header
from protocol.message import Message

READ_CHUNK = 1024 * 1024  # bytes asked of the stream per read call
OFFLOAD_BYTES = 1024 * 1024  # payloads from this size up are decoded off the event loop


class ByteStream(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


class StreamEnded(Exception):
    """The stream ended (EOF) before a complete frame arrived."""

    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"stream ended after {got} of {wanted} bytes")
        self.got = got
        self.wanted = wanted


async def read_exact(stream: ByteStream, n: int) -> bytearray:
    """Read exactly `n` bytes or raise `StreamEnded` (the buffer grows as bytes arrive,
    and is returned as it is: no copy of a large payload)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(min(n - len(buf), READ_CHUNK))
        if not chunk:
            raise StreamEnded(len(buf), n)
        buf += chunk
    if len(buf) > n:  # a stream that returned more than asked: refuse to guess
        raise ProtocolError(f"stream returned {len(buf)} bytes when {n} were asked")
    return buf


async def read_frame_length(stream: ByteStream, *, max_frame: int) -> int:
    """Read a frame header; raise `ProtocolError` if it declares more than `max_frame`."""
    return read_header(await read_exact(stream, HEADER_SIZE), max_frame=max_frame)


async def decode_payload(
    payload: bytes | bytearray, *, max_frame: int, limits: UnpackLimits | None
) -> Message:
    """`protocol.codec.decode` under `limits`; on a worker thread for a large payload."""
    if len(payload) < OFFLOAD_BYTES:
        return decode(payload, max_size=max_frame, limits=limits)
    return await trio.to_thread.run_sync(lambda: decode(payload, max_size=max_frame, limits=limits))


async def read_message(
    stream: ByteStream, *, max_frame: int, limits: UnpackLimits | None = None
) -> Message:
    """One frame, decoded under `limits` (None: each object bounded by `max_frame` only,
    for a reader of a trusted local stream)."""
    length = await read_frame_length(stream, max_frame=max_frame)
    payload = await read_exact(stream, length)
    return await decode_payload(payload, max_frame=max_frame, limits=limits)


async def write_message(stream: ByteStream, msg: Message, *, max_frame: int) -> int:
    """Frame and write `msg`; return the bytes written."""
    payload = encode(msg)
    if len(payload) > max_frame:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the limit of {max_frame}")
    await stream.write(HEADER.pack(len(payload)) + payload)
    return HEADER_SIZE + len(payload)
