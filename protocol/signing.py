"""Signed, replay-protected control-plane requests.

A `SignedRequest` wraps the encoded body with the sender's public key, a timestamp, a
random nonce and an ed25519 signature over all of them. `ReplayGuard` refuses requests
outside the clock-skew window and any (key, nonce) pair seen within it. Sans-I/O: the
caller passes the current time.

Both layers are decoded under tight msgpack limits. The envelope is read before its
signature is checked, so anyone can send one: it is one flat map of a few scalars and
the body (`envelope_limits`: no arrays at all, short strings). The body is read after
the check, from a known key, under the bounds of the largest request
(`request_limits`).
"""

from __future__ import annotations

import secrets
import struct
from collections import OrderedDict

from protocol.codec import DEFAULT_MAX_FRAME, UnpackLimits, decode, encode
from protocol.errors import ProtocolError
from protocol.identity import PUBLIC_KEY_SIZE, NodeKey, verify_signature
from protocol.message import Message, bounded, message

NONCE_SIZE = 16  # bytes
ENVELOPE_MAX_MAP = 16  # entries of the envelope map (7 today; newer fields are ignored)
ENVELOPE_MAX_STR = 64  # bytes of a str in the envelope (the type tag and field names)
REQUEST_MAX_ITEMS = 4096  # items of one array or map in a request body (a facility report)
REQUEST_MAX_STR = 4096  # bytes of one str in a request body (the longest bounded field)
_DOMAIN = b"agora/request/v1\0"


@message("signed", version=1)
class SignedRequest(Message):
    key: bytes = bounded(min_len=PUBLIC_KEY_SIZE, max_len=PUBLIC_KEY_SIZE)
    ts: float = bounded(ge=0)  # unix seconds at signing
    nonce: bytes = bounded(min_len=NONCE_SIZE, max_len=NONCE_SIZE)
    body: bytes  # an encoded message
    sig: bytes = bounded(min_len=64, max_len=64)


def envelope_limits(max_size: int) -> UnpackLimits:
    return UnpackLimits(
        max_str_len=ENVELOPE_MAX_STR, max_bin_len=max_size, max_array_len=0,
        max_map_len=ENVELOPE_MAX_MAP,
    )  # fmt: skip


def request_limits(max_size: int) -> UnpackLimits:
    return UnpackLimits(
        max_str_len=REQUEST_MAX_STR, max_bin_len=max_size, max_array_len=REQUEST_MAX_ITEMS,
        max_map_len=REQUEST_MAX_ITEMS,
    )  # fmt: skip


def open_envelope(payload: bytes, *, max_size: int = DEFAULT_MAX_FRAME) -> SignedRequest:
    """The signed request a frame carries, not yet verified; `ProtocolError` if it is
    anything else."""
    req = decode(payload, max_size=max_size, limits=envelope_limits(max_size))
    if not isinstance(req, SignedRequest):
        raise ProtocolError(f"expected a signed request, got {req.TYPE!r}")
    return req


def decode_body(req: SignedRequest, *, max_size: int = DEFAULT_MAX_FRAME) -> Message:
    """The request inside a verified envelope."""
    return decode(req.body, max_size=max_size, limits=request_limits(max_size))


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
    return decode_body(req, max_size=max_size)
