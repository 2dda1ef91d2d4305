"""Signed, replay-protected control-plane requests.

A `SignedRequest` wraps the encoded body with the sender's public key, a timestamp, a
random nonce and an ed25519 signature over all of them. `ReplayGuard` refuses requests
outside the clock-skew window and any (key, nonce) pair seen within it. Sans-I/O: the
caller passes the current time.
"""

from __future__ import annotations

import secrets
import struct
from collections import OrderedDict

from protocol.codec import DEFAULT_MAX_FRAME, decode, encode
from protocol.errors import ProtocolError
from protocol.identity import PUBLIC_KEY_SIZE, NodeKey, verify_signature
from protocol.message import Message, bounded, message

NONCE_SIZE = 16  # bytes
_DOMAIN = b"agora/request/v1\0"


@message("signed", version=1)
class SignedRequest(Message):
    key: bytes = bounded(min_len=PUBLIC_KEY_SIZE, max_len=PUBLIC_KEY_SIZE)
    ts: float = bounded(ge=0)  # unix seconds at signing
    nonce: bytes = bounded(min_len=NONCE_SIZE, max_len=NONCE_SIZE)
    body: bytes  # an encoded message
    sig: bytes = bounded(min_len=64, max_len=64)


def signed_bytes(key: bytes, ts: float, nonce: bytes, body: bytes) -> bytes:
    return _DOMAIN + key + struct.pack(">d", ts) + nonce + body


def sign_request(node_key: NodeKey, body: Message, *, now: float) -> SignedRequest:
    raw = encode(body)
    nonce = secrets.token_bytes(NONCE_SIZE)
    sig = node_key.sign(signed_bytes(node_key.public_key, now, nonce, raw))
    return SignedRequest(key=node_key.public_key, ts=now, nonce=nonce, body=raw, sig=sig)


class ReplayGuard:
    """Remembers recent nonces; bounded in memory by `max_entries`."""

    __slots__ = ("_seen", "max_entries", "skew_s")

    def __init__(self, *, skew_s: float = 60.0, max_entries: int = 1_000_000) -> None:
        self.skew_s = skew_s  # seconds of allowed clock difference
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # key+nonce -> expiry

    def check(self, key: bytes, nonce: bytes, ts: float, now: float) -> None:
        if abs(now - ts) > self.skew_s:
            raise ProtocolError(
                f"request timestamp is {now - ts:+.1f}s off, outside the ±{self.skew_s}s window"
            )
        while self._seen:
            oldest, expiry = next(iter(self._seen.items()))
            if expiry > now and len(self._seen) < self.max_entries:
                break
            del self._seen[oldest]
        ident = key + nonce
        if ident in self._seen:
            raise ProtocolError("replayed request (nonce already seen)")
        self._seen[ident] = ts + 2 * self.skew_s


def verify_request(
    req: SignedRequest,
    *,
    now: float,
    guard: ReplayGuard,
    max_size: int = DEFAULT_MAX_FRAME,
) -> Message:
    """Check signature, time window and replay; return the decoded body."""
    verify_signature(req.key, req.sig, signed_bytes(req.key, req.ts, req.nonce, req.body))
    guard.check(req.key, req.nonce, req.ts, now)
    return decode(req.body, max_size=max_size)
