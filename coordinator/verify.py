"""Signature checks on the coordinator's hot path (every request is signed).

- `verify(key, sig, data)` checks an ed25519 signature with libsodium (PyNaCl) when it
  is installed: about twice as fast as OpenSSL's ed25519 on the 2-core reference
  machine, and stricter (it refuses small-order keys and non-canonical signatures that
  no honest signer produces). Without PyNaCl it falls back to
  `protocol.identity.verify_signature`. Either way a bad signature raises
  `ProtocolError`.
- `signature_ok(req, run, cert)` checks a signed request for the coordinator's run (or
  for no run, where the envelope says so; a bound one for the coordinator's certificate
  too); `signatures_ok` checks a batch, so a verify
  thread takes a whole read in one hop. Thread-safe: no shared state.
- `PeerIds` caches the base58 libp2p peer id of recently seen public keys (bounded),
  because deriving it is pure-Python big-integer work on every request.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from protocol.errors import ProtocolError
from protocol.identity import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    peer_id_from_public_key,
    verify_signature,
)
from protocol.signing import SignedRequest, request_signed_bytes


def _openssl(key: bytes, sig: bytes, data: bytes) -> None:
    verify_signature(key, sig, data)


def _load_libsodium() -> Callable[[bytes, bytes, bytes], None] | None:
    try:
        from nacl.bindings import crypto_sign_open
        from nacl.exceptions import CryptoError
    except ImportError:
        return None

    def _sodium(key: bytes, sig: bytes, data: bytes) -> None:
        if len(sig) != SIGNATURE_SIZE or len(key) != PUBLIC_KEY_SIZE:
            raise ProtocolError("bad signature")
        try:
            crypto_sign_open(sig + data, key)
        except (CryptoError, ValueError, TypeError) as exc:
            raise ProtocolError("bad signature") from exc

    return _sodium


_sodium = _load_libsodium()
BACKEND = "libsodium" if _sodium is not None else "openssl"
verify: Callable[[bytes, bytes, bytes], None] = _sodium or _openssl


class PeerIds:
    """Public key -> libp2p peer id, bounded (the oldest entry goes first)."""

    __slots__ = ("_cache", "max_entries")

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._cache: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def __call__(self, key: bytes) -> str:
        pid = self._cache.get(key)
        if pid is None:
            pid = peer_id_from_public_key(key)
            self._cache[key] = pid
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return pid


def signature_ok(req: SignedRequest, run: str, cert: str | None) -> bool:
    """Whether the request's signature verifies for `run` (or for no run, where the
    envelope says so) and, for a bound request, for the certificate fingerprint `cert`;
    thread-safe: no shared state. Checked apart from the replay guard so each gets its
    own error code."""
    try:
        verify(req.key, req.sig, request_signed_bytes(req, run, cert))
    except ProtocolError:
        return False
    return True


def signatures_ok(reqs: list[SignedRequest], run: str, cert: str | None) -> list[bool]:
    """`signature_ok` for a batch (one hop to a verify thread for a whole read)."""
    return [signature_ok(r, run, cert) for r in reqs]
