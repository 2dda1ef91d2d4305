"""Control-plane messages between nodes and the coordinator.

(Extended by the coordinator work: join, heartbeat, membership, leases, shards.)
"""

from __future__ import annotations

from protocol.message import Message, bounded, message


@message("error", version=1)
class ErrorReply(Message):
    """Any request can be answered with an error; `code` is machine-readable."""

    code: str = bounded(max_len=64)
    detail: str = bounded(max_len=1024, default="")
