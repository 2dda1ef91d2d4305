"""Circuit-relay v2 for the data plane: serve a hop, hold reservations, dial circuits.

A node with no inbound connectivity (`agora-node --no-listen`, a compute node behind a
cluster's NAT) reaches the swarm through a relay it connects to itself:

- It reserves a slot on every relay in `P2PConfig.relays` (multiaddrs ending in
  `/p2p/<relay id>`), renews the reservation well before it expires and at once when the
  relay connection drops, and announces `<relay addr>/p2p-circuit/p2p/<self>` as its
  addresses (`RelaySupport.circuit_addrs`).
- A peer whose only known addresses are circuit addresses is dialled through the relay
  (`RelaySupport.dial`): a hop CONNECT to the relay, which opens a stop stream to the
  destination over the destination's own outbound connection; Noise and Yamux are then
  negotiated end to end over that stream, so the relay sees only ciphertext.
- A well-connected node serves the hop itself (`P2PConfig.relay_hop`, `agora-node
  --relay-hop`); `python -m node.p2p.relay_main` runs a stand-alone relay (which
  `agora-coordinator --relay` starts as a child process).
- The hop serves the run's members only (`MemberHop`): a reservation only for the peer
  on the connection, and only if it is a member; a circuit only between two members.
  A reservation lasts `relay_reservation_ttl_s` unless renewed and is dropped when its
  peer leaves; a circuit is cut past `relay_circuit_bytes` or `relay_circuit_duration_s`
  (both checked as its data moves). Refusals are counted (`agora_p2p_relay_refused_total`).
- A relay that answers a reservation with a refusal may not know yet that we joined (it
  learns the membership after the join, which carries our circuit addresses): its
  circuit address is announced while the reservation is retried every few seconds.

Built on py-libp2p's `CircuitV2Protocol` (hop and stop handlers) and
`CircuitV2Transport` (the dialling side); the membership gate and the reservation keeping
are our own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from node.p2p import metrics

log = logging.getLogger(__name__)

CIRCUIT = "/p2p-circuit"
CHECK_EVERY_S = 1.0  # seconds between checks that a relay connection is still up
MAX_BACKOFF_S = 30.0  # seconds, the longest wait between reservation attempts
REFUSED_BACKOFF_S = 3.0  # seconds, the longest wait after a refusal (membership not known yet)
SWEEP_EVERY_S = 5.0  # seconds between drops of reservations held by peers who left


class _QuietReservationEof(logging.Filter):
    """py-libp2p logs an ERROR each time a client closes its RESERVE stream (normal EOF)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Error reading from hop stream") and text.endswith(": "))


logging.getLogger("libp2p.relay.circuit_v2.protocol").addFilter(_QuietReservationEof())


class RelayAddressError(ValueError):
    """A relay multiaddr that cannot be used (no `/p2p/<relay id>`, or malformed)."""


def is_circuit(addr: str | multiaddr.Multiaddr) -> bool:
    return CIRCUIT in str(addr)


def parse_relay_addr(addr: str) -> tuple[multiaddr.Multiaddr, ID]:
    """`/ip4/.../tcp/N/p2p/<id>` -> (transport address without /p2p, relay peer id)."""
    try:
        ma = multiaddr.Multiaddr(addr)
        relay_id = ma.value_for_protocol("p2p")
    except Exception as exc:
        raise RelayAddressError(f"bad relay multiaddr {addr!r}: {exc}") from exc
    if not relay_id or is_circuit(addr):
        raise RelayAddressError(
            f"relay multiaddr {addr!r} must be a plain address ending in /p2p/<relay peer id>"
            " (as `python -m node.p2p.relay_main` prints it)"
        )
    try:
        pid = ID.from_base58(relay_id)
    except Exception as exc:
        raise RelayAddressError(f"bad relay peer id in {addr!r}: {exc}") from exc
    return ma.decapsulate(multiaddr.Multiaddr(f"/p2p/{relay_id}")), pid


def relay_limits(cfg: Any) -> RelayLimits:
    """Hop limits from a `P2PConfig` (or the relay's command line, in the same names)."""
    return RelayLimits(
        duration=int(cfg.relay_circuit_duration_s),  # seconds per circuit
        data=int(cfg.relay_circuit_bytes),  # bytes per circuit, both directions together
        max_circuit_conns=cfg.relay_max_circuits,
        max_reservations=cfg.relay_max_reservations,
        reservation_ttl=int(cfg.relay_reservation_ttl_s),
    )


class ReservationRefused(ConnectionError):
    """The relay answered the reservation with a refusal (not, or not yet, a member)."""


class MemberHop(CircuitV2Protocol):
    """py-libp2p's circuit-relay v2 with the run's membership: a reservation only for the
    authenticated peer on the connection and only if `is_member`; a circuit only from a
    member to a member. Everything else is py-libp2p's (limits, status replies)."""

    def __init__(
        self, host: Any, *, limits: RelayLimits, allow_hop: bool, is_member: Callable[[str], bool]
    ) -> None:
        super().__init__(host, limits=limits, allow_hop=allow_hop)
        self.is_member = is_member
        self.refused = {"reservation": 0, "circuit": 0}

    async def _refuse(self, stream: Any, what: str, peer: ID, why: str) -> None:
        self.refused[what] += 1
        metrics.RELAY_REFUSED.labels(what=what).inc()
        n = self.refused[what]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: bounded logging under a flood
            log.info("relay: refused a %s from %s (%s; %d refused so far)", what, peer, why, n)
        await self._send_status(stream, StatusCode.PERMISSION_DENIED, why)

    async def _handle_reserve(self, stream: Any, msg: Any) -> None:
        remote = stream.muxed_conn.peer_id
        if msg.HasField("peer") and msg.peer.id and msg.peer.id != remote.to_bytes():
            await self._refuse(stream, "reservation", remote, "a reservation for another peer")
            return
        if not self.is_member(remote.to_string()):
            await self._refuse(stream, "reservation", remote, "not a member of the run")
            return
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: Any, msg: Any) -> None:
        remote = stream.muxed_conn.peer_id
        try:
            dest = ID(msg.peer.id).to_string()
        except Exception:
            dest = ""
        if not (self.is_member(remote.to_string()) and dest and self.is_member(dest)):
            await self._refuse(stream, "circuit", remote, "circuits only between members")
            with trio.move_on_after(2.0):
                await stream.reset()
            return
        await super()._handle_connect(stream, msg)

    def drop_non_members(self) -> int:
        """Drop the reservations of peers that are no longer members; returns how many."""
        held = self.resource_manager._reservations
        gone = [pid for pid in held if not self.is_member(pid.to_string())]
        for pid in gone:
            del held[pid]
        if gone:
            metrics.RELAY_DROPPED.inc(len(gone))
            log.info("relay: dropped %d reservations of peers that left", len(gone))
        return len(gone)


class RelaySupport:
    """Circuit-relay v2 for one libp2p host: hop (optional), stop, dialling, reservations.

    `start(nursery)` inside the running host; `circuit_addrs` lists the addresses other
    peers can reach us at through relays that currently hold a reservation for us.
    """

    def __init__(self, host: Any, cfg: Any, *, is_member: Callable[[str], bool]) -> None:
        self._host = host
        self.cfg = cfg
        self.relays = list(cfg.relays)
        self._parsed = [parse_relay_addr(a) for a in self.relays]  # fail early on a typo
        self.proto = MemberHop(
            host, limits=relay_limits(cfg), allow_hop=cfg.relay_hop, is_member=is_member
        )
        # STOP: accept relayed connections; no CLIENT role, so dialling never reserves.
        self.circuit = CircuitV2Transport(host, self.proto, RelayConfig(roles=RelayRole.STOP))
        self._reserved: dict[str, float] = {}  # relay multiaddr -> reservation expiry (unix s)
        self._pending: set[str] = set()  # relays that refused us so far (membership not known)
        self._dial_locks: dict[str, trio.Lock] = {}
        self._first_try: dict[str, trio.Event] = {a: trio.Event() for a in self.relays}
        self._errors: dict[str, str] = {}

    # --- addresses ------------------------------------------------------------------------

    @property
    def held(self) -> list[str]:
        """The relays (multiaddrs) holding a reservation for us now."""
        now = time.time()
        return [a for a, exp in self._reserved.items() if exp > now]

    @property
    def circuit_addrs(self) -> list[str]:
        """`<relay addr>/p2p-circuit/p2p/<self>` for each relay holding our reservation,
        then for each relay that refused it so far (it learns of our join shortly)."""
        me = self._host.get_id().to_string()
        held = self.held
        pending = [a for a in self.relays if a in self._pending and a not in held]
        return [f"{a}{CIRCUIT}/p2p/{me}" for a in held + pending]

    # --- lifecycle ------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RelaySupport]:
        """Run the relay protocol service (hop if `relay_hop`; stop always)."""
        async with background_trio_service(self.proto), trio.open_nursery() as nursery:
            await self.proto.event_started.wait()
            if self.cfg.relay_hop:
                log.info("relay: serving circuit-relay v2 hop %s", HOP_PROTOCOL)
                nursery.start_soon(self._sweep_non_members)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    async def _sweep_non_members(self) -> None:
        while True:
            await trio.sleep(SWEEP_EVERY_S)
            self.proto.drop_non_members()

    async def reserve_all(self, nursery: trio.Nursery) -> None:
        """Keep a reservation on each configured relay (tasks in `nursery`).

        Returns once every relay has answered its first reservation attempt (or failed
        it), so that `circuit_addrs` is ready for the join; raises `ConnectionError` if
        relays are configured but none accepted.
        """
        for addr, (ma, pid) in zip(self.relays, self._parsed, strict=True):
            nursery.start_soon(self._keep_reservation, addr, ma, pid)
        for event in self._first_try.values():
            await event.wait()
        if self.relays and not self._reserved and not self._pending:
            detail = "; ".join(f"{a}: {e}" for a, e in self._errors.items())
            raise ConnectionError(f"no relay accepted a reservation ({detail})")

    async def _keep_reservation(self, addr: str, ma: multiaddr.Multiaddr, pid: ID) -> None:
        """Reserve on one relay; renew before expiry and whenever the connection drops."""
        backoff = 1.0
        while True:
            try:
                expires = await self._reserve(ma, pid)
            except Exception as exc:
                lost = self._reserved.pop(addr, None) is not None
                refused = isinstance(exc, ReservationRefused)
                if refused:
                    self._pending.add(addr)
                else:
                    self._pending.discard(addr)
                self._errors[addr] = f"{type(exc).__name__}: {exc}"
                level = (
                    logging.WARNING
                    if lost or not (refused or self._first_try[addr].is_set())
                    else logging.INFO
                    if refused and not self._first_try[addr].is_set()
                    else logging.DEBUG
                )
                log.log(level, "relay: no reservation on %s (%s); retry in %.0f s",
                        addr, self._errors[addr], backoff)  # fmt: skip
                self._first_try[addr].set()
                await trio.sleep(backoff)
                backoff = min(2 * backoff, REFUSED_BACKOFF_S if refused else MAX_BACKOFF_S)
                continue
            if addr not in self._reserved:
                metrics.RELAY_RESERVATIONS.inc()
                log.info("relay: reserved a slot on %s for %.0f s; reachable at %s",
                         addr, expires - time.time(), f"{addr}{CIRCUIT}/p2p/<self>")  # fmt: skip
            self._reserved[addr] = expires
            self._pending.discard(addr)
            self._errors.pop(addr, None)
            self._first_try[addr].set()
            backoff = 1.0
            # renew at half the remaining time (at most every relay_renew_s seconds), or at
            # once when the relay connection goes away (the relay then drops the slot)
            renew_at = trio.current_time() + max(
                1.0, min(self.cfg.relay_renew_s, (expires - time.time()) / 2)
            )
            while trio.current_time() < renew_at and self._connected(pid):
                await trio.sleep(CHECK_EVERY_S)
            if not self._connected(pid):
                log.warning("relay: connection to %s lost; reserving again", addr)
                self._reserved.pop(addr, None)

    def _connected(self, pid: ID) -> bool:
        return bool(self._host.get_network().connections.get(pid))

    async def _reserve(self, ma: multiaddr.Multiaddr, pid: ID) -> float:
        """One RESERVE exchange; returns the expiry (unix seconds)."""
        with trio.fail_after(self.cfg.relay_timeout_s):
            if not self._connected(pid):
                await self._host.connect(PeerInfo(pid, [ma]))
            stream = await self._host.new_stream(pid, [HOP_PROTOCOL])
            try:
                ok = await self.circuit._make_reservation(stream, pid)
            finally:
                with trio.move_on_after(2.0):
                    await stream.close()
        if not ok:
            raise ReservationRefused("the relay refused the reservation")
        expires = float(self.circuit._reservations.get(pid, 0))
        if expires <= time.time():
            raise ConnectionError(f"the relay granted an expired reservation ({expires})")
        return expires

    # --- dialling -------------------------------------------------------------------------

    async def dial(self, peer_id: str, circuit_addrs: Sequence[multiaddr.Multiaddr]) -> None:
        """Open a relayed connection to `peer_id` through one of its circuit addresses.

        No deadline of its own: the caller's request deadline bounds it.
        """
        pid = ID.from_base58(peer_id)
        lock = self._dial_locks.setdefault(peer_id, trio.Lock())
        async with lock:  # concurrent requests share one relayed connection
            if self._connected(pid):
                return
            errors = []
            for ma in circuit_addrs:
                try:
                    relay_ma, dest = self.circuit.parse_circuit_ma(ma)
                    if dest != pid:
                        raise ValueError(f"circuit address names peer {dest}, not {peer_id}")
                    relay_tcp, relay_id = parse_relay_addr(str(relay_ma))
                    if not self._connected(relay_id):
                        await self._host.connect(PeerInfo(relay_id, [relay_tcp]))
                    await self.circuit.dial(ma)
                except Exception as exc:
                    errors.append(f"{ma}: {type(exc).__name__}: {exc}")
                finally:
                    # Also when the dial raised or was cancelled (the caller's deadline)
                    # after the circuit came up: later requests reuse it without a dial.
                    connected = self._connected(pid)
                    if connected:
                        metrics.RELAY_CIRCUITS.inc()
                        log.info("relay: connected to %s through %s", peer_id, ma)
                if connected:
                    return
            raise ConnectionError(f"cannot reach {peer_id} through a relay: {'; '.join(errors)}")
