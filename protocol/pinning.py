"""The coordinator's address and certificate pin, as text and as a check.

A client reaches the coordinator over TLS and authenticates it by the SHA-256 of its
certificate (DER), not by a certificate authority. The address a node is given may carry
that fingerprint:

    HOST:PORT                      no pin (see node/control_tls.py for what that allows)
    HOST:PORT#sha256:<64 hex>      pinned; IPv6 hosts in brackets: [::1]:7700#sha256:...

A fingerprint is written `sha256:` plus 64 lowercase hex digits; parsing also takes
upper case and the colon-separated byte pairs OpenSSL prints. `check_pin` compares a
peer certificate with a pin and raises `PinMismatch` naming both. Pure: no sockets, no
ssl, no files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re

PREFIX = "sha256:"
SYNTAX = "HOST:PORT[#sha256:HEX]"
_HEX = re.compile(r"[0-9a-f]{64}")


class PinMismatch(Exception):
    """The coordinator's certificate is not the pinned one: nothing was sent to it."""

    def __init__(self, where: str, pinned: str, seen: str) -> None:
        super().__init__(
            f"the coordinator at {where} presented certificate {seen}, but the pinned"
            f" fingerprint is {pinned}: refusing to talk to it (nothing was sent). If the"
            " coordinator's certificate changed on purpose, get its new fingerprint from its"
            " operator (`agora-coordinator` prints it at start)"
        )
        self.where, self.pinned, self.seen = where, pinned, seen


def fingerprint(der: bytes) -> str:
    """The pin of a DER certificate: `sha256:<hex>`."""
    return PREFIX + hashlib.sha256(der).hexdigest()


def parse_fingerprint(text: str) -> str:
    """A pin in canonical form; ValueError if `text` is not a SHA-256 fingerprint."""
    body = text.strip()
    if body.lower().startswith(PREFIX):
        body = body[len(PREFIX) :]
    body = body.replace(":", "").lower()
    if not _HEX.fullmatch(body):
        raise ValueError(f"a certificate fingerprint is sha256: and 64 hex digits, got {text!r}")
    return PREFIX + body


def check_pin(der: bytes, pin: str, where: str) -> str:
    """The certificate's fingerprint if it matches `pin`, else `PinMismatch`."""
    seen = fingerprint(der)
    if not hmac.compare_digest(seen, pin):
        raise PinMismatch(where, pin, seen)
    return seen


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorAddress:
    host: str  # name or IP literal, without IPv6 brackets
    port: int  # TCP port of the control plane
    pin: str | None = None  # `sha256:<hex>` of the coordinator's certificate (None: unpinned)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}" + (f"#{self.pin}" if self.pin else "")

    @property
    def hostport(self) -> str:
        """`HOST:PORT` without the pin (for messages)."""
        return str(dataclasses.replace(self, pin=None))


def parse_address(text: str, pin: str | None = None) -> CoordinatorAddress:
    """`HOST:PORT[#sha256:HEX]` (see the module docstring). `pin` (e.g. from
    --coordinator-fingerprint) is used when the address has none, and must agree with it
    when it has one. ValueError on anything else."""
    hostport, hash_, frag = text.strip().partition("#")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the coordinator address must be {SYNTAX}, got {text!r}")
    embedded = parse_fingerprint(frag) if hash_ else None
    given = parse_fingerprint(pin) if pin else None
    if embedded and given and embedded != given:
        raise ValueError(f"the address pins {embedded} but the fingerprint option says {given}")
    return CoordinatorAddress(host=host.strip("[]"), port=int(port), pin=embedded or given)
