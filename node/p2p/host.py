"""`Libp2pTransport`: the data plane over py-libp2p under trio, Noise + Yamux only.

The libp2p identity is the node's ed25519 `NodeKey`, so the libp2p peer id equals
`NodeKey.peer_id`. Only Noise (`/noise`) is offered as the secure channel and only Yamux
(`/yamux/1.0.0`) as the muxer: a peer that cannot speak both does not connect.

Requests are length-prefixed msgpack frames (`protocol.framing`) on libp2p streams; a
stream carries one request and its reply at a time and is kept in a small per-peer pool
for reuse (measured 5x the request rate of a fresh stream per request, 1.4x the MB/s at
1 MiB, on loopback). The server side admits a stream through `PeerLimits` (membership,
bans, per-peer streams, rate and bytes in flight), checks the declared frame length
before reading the payload, decodes it under the msgpack limits of the protocol's
message kinds (`protocol.dataplane.request_limits`; replies under `reply_limits`), and
bans a peer whose input is malformed, oversized or rejected by the handler with
`ProtocolError`. Every wait has a deadline.
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
from libp2p.network.config import RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from node.p2p import metrics
from node.p2p.interfaces import announce
from node.p2p.limits import MembershipFilter, PeerLimits, Refusal, allow_everyone
from node.p2p.relay import RelaySupport, is_circuit
from node.p2p.transport import (
    Handler,
    P2PConfig,
    PeerUnreachable,
    RequestRefused,
    RequestTimeout,
    TransportError,
)
from node.p2p.wire import (
    StreamEnded,
    decode_payload,
    read_exact,
    read_frame_length,
    read_message,
    write_message,
)
from protocol.codec import encode
from protocol.dataplane import Refused, reply_limits, request_limits
from protocol.errors import ProtocolError
from protocol.framing import HEADER
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
        # A dial fails once: py-libp2p would try each address 4 times with 0.1, 0.2 and
        # 0.4 s of back-off, so a send to a replica that was just killed (its port now
        # refuses) held its micro-batch 0.6-1.4 s before the router could send it
        # elsewhere. Retrying is the router's: another replica, or this one later.
        network: Any = self._host.get_network()  # a Swarm: the interface lacks retry_config
        network.retry_config = RetryConfig(max_retries=0)
        host_id = self._host.get_id().to_string()
        if host_id != key.peer_id:  # one identity: the libp2p peer id is the node key
            raise RuntimeError(f"libp2p peer id {host_id} differs from NodeKey {key.peer_id}")
        self.limits = PeerLimits(self.cfg.limits, allow)
        # circuit relay v2 (node.p2p.relay); as a hop it serves the members of `allow` only
        self.relay = RelaySupport(self._host, self.cfg, is_member=self.limits.is_member)
        self._handlers: dict[str, Handler] = {}
        self._nursery: trio.Nursery | None = None
        # idle outbound streams for reuse, per (peer id, protocol id): (stream, idle since)
        self._idle: dict[tuple[str, str], list[tuple[Any, float]]] = {}
        self._out_slots: dict[str, trio.Semaphore] = {}  # outbound concurrency per peer

    # --- identity and addresses ---------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._key.peer_id

    @property
    def listen_addrs(self) -> list[str]:
        """Direct addresses, then `<relay>/p2p-circuit/p2p/<self>` for each held reservation."""
        return self.direct_addrs + self.relay.circuit_addrs

    @property
    def direct_addrs(self) -> list[str]:
        """What other peers can dial: the configured `announce` addresses, else the bound
        listen addresses, each on 0.0.0.0 / :: as one per interface IP
        (`node.p2p.interfaces.announce`)."""
        if self.cfg.announce:
            return list(self.cfg.announce)
        return announce([str(a) for a in self._host.get_addrs()])

    @property
    def max_frame(self) -> int:
        return self.cfg.max_frame

    @property
    def host(self) -> Any:
        """The underlying libp2p host (for relay setup and diagnostics)."""
        return self._host

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        if not addrs:
            return
        try:
            parsed = [_strip_p2p(a) for a in addrs]
            pid = parse_peer_id(peer_id)
        except (TransportError, ValueError) as exc:  # multiaddr's parse errors are ValueErrors
            raise ValueError(f"peer {peer_id[:80]!r}: {exc}") from exc
        self._host.get_peerstore().add_addrs(pid, parsed, ADDR_TTL)

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
        async with self._host.run(listen), self.relay.running(), trio.open_nursery() as nursery:
            # py-libp2p's auto-connector dials peers from the peerstore until it holds 50
            # connections. Every member's address lands there, so it would connect to peers
            # nobody sends to (and a no-listen node would dial its previous stage before
            # that stage reached it through the relay). A node dials only when it sends.
            # `run` returns only after the swarm started it, so this stop holds.
            await self._host.get_network().auto_connector.stop()
            self._nursery = nursery
            await self.relay.reserve_all(nursery)  # an error here cancels the nursery
            log.info("p2p: peer %s listening on %s", self.peer_id, self.listen_addrs or "nothing")
            try:
                yield self
            finally:
                self._nursery = None
                self._idle.clear()
                nursery.cancel_scope.cancel()

    # --- serving ----------------------------------------------------------------------------

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        self._handlers[protocol_id] = handler

        async def on_stream(stream: Any) -> None:
            await self._serve(protocol_id, handler, stream)

        self._host.set_stream_handler(TProtocol(protocol_id), on_stream)

    async def _serve(self, protocol_id: str, handler: Handler, stream: Any) -> None:
        """Serve requests on one inbound stream until the peer closes it or misbehaves."""
        remote = stream.muxed_conn.peer_id.to_string()
        refusal = self.limits.admit_stream(remote, trio.current_time())
        if refusal is not None:
            if refusal in (Refusal.BANNED, Refusal.STREAMS):
                await _reset(stream)  # cheapest possible answer to a flood
            else:
                await self._refuse(stream, remote, refusal.value)
            return
        try:
            first = True
            while True:
                if not first:
                    refusal = self.limits.admit_request(remote, trio.current_time())
                    if refusal is not None:
                        await self._refuse(stream, remote, refusal.value)
                        return
                if not await self._serve_one(protocol_id, handler, stream, remote, first=first):
                    return
                first = False
        finally:
            self.limits.release_stream(remote, trio.current_time())

    async def _serve_one(
        self, protocol_id: str, handler: Handler, stream: Any, remote: str, *, first: bool
    ) -> bool:
        """Read one request, answer it; True if the stream stays open for another."""
        held = 0
        stage = "header"
        try:
            wait = self.cfg.read_timeout_s if first else self.cfg.stream_idle_timeout_s
            with trio.fail_after(wait):
                length = await read_frame_length(stream, max_frame=self.cfg.max_frame)
            if not self.limits.reserve_bytes(remote, length):
                await self._refuse(stream, remote, Refusal.BYTES.value)
                return False
            held = length
            stage = "payload"
            with trio.fail_after(self.cfg.read_timeout_s):
                payload = await read_exact(stream, length)
            stage = "decode"
            request = await decode_payload(
                payload,
                max_frame=self.cfg.max_frame,
                limits=request_limits(protocol_id, self.cfg.max_frame),
            )
            del payload
            stage = "handler"
            with trio.fail_after(self.cfg.handler_timeout_s):
                reply = await handler(remote, request)
            stage = "reply"
            with trio.fail_after(self.cfg.reply_timeout_s):
                await write_message(stream, reply, max_frame=self.cfg.max_frame)
            metrics.SERVED.inc()
            return True
        except ProtocolError as exc:
            if stage == "reply":  # our own reply broke a limit: our fault, not theirs
                log.error("p2p: cannot send reply on %s to %s: %s", protocol_id, remote, exc)
                await _reset(stream)
                return False
            kind = {"header": "oversized", "decode": "malformed"}.get(stage, "invalid")
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
            return False
        except trio.TooSlowError:
            if stage == "handler":
                log.error(
                    "p2p: handler %s timed out after %g s", protocol_id, self.cfg.handler_timeout_s
                )
                await self._refuse(stream, remote, "internal", detail="handler timed out")
            elif stage == "header" and not first:
                await _close(stream)  # an idle pooled stream: close it quietly
            else:
                metrics.CUT_STREAMS.inc()
                log.info("p2p: %s from %s too slow at %s; reset", protocol_id, remote, stage)
                await _reset(stream)
            return False
        except Exception as exc:
            if isinstance(exc, StreamEnded) and exc.got == 0 and stage == "header" and not first:
                await _close(stream)  # the peer closed its pooled stream: normal end
                return False
            if isinstance(exc, StreamEnded) or stage in ("header", "payload", "reply"):
                if not first and stage == "header" and _is_eof(exc):
                    await _close(stream)
                    return False
                metrics.CUT_STREAMS.inc()
                log.info("p2p: %s stream from %s broke at %s: %r", protocol_id, remote, stage, exc)
                await _reset(stream)
            else:
                log.exception("p2p: handler %s failed for a request from %s", protocol_id, remote)
                await self._refuse(stream, remote, "internal", detail=type(exc).__name__)
            return False
        finally:
            if held:
                self.limits.release_bytes(remote, held)

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
            fresh = [_strip_p2p(a) for a in addrs]  # what the caller knows now, first
            direct = [a for a in [*fresh, *known] if not is_circuit(a)]
            circuits = [a for a in known if is_circuit(a)]
            try:
                await self._dial_direct(pid, list(dict.fromkeys(direct)), keep=[*fresh, *known])
            except Exception as exc:
                if not circuits:
                    raise
                log.debug("p2p: direct dial of %s failed (%r); trying relays", peer_id, exc)
                await self.relay.dial(peer_id, circuits)
        return await self._host.new_stream(pid, [TProtocol(protocol_id)])

    async def _dial_direct(
        self, pid: ID, addrs: list[multiaddr.Multiaddr], *, keep: list[multiaddr.Multiaddr]
    ) -> None:
        """Dial `addrs` one at a time, in order, until one connects. py-libp2p's own dial
        of a peer drops its loopback addresses when it knows another and tries one
        address per transport, so a stale address (a replica that restarted on a new
        port) or an unreachable one hid the address that works; and after all of a
        peer's addresses failed once it refuses to dial it for 60 s, where whom to avoid
        is the router's call. The peerstore holds `keep` afterwards."""
        if not addrs:
            raise ConnectionError("no direct address")
        network, store = self._host.get_network(), self._host.get_peerstore()
        errors = []
        try:
            for addr in addrs:
                network.unblock_peer(pid)
                store.clear_addrs(pid)
                try:
                    await self._host.connect(PeerInfo(pid, [addr]))
                    return
                except Exception as exc:
                    errors.append(f"{addr}: {exc!r}")
        finally:
            store.add_addrs(pid, keep, ADDR_TTL)
        raise ConnectionError("; ".join(errors))

    def _take_pooled(self, key: tuple[str, str]) -> Any | None:
        pool = self._idle.get(key)
        now = trio.current_time()
        while pool:
            stream, since = pool.pop()
            if now - since < self.cfg.pool_idle_s and not stream.is_closed:
                return stream
            self._close_soon(stream)
        return None

    def _give_back(self, key: tuple[str, str], stream: Any) -> None:
        pool = self._idle.setdefault(key, [])
        if len(pool) >= self.cfg.pool_max_idle_per_peer or self._nursery is None:
            self._close_soon(stream)
            return
        pool.append((stream, trio.current_time()))

    def _close_soon(self, stream: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(_close, stream)

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
        payload = encode(msg)  # a local error (too large) surfaces here, before any I/O
        if len(payload) > self.cfg.max_frame:
            raise ProtocolError(
                f"message of {len(payload)} bytes exceeds the frame limit of {self.cfg.max_frame}"
            )
        key = (peer_id, protocol_id)
        slots = self._out_slots.get(peer_id)
        if slots is None:
            slots = self._out_slots[peer_id] = trio.Semaphore(
                self.cfg.max_outbound_streams_per_peer
            )
        try:
            with trio.fail_after(timeout):
                async with slots:
                    return await self._request_on_stream(key, addrs, protocol_id, payload)
        except trio.TooSlowError:
            raise RequestTimeout(
                peer_id=peer_id, protocol_id=protocol_id, timeout=timeout
            ) from None
        finally:
            if slots.value == self.cfg.max_outbound_streams_per_peer:
                self._out_slots.pop(peer_id, None)

    async def _request_on_stream(
        self, key: tuple[str, str], addrs: Sequence[str], protocol_id: str, payload: bytes
    ) -> Message:
        peer_id = key[0]
        try:
            stream = self._take_pooled(key)
            if stream is None:
                stream = await self.open_stream(peer_id, addrs, protocol_id)
            else:
                self.add_peer_addrs(peer_id, addrs)
            try:
                await stream.write(HEADER.pack(len(payload)) + payload)
                del payload
                reply = await read_message(
                    stream,
                    max_frame=self.cfg.max_frame,
                    limits=reply_limits(protocol_id, self.cfg.max_frame),
                )
            except BaseException:
                await _reset(stream)
                raise
        except TransportError:
            raise
        except ProtocolError as exc:
            raise TransportError(
                f"peer {peer_id} sent a bad reply on {protocol_id}: {exc}", peer_id=peer_id
            ) from exc
        except Exception as exc:  # dial refused, stream reset or closed before the reply
            raise PeerUnreachable(
                f"request {protocol_id} to peer {peer_id} failed: {type(exc).__name__}: {exc}",
                peer_id=peer_id,
            ) from exc
        if isinstance(reply, Refused):
            self._close_soon(stream)  # the server ends the stream after a refusal
            raise RequestRefused(
                peer_id=peer_id,
                reason=reply.reason,
                retry_after=reply.retry_after,
                detail=reply.detail,
            )
        self._give_back(key, stream)
        return reply


def _is_eof(exc: BaseException) -> bool:
    return type(exc).__name__ in ("StreamEOF", "MuxedStreamEOF", "StreamEnded")


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
