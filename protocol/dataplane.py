"""Data-plane messages between peers, and the msgpack limits of every data-plane frame.

Generic messages of the transport live here (`Echo` for liveness and benchmarks,
`Refused` for a request the server declined); the pipeline's `Forward` / `Backward` are
in `protocol.pipeline`, the state download's in `protocol.state`.

`request_limits(protocol_id, max_frame)` and `reply_limits(...)` are the `UnpackLimits`
a reader applies to a frame of that protocol, derived from the schema of the kinds it
may carry (`protocol.codec.schema_limits`): a few arrays and maps, short strings, one
bin up to the frame. An unknown protocol id gets the limits of every kind together.
"""

from __future__ import annotations

import functools

from protocol.codec import UnpackLimits, schema_limits
from protocol.message import Message, bounded, message

# --- transport-level messages ----------------------------------------------------------


@message("dp.echo")
class Echo(Message):
    """Liveness probe and benchmark payload: the echo handler answers with the same bytes
    (or with `reply_size` bytes when it is set, for one-way throughput tests)."""

    seq: int = bounded(ge=0)
    payload: bytes = b""
    reply_size: int | None = bounded(ge=0, le=2**31, default=None)  # bytes


@message("dp.refused")
class Refused(Message):
    """The server declined the request; `retry_after` is a hint in seconds."""

    reason: str = bounded(
        choices=("banned", "not_member", "streams", "rate", "bytes", "no_handler", "internal")
    )
    retry_after: float = bounded(ge=0.0, le=86_400.0, default=0.0)  # seconds
    detail: str = bounded(max_len=256, default="")


ECHO_PROTOCOL = "/agora/echo/1"


def _kinds() -> dict[str, tuple[tuple[type[Message], ...], tuple[type[Message], ...]]]:
    """protocol id -> (request kinds, reply kinds); a refusal may answer any request."""
    from protocol.pipeline import FORWARD_PROTOCOL, Backward, Forward
    from protocol.state import STATE_PROTOCOL, StateChunk, StateRequest

    return {
        FORWARD_PROTOCOL: ((Forward,), (Backward, Refused)),
        STATE_PROTOCOL: ((StateRequest,), (StateChunk, Refused)),
        ECHO_PROTOCOL: ((Echo,), (Echo, Refused)),
    }


@functools.lru_cache(maxsize=64)  # keyed by our own protocol ids and frame size
def request_limits(protocol_id: str, max_frame: int) -> UnpackLimits:
    """Limits of a request frame on `protocol_id` (bytes of one frame: `max_frame`)."""
    kinds = _kinds()
    if protocol_id in kinds:
        return schema_limits(*kinds[protocol_id][0], max_size=max_frame)
    return _any_limits(max_frame)


@functools.lru_cache(maxsize=64)
def reply_limits(protocol_id: str, max_frame: int) -> UnpackLimits:
    """Limits of a reply frame on `protocol_id` (bytes of one frame: `max_frame`)."""
    kinds = _kinds()
    if protocol_id in kinds:
        return schema_limits(*kinds[protocol_id][1], max_size=max_frame)
    return _any_limits(max_frame)


def _any_limits(max_frame: int) -> UnpackLimits:
    every = {k for req, rep in _kinds().values() for k in (*req, *rep)}
    return schema_limits(*sorted(every, key=lambda k: k.TYPE), max_size=max_frame)
