"""The one way a client opens a connection to the coordinator's control plane.

The coordinator serves TLS 1.3 with a certificate that clients authenticate by pin (its
SHA-256, `protocol.pinning`) instead of a certificate authority: the context verifies no
chain or name, and `verify_peer` compares the certificate with the pin after the
handshake and before the caller writes a byte. A mismatch raises `PinMismatch` naming
both fingerprints, so no request (and no token) reaches a coordinator that is not the
pinned one.

Without a pin the channel is encrypted but not authenticated: an on-path attacker can
stand in for the coordinator. `verify_peer` then logs a loud warning naming the
fingerprint it saw (once per address and fingerprint), and `require_pin_for_secrets`
refuses any request that carries a secret (join, admin or launcher token): tokens never
cross an unauthenticated channel. `CoordinatorClient` additionally keeps the first
fingerprint it saw and refuses a different one on reconnects (trust on first use, for
the life of the client).

Three front ends share `client_context` and `verify_peer`: `connect` (a blocking socket,
for `agora status` and the chaos tools), `open_trio_stream` (node.coordinator_client) and
`open_asyncio` (the load generator of `agora bench coordinator`). Standard library and
`protocol` only (trio and asyncio are imported by the functions that use them), so it
loads on a torch-free install.
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import TYPE_CHECKING

from protocol.message import Message
from protocol.pinning import PinMismatch, check_pin, fingerprint

if TYPE_CHECKING:
    import asyncio

    import trio

log = logging.getLogger(__name__)

SECRET_FIELDS = ("join_token", "admin_token", "launcher_token")
_warned: set[tuple[str, str]] = set()  # (address, fingerprint) already warned about


class UnpinnedSecret(Exception):
    """A request carrying a token was about to go to an unpinned coordinator."""


def client_context() -> ssl.SSLContext:
    """TLS 1.3 with chain and name checks off: the pin (`verify_peer`) authenticates."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


_CONTEXT = client_context()  # shared: creating one costs about a millisecond


def verify_peer(der: bytes | None, pin: str | None, where: str) -> str:
    """The fingerprint of the peer certificate `der`. Raises `PinMismatch` when it is not
    `pin`; with no pin, warns (once per address and fingerprint) that the coordinator
    is not authenticated."""
    if not der:
        raise PinMismatch(where, pin or "(any)", "(no certificate)")
    if pin is not None:
        return check_pin(der, pin, where)
    seen = fingerprint(der)
    if (where, seen) not in _warned:
        _warned.add((where, seen))
        log.warning(
            "the coordinator at %s is NOT authenticated (no pin): the channel is encrypted,"
            " but anyone on the path could impersonate it. Its certificate is %s; pass"
            " --coordinator %s#%s (after checking it with the operator) to pin it",
            where, seen, where, seen,
        )  # fmt: skip
    return seen


def require_pin_for_secrets(body: Message, pinned: bool, where: str) -> None:
    """Raise `UnpinnedSecret` when `body` carries a token and the channel is unpinned."""
    if pinned:
        return
    for name in SECRET_FIELDS:
        if getattr(body, name, ""):
            raise UnpinnedSecret(
                f"refusing to send {body.TYPE} with a {name} to {where}: the coordinator is"
                " not pinned, so the token could go to an impostor. Give the address as"
                " HOST:PORT#sha256:HEX (or --coordinator-fingerprint sha256:HEX) with the"
                " fingerprint the coordinator printed at start"
            )


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect(host: str, port: int, pin: str | None, *, timeout_s: float) -> ssl.SSLSocket:
    """A blocking TLS socket to the coordinator, its certificate checked against `pin`
    before it is returned; `timeout_s` bounds the connect, the handshake and each later
    read or write."""
    raw = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock = _CONTEXT.wrap_socket(raw, server_hostname=None)
        verify_peer(sock.getpeercert(binary_form=True), pin, _where(host, port))
    except BaseException:
        raw.close()
        raise
    return sock


async def open_trio_stream(host: str, port: int, pin: str | None) -> tuple[trio.SSLStream, str]:
    """A trio TLS stream to the coordinator, handshaken and checked against `pin`, and the
    fingerprint seen. The caller bounds it with its own deadline."""
    import trio

    tcp = await trio.open_tcp_stream(host, port)
    stream = trio.SSLStream(tcp, _CONTEXT, server_hostname=None, https_compatible=True)
    try:
        await stream.do_handshake()
        der = stream.getpeercert(binary_form=True)
        seen = verify_peer(der if isinstance(der, bytes) else None, pin, _where(host, port))
    except BaseException:
        tcp.socket.close()
        raise
    return stream, seen


async def open_asyncio(
    host: str, port: int, pin: str | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    """An asyncio TLS connection to the coordinator, checked against `pin`, and the
    fingerprint seen. The caller bounds it with its own deadline."""
    import asyncio

    reader, writer = await asyncio.open_connection(
        host, port, ssl=_CONTEXT, server_hostname="", limit=1 << 16
    )
    obj = writer.get_extra_info("ssl_object")
    try:
        seen = verify_peer(
            obj.getpeercert(binary_form=True) if obj is not None else None,
            pin,
            _where(host, port),
        )
    except BaseException:
        writer.close()
        raise
    return reader, writer, seen
