"""Reading and writing length-prefixed protocol frames on a byte stream.

Works with any stream that has `async read(n) -> bytes` (at most n bytes; b"" or an
exception at end of stream) and `async write(data)`, such as a libp2p stream. The
header is checked against `max_frame` before any payload byte is read or allocated.
"""

from __future__ import annotations

from typing import Protocol

from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.framing import HEADER, HEADER_SIZE, read_header
from protocol.message import Message

READ_CHUNK = 1024 * 1024  # bytes asked of the stream per read call


class ByteStream(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


class StreamEnded(Exception):
    """The stream ended (EOF) before a complete frame arrived."""

    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"stream ended after {got} of {wanted} bytes")
        self.got = got
        self.wanted = wanted


async def read_exact(stream: ByteStream, n: int) -> bytes:
    """Read exactly `n` bytes or raise `StreamEnded`."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.read(min(n - len(buf), READ_CHUNK))
        if not chunk:
            raise StreamEnded(len(buf), n)
        buf += chunk
    if len(buf) > n:  # a stream that returned more than asked: refuse to guess
        raise ProtocolError(f"stream returned {len(buf)} bytes when {n} were asked")
    return bytes(buf)


async def read_frame_length(stream: ByteStream, *, max_frame: int) -> int:
    """Read a frame header; raise `ProtocolError` if it declares more than `max_frame`."""
    return read_header(await read_exact(stream, HEADER_SIZE), max_frame=max_frame)


async def read_message(stream: ByteStream, *, max_frame: int) -> Message:
    length = await read_frame_length(stream, max_frame=max_frame)
    return decode(await read_exact(stream, length), max_size=max_frame)


async def write_message(stream: ByteStream, msg: Message, *, max_frame: int) -> int:
    """Frame and write `msg`; return the bytes written."""
    payload = encode(msg)
    if len(payload) > max_frame:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the limit of {max_frame}")
    await stream.write(HEADER.pack(len(payload)) + payload)
    return HEADER_SIZE + len(payload)
