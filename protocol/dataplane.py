"""Data-plane messages between peers: forward, backward and state requests.

Generic messages of the transport come first (`Echo` for liveness and benchmarks,
`Refused` for a request the server declined); the pipeline's forward and backward
messages follow.
"""

from __future__ import annotations

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


# --- pipeline messages (forward / backward) ---------------------------------------------
