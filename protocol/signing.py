"""Signed, replay-protected control-plane requests.

A `SignedRequest` wraps the encoded body with the sender's public key, a timestamp, a
random nonce and an ed25519 signature over all of them and the run id, so a request
signed for one run is refused by any other run where the same key is a member. A
request signed with `run=None` (`any_run`) is bound to no run: the coordinator accepts
only a read-only status request in that form, which is how a client learns the run id
before its first bound request. A request may also be signed for the coordinator's TLS
certificate (`bound`: its pinning fingerprint is in the signed bytes), so it proves its key
only to the coordinator the client's TLS session reached, never to one it is relayed to by
a party in the middle; the coordinator then trusts that key for the rest of the connection
(`coordinator.server`). `ReplayGuard` refuses requests outside the clock-skew
window, any (key, nonce) pair seen within it, and anything signed before its
`not_before` (the coordinator's start: nonces seen by an earlier process are not
remembered) or at or before the newest timestamp it had to forget to stay bounded.
Sans-I/O: the caller passes the current time.

Both layers are decoded under tight msgpack limits. The envelope is read before its
signature is checked, so anyone can send one: it is one flat map of a few scalars and
the body (`envelope_limits`: no arrays at all, short strings). The body is read after
the check, from a known key, under the bounds of the largest request
(`request_limits`).
"""

from __future__ import annotations

import functools
import secrets
import struct
from collections import OrderedDict

from protocol.codec import DEFAULT_MAX_FRAME, UnpackLimits, decode, encode
from protocol.errors import ProtocolError
from protocol.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, NodeKey, verify_signature
from protocol.message import Message, bounded, message

NONCE_SIZE = 16  # bytes
ENVELOPE_MAX_MAP = 16  # entries of the envelope map (7 today; newer fields are ignored)
ENVELOPE_MAX_STR = 64  # bytes of a str in the envelope (the type tag and field names)
REQUEST_MAX_ITEMS = 4096  # items of one array or map in a request body (a facility report)
REQUEST_MAX_STR = 4096  # bytes of one str in a request body (the longest bounded field)
_DOMAIN = b"agora/request/v2\0"
_BOUND_DOMAIN = b"agora/request/v2+cert\0"  # signed for a coordinator certificate too
MAX_CERT_ID = 128  # bytes of the certificate fingerprint in the signed bytes
MAX_RUN_ID = 128  # bytes of the run id in the signed bytes (RunInfo.run_id)


@message("signed", version=1)
class SignedRequest(Message):
    key: bytes = bounded(min_len=PUBLIC_KEY_SIZE, max_len=PUBLIC_KEY_SIZE)
    ts: float = bounded(ge=0)  # unix seconds at signing
    nonce: bytes = bounded(min_len=NONCE_SIZE, max_len=NONCE_SIZE)
    body: bytes  # an encoded message
    sig: bytes = bounded(min_len=SIGNATURE_SIZE, max_len=SIGNATURE_SIZE)
    any_run: bool = False  # signed for no run (only a status request may be)
    bound: bool = False  # signed for the coordinator's certificate fingerprint too


@functools.lru_cache(maxsize=16)
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
    anything else. The coordinator reads every request with it (the generic decoder,
    a few microseconds: limits cached, field checks precomputed in `protocol.message`)."""
    req = decode(payload, max_size=max_size, limits=envelope_limits(max_size))
    if not isinstance(req, SignedRequest):
        raise ProtocolError(f"expected a signed request, got {req.TYPE!r}")
    return req


def decode_body(
    req: SignedRequest, *, max_size: int = DEFAULT_MAX_FRAME, limits: UnpackLimits | None = None
) -> Message:
    """The request inside a verified envelope, under `limits` (default `request_limits`;
    a server passes the tighter `schema_limits` of the requests it answers)."""
    return decode(req.body, max_size=max_size, limits=limits or request_limits(max_size))


def signed_bytes(
    key: bytes, ts: float, nonce: bytes, body: bytes, *, run: str | None, cert: str | None = None
) -> bytes:
    """The bytes a request's signature covers; `run=None` binds it to no run, `cert` (a
    `sha256:<hex>` pinning fingerprint) to one coordinator certificate as well."""
    scope = b"\xff" if run is None else run.encode()  # 0xff never occurs in UTF-8
    if len(scope) > MAX_RUN_ID:
        raise ProtocolError(f"run id of {len(scope)} bytes, above {MAX_RUN_ID}")
    head = _DOMAIN + bytes([len(scope)]) + scope
    if cert is not None:
        fp = cert.encode()
        if len(fp) > MAX_CERT_ID:
            raise ProtocolError(f"certificate id of {len(fp)} bytes, above {MAX_CERT_ID}")
        head = _BOUND_DOMAIN + bytes([len(scope)]) + scope + bytes([len(fp)]) + fp
    return head + key + struct.pack(">d", ts) + nonce + body


def request_scope(req: SignedRequest, run: str) -> str | None:
    """The run whose signed bytes `req` must verify against on a server of `run`."""
    return None if req.any_run else run


def request_signed_bytes(req: SignedRequest, run: str, cert: str | None) -> bytes:
    """What `req`'s signature must cover on the server of `run` whose certificate has the
    fingerprint `cert` (None: a server without one, where a bound request cannot verify)."""
    if req.bound and cert is None:
        raise ProtocolError("request signed for a certificate; this server has none")
    scope = request_scope(req, run)
    return signed_bytes(
        req.key, req.ts, req.nonce, req.body, run=scope, cert=cert if req.bound else None
    )


def sign_request(
    node_key: NodeKey, body: Message, *, now: float, run: str | None, cert: str | None = None
) -> SignedRequest:
    """Sign `body` for `run` (None: for no run; servers take only a status request so)
    and, with `cert`, for the coordinator certificate of that fingerprint (the one the
    client's TLS session verified)."""
    if run is None and cert is not None:
        raise ValueError("a request signed for no run is bound to no certificate")
    raw = encode(body)
    nonce = secrets.token_bytes(NONCE_SIZE)
    sig = node_key.sign(signed_bytes(node_key.public_key, now, nonce, raw, run=run, cert=cert))
    return SignedRequest(
        key=node_key.public_key, ts=now, nonce=nonce, body=raw, sig=sig, any_run=run is None,
        bound=cert is not None,
    )  # fmt: skip


class ReplayGuard:
    """Remembers recent nonces; bounded in memory by `max_entries`.

    A nonce is remembered until its request leaves the skew window. Requests signed
    before `not_before` are refused (their nonces may have been seen by an earlier
    process). When the table is full, the oldest entry is forgotten early and
    `floor` rises to its timestamp: a request signed at or before the floor is
    refused, so a forgotten nonce can never be replayed."""

    __slots__ = ("_seen", "floor", "max_entries", "not_before", "skew_s")

    def __init__(
        self, *, skew_s: float = 60.0, max_entries: int = 1_000_000, not_before: float = 0.0
    ) -> None:
        self.skew_s = skew_s  # seconds of allowed clock difference
        self.max_entries = max_entries  # nonces remembered
        self.not_before = not_before  # unix seconds; older signatures are refused
        self.floor = float("-inf")  # unix seconds; the newest timestamp forgotten early
        self._seen: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # -> (expiry, ts)

    def check(self, key: bytes, nonce: bytes, ts: float, now: float) -> None:
        """Refuse (ProtocolError) or remember the request's nonce."""
        if abs(now - ts) > self.skew_s:
            raise ProtocolError(
                f"request timestamp is {now - ts:+.1f}s off, outside the ±{self.skew_s}s window"
            )
        if ts < self.not_before:
            raise ProtocolError(
                f"request signed {self.not_before - ts:.1f}s before this coordinator started"
            )
        if ts <= self.floor:
            raise ProtocolError("request older than the replay window still remembered")
        while self._seen:
            oldest, (expiry, seen_ts) = next(iter(self._seen.items()))
            if expiry > now and len(self._seen) < self.max_entries:
                break
            if expiry > now:  # still live: forgotten early, so refuse all that old
                self.floor = max(self.floor, seen_ts)
            del self._seen[oldest]
        ident = key + nonce
        if ident in self._seen:
            raise ProtocolError("replayed request (nonce already seen)")
        self._seen[ident] = (ts + 2 * self.skew_s, ts)


def verify_request(
    req: SignedRequest,
    *,
    now: float,
    guard: ReplayGuard,
    run: str,
    any_run_types: tuple[type[Message], ...] = (),
    max_size: int = DEFAULT_MAX_FRAME,
    cert: str | None = None,
) -> Message:
    """Check signature (for `run`, or for no run where the body is one of
    `any_run_types`; a bound request for the certificate `cert`), time window and replay;
    return the decoded body."""
    scope = request_scope(req, run)
    verify_signature(req.key, req.sig, request_signed_bytes(req, run, cert))
    guard.check(req.key, req.nonce, req.ts, now)
    body = decode_body(req, max_size=max_size)
    if scope is None and not isinstance(body, any_run_types):
        raise ProtocolError(f"a {body.TYPE!r} request must be signed for run {run!r}")
    return body
