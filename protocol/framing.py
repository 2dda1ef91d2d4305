"""Length-prefixed framing and an incremental, bounded frame decoder.

A frame is a 4-byte big-endian payload length followed by the payload. The decoder
refuses a frame whose declared length exceeds its limit as soon as the header arrives,
before buffering a single payload byte.
"""

from __future__ import annotations

import struct

from protocol.codec import DEFAULT_MAX_FRAME, decode, encode
from protocol.errors import ProtocolError
from protocol.message import Message

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size  # bytes


def frame(payload: bytes, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Prefix `payload` with its length."""
    if len(payload) > max_frame:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the limit of {max_frame}")
    return HEADER.pack(len(payload)) + payload


def frame_message(msg: Message, *, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    return frame(encode(msg), max_frame=max_frame)


def read_header(header: bytes | bytearray, *, max_frame: int = DEFAULT_MAX_FRAME) -> int:
    """Parse a 4-byte header and check the declared length against the limit."""
    if len(header) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(header)}")
    (length,) = HEADER.unpack(header)
    if length > max_frame:
        raise ProtocolError(f"frame declares {length} bytes, above the limit of {max_frame}")
    return int(length)


class FrameDecoder:
    """Feed bytes in any chunking; get complete payloads (or messages) out."""

    __slots__ = ("_broken", "_buf", "_need", "max_frame")

    def __init__(self, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._need: int | None = None  # payload length of the frame in progress
        self._broken: ProtocolError | None = None  # a stream that lied once is done

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a complete frame."""
        return len(self._buf)

    @property
    def partial(self) -> bool:
        """A frame has begun (header or payload bytes held) but is not complete."""
        return self._need is not None or bool(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return every payload completed by them, in order.

        After a refused header the decoder drops its buffer and refuses all further input.
        """
        if self._broken is not None:
            raise ProtocolError(f"stream already refused: {self._broken}")
        self._buf += data
        out: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buf) < HEADER_SIZE:
                    return out
                try:
                    self._need = read_header(
                        bytes(self._buf[:HEADER_SIZE]), max_frame=self.max_frame
                    )
                except ProtocolError as exc:
                    self._broken = exc
                    self._buf.clear()
                    raise
                del self._buf[:HEADER_SIZE]
            if len(self._buf) < self._need:
                return out
            out.append(bytes(self._buf[: self._need]))
            del self._buf[: self._need]
            self._need = None

    def feed_messages(self, data: bytes) -> list[Message]:
        """Like `feed`, but decodes each payload into a validated message."""
        return [decode(p, max_size=self.max_frame) for p in self.feed(data)]
