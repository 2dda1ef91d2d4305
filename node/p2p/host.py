"""`Libp2pTransport`: the data plane over py-libp2p under trio, Noise + Yamux only.

The libp2p identity is the node's ed25519 `NodeKey`, so the libp2p peer id equals
`NodeKey.peer_id`. Only Noise (`/noise`) is offered as the secure channel and only Yamux
(`/yamux/1.0.0`) as the muxer: a peer that cannot speak both does not connect.

Each request is one libp2p stream carrying one length-prefixed msgpack frame each way
(`protocol.framing`). The server side admits a stream through `PeerLimits` (membership,
bans, per-peer streams, rate and bytes in flight), checks the declared frame length
before reading the payload, and bans a peer whose input is malformed, oversized or
rejected by the handler with `ProtocolError`. Every wait has a deadline.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from node.p2p import metrics
from node.p2p.limits import MembershipFilter, PeerLimits, Refusal, allow_everyone
from node.p2p.transport import (
    Handler,
    P2PConfig,
    RequestRefused,
    RequestTimeout,
    TransportError,
)
from node.p2p.wire import StreamEnded, read_exact, read_frame_length, read_message, write_message
from protocol.codec import decode
from protocol.dataplane import Refused
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.message import Message

log = logging.getLogger(__name__)

SECURITY_PROTOCOL = str(NOISE_PROTOCOL_ID)
MUXER_PROTOCOL = str(YAMUX_PROTOCOL_ID)
ADDR_TTL = 3600.0  # seconds a peer address stays in the peerstore


def parse_peer_id(peer_id: str) -> ID:
    try:
        return ID.from_base58(peer_id)
    except Exception as exc:
        raise TransportError(f"bad peer id {peer_id[:80]!r}: {exc}", peer_id=peer_id) from exc


def _strip_p2p(addr: str) -> multiaddr.Multiaddr:
    ma = multiaddr.Multiaddr(addr)
    try:
        p2p = ma.value_for_protocol("p2p")
    except Exception:
        p2p = None
    if p2p and "/p2p-circuit" not in addr:
        ma = ma.decapsulate(multiaddr.Multiaddr(f"/p2p/{p2p}"))
    return ma


class Libp2pTransport:
    """The real `Transport`: one py-libp2p host, Noise + Yamux, per-peer limits.

    Create it, register handlers with `set_handler`, then `async with t.run(): ...`
    inside trio. `listen_addrs` is valid once `run()` has entered.
    """

    def __init__(
        self,
        key: NodeKey,
        cfg: P2PConfig | None = None,
        *,
        allow: MembershipFilter = allow_everyone,
    ) -> None:
        self.cfg = cfg or P2PConfig()
        self._key = key
        key_pair = create_new_key_pair(key.seed)
        noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
        self._host: Any = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        )
        host_id = self._host.get_id().to_string()
        if host_id != key.peer_id:  # the one-identity rule of DESIGN.md section 2
            raise RuntimeError(f"libp2p peer id {host_id} differs from NodeKey {key.peer_id}")
        self.limits = PeerLimits(self.cfg.limits, allow)
        self._handlers: dict[str, Handler] = {}
        self._nursery: trio.Nursery | None = None

    # --- identity and addresses ---------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._key.peer_id

    @property
    def listen_addrs(self) -> list[str]:
        return [str(a) for a in self._host.get_addrs()]

    @property
    def host(self) -> Any:
        """The underlying libp2p host (for relay setup and diagnostics)."""
        return self._host

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        if addrs:
            self._host.get_peerstore().add_addrs(
                parse_peer_id(peer_id), [_strip_p2p(a) for a in addrs], ADDR_TTL
            )

    def set_membership(self, allow: MembershipFilter) -> None:
        """Serve only peers for which `allow(peer_id)` is true (the run's members)."""
        self.limits.set_membership(allow)

    def connection_stack(self, peer_id: str) -> list[tuple[str | None, str | None]]:
        """(security protocol, muxer protocol) negotiated on each open connection."""
        conns = self._host.get_network().connections.get(parse_peer_id(peer_id), [])
        if not isinstance(conns, list):
            conns = [conns]
        return [
            (c.get_negotiated_security_protocol(), c.get_negotiated_muxer_protocol()) for c in conns
        ]

    # --- lifecycle ------------------------------------------------------------------------

    @asynccontextmanager
    async def run(self) -> AsyncIterator[Libp2pTransport]:
        listen = [multiaddr.Multiaddr(a) for a in self.cfg.listen]
        async with self._host.run(listen), trio.open_nursery() as nursery:
            self._nursery = nursery
            log.info("p2p: peer %s listening on %s", self.peer_id, self.listen_addrs or "nothing")
            try:
                yield self
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    # --- serving ----------------------------------------------------------------------------

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        self._handlers[protocol_id] = handler

        async def on_stream(stream: Any) -> None:
            await self._serve(protocol_id, handler, stream)

        self._host.set_stream_handler(TProtocol(protocol_id), on_stream)

    async def _serve(self, protocol_id: str, handler: Handler, stream: Any) -> None:
        remote = stream.muxed_conn.peer_id.to_string()
        refusal = self.limits.admit(remote, trio.current_time())
        if refusal is not None:
            if refusal in (Refusal.BANNED, Refusal.STREAMS):
                await _reset(stream)  # cheapest possible answer to a flood
            else:
                await self._refuse(stream, remote, refusal.value)
            return
        held = 0
        stage = "header"
        try:
            with trio.fail_after(self.cfg.read_timeout_s):
                length = await read_frame_length(stream, max_frame=self.cfg.max_frame)
                if not self.limits.reserve_bytes(remote, length):
                    await self._refuse(stream, remote, Refusal.BYTES.value)
                    return
                held = length
                stage = "payload"
                payload = await read_exact(stream, length)
            stage = "decode"
            request = decode(payload, max_size=self.cfg.max_frame)
            del payload
            stage = "handler"
            with trio.fail_after(self.cfg.handler_timeout_s):
                reply = await handler(remote, request)
            stage = "reply"
            with trio.fail_after(self.cfg.reply_timeout_s):
                await write_message(stream, reply, max_frame=self.cfg.max_frame)
                await stream.close()
            metrics.SERVED.inc()
        except ProtocolError as exc:
            kind = {"header": "oversized", "decode": "malformed"}.get(stage, "invalid")
            if stage == "reply":  # our own reply broke a limit: our fault, not theirs
                log.error("p2p: cannot send reply on %s to %s: %s", protocol_id, remote, exc)
                await _reset(stream)
                return
            metrics.BAD_FRAMES.labels(kind=kind).inc()
            ban_s = self.limits.strike(remote, trio.current_time())
            log.warning(
                "p2p: banned %s for %.0f s: %s request on %s: %s",
                remote,
                ban_s,
                kind,
                protocol_id,
                exc,
            )
            await _reset(stream)
            self._disconnect_soon(remote)
        except trio.TooSlowError:
            if stage == "handler":
                log.error(
                    "p2p: handler %s timed out after %g s", protocol_id, self.cfg.handler_timeout_s
                )
                await self._refuse(stream, remote, "internal", detail="handler timed out")
            else:
                metrics.CUT_STREAMS.inc()
                log.info("p2p: %s from %s too slow at %s; stream reset", protocol_id, remote, stage)
                await _reset(stream)
        except StreamEnded:
            metrics.CUT_STREAMS.inc()
            log.info("p2p: %s stream from %s ended mid-%s", protocol_id, remote, stage)
            await _reset(stream)
        except Exception as exc:
            if stage in ("header", "payload", "reply") or _is_stream_error(exc):
                metrics.CUT_STREAMS.inc()
                log.info("p2p: %s stream from %s broke at %s: %r", protocol_id, remote, stage, exc)
                await _reset(stream)
            else:
                log.exception("p2p: handler %s failed for a request from %s", protocol_id, remote)
                await self._refuse(stream, remote, "internal", detail=type(exc).__name__)
        finally:
            now = trio.current_time()
            if held:
                self.limits.release_bytes(remote, held)
            self.limits.release(remote, now)

    async def _refuse(self, stream: Any, remote: str, reason: str, *, detail: str = "") -> None:
        retry = min(self.limits.retry_after(remote, trio.current_time()), 86_400.0)
        msg = Refused(reason=reason, retry_after=retry, detail=detail)
        try:
            with trio.fail_after(self.cfg.reply_timeout_s):
                await write_message(stream, msg, max_frame=self.cfg.max_frame)
                await stream.close()
        except Exception:  # the peer went away or is too slow: nothing more to say
            await _reset(stream)

    def _disconnect_soon(self, remote: str) -> None:
        if self._nursery is None:
            return

        async def disconnect() -> None:
            with trio.move_on_after(5.0):
                try:
                    await self._host.disconnect(parse_peer_id(remote))
                except Exception as exc:
                    log.debug("p2p: disconnect %s failed: %r", remote, exc)

        self._nursery.start_soon(disconnect)

    # --- requesting -------------------------------------------------------------------------

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol_id: str) -> Any:
        """Connect if needed and open a raw libp2p stream (no deadline: wrap the call)."""
        pid = parse_peer_id(peer_id)
        self.add_peer_addrs(peer_id, addrs)
        if not self._host.get_network().connections.get(pid):
            known = self._host.get_peerstore().addrs(pid)
            if not known:
                raise TransportError(f"no address known for peer {peer_id}", peer_id=peer_id)
            await self._host.connect(PeerInfo(pid, known))
        return await self._host.new_stream(pid, [TProtocol(protocol_id)])

    async def request(
        self,
        peer_id: str,
        addrs: Sequence[str],
        protocol_id: str,
        msg: Message,
        *,
        timeout: float,
    ) -> Message:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        try:
            with trio.fail_after(timeout):
                stream = await self.open_stream(peer_id, addrs, protocol_id)
                try:
                    await write_message(stream, msg, max_frame=self.cfg.max_frame)
                    reply = await read_message(stream, max_frame=self.cfg.max_frame)
                except BaseException:
                    await _reset(stream)
                    raise
                await _close(stream)
        except trio.TooSlowError:
            raise RequestTimeout(
                peer_id=peer_id, protocol_id=protocol_id, timeout=timeout
            ) from None
        except TransportError:
            raise
        except ProtocolError as exc:
            raise TransportError(
                f"peer {peer_id} sent a bad reply on {protocol_id}: {exc}", peer_id=peer_id
            ) from exc
        except Exception as exc:
            raise TransportError(
                f"request {protocol_id} to peer {peer_id} failed: {type(exc).__name__}: {exc}",
                peer_id=peer_id,
            ) from exc
        if isinstance(reply, Refused):
            raise RequestRefused(
                peer_id=peer_id,
                reason=reply.reason,
                retry_after=reply.retry_after,
                detail=reply.detail,
            )
        return reply


def _is_stream_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("libp2p.")


async def _reset(stream: Any) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(5.0):
        try:
            await stream.reset()
        except Exception as exc:
            log.debug("p2p: stream reset failed: %r", exc)


async def _close(stream: Any) -> None:
    with trio.move_on_after(5.0):
        try:
            await stream.close()
        except Exception as exc:
            log.debug("p2p: stream close failed: %r", exc)
