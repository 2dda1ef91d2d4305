"""The coordinator's cache of decoded request bodies, on the hot path of every request.

`BodyCache` decodes a verified request body once per distinct byte string: most
heartbeats of a run are byte-identical (no leases, nothing to announce), so the body is
decoded and validated once and the immutable message reused. Only small bodies are
kept, at most `max_entries` of them (the oldest goes first). Envelopes and replies go
through the `protocol` codecs themselves (`protocol.signing.open_envelope`,
`protocol.framing.frame_message`), which are built for this path. `soft` says which
replies may go out before the pending writes are durable.
"""

from __future__ import annotations

from protocol import control as c
from protocol.codec import UnpackLimits
from protocol.message import Message
from protocol.signing import SignedRequest, decode_body

CACHED_BODY_MAX = 512  # bytes: larger bodies are decoded every time


class BodyCache:
    """Verified request body bytes -> the decoded message, bounded. The messages are
    frozen and the handlers never change their lists, so one instance serves every
    request with the same body."""

    __slots__ = ("_cache", "hits", "limits", "max_entries", "max_size", "misses")

    def __init__(self, *, limits: UnpackLimits, max_size: int, max_entries: int = 4096) -> None:
        self.limits = limits  # the bounds every body is read under
        self.max_size = max_size  # bytes of one request
        self.max_entries = max_entries  # distinct bodies kept
        self._cache: dict[bytes, Message] = {}
        self.hits = 0  # bodies answered from the cache
        self.misses = 0  # bodies decoded

    def decode(self, req: SignedRequest) -> Message:
        """The body of a verified request (`ProtocolError` if it is malformed)."""
        body = req.body
        msg = self._cache.get(body)
        if msg is not None:
            self.hits += 1
            return msg
        self.misses += 1
        msg = decode_body(req, max_size=self.max_size, limits=self.limits)
        if len(body) <= CACHED_BODY_MAX:
            if len(self._cache) >= self.max_entries:
                del self._cache[next(iter(self._cache))]
            self._cache[body] = msg
        return msg


def soft(body: Message, reply: Message) -> bool:
    """Whether `reply` to `body` may go out before the pending writes are durable: a
    heartbeat's that only renewed liveness (nothing announced or accused, nothing moved or
    fenced).
    Such a reply may show others' changes still being written (a membership version, a
    drain, a pause); none of them grants anything, and each is re-sent in later replies."""
    return (
        type(reply) is c.HeartbeatReply
        and type(body) is c.HeartbeatRequest
        and body.dht_addrs is None
        and not body.accused
        and not reply.moved
        and not reply.fenced
    )
