"""The data-plane transport interface, its errors, and its configuration.

The pipeline talks to peers only through `Transport`, so tests can put a fault-injecting
wrapper (drop, delay or corrupt by peer and step) in front of the real
`node.p2p.host.Libp2pTransport`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from node.p2p.limits import LimitsConfig, MembershipFilter
from protocol.addrs import announce_problem
from protocol.codec import DEFAULT_MAX_FRAME
from protocol.message import Message

Handler = Callable[[str, Message], Awaitable[Message]]
"""Serves one request: `(remote_peer_id, request) -> reply`. Raise `ProtocolError` for
input that is malformed or invalid (the peer gets banned), anything else for a fault of
our own (the peer gets a `Refused(reason="internal")`)."""


class TransportError(Exception):
    """A request failed: the peer is unreachable, reset the stream or broke the protocol."""

    def __init__(self, message: str, *, peer_id: str) -> None:
        super().__init__(message)
        self.peer_id = peer_id


class PeerUnreachable(TransportError):
    """The connection failed before a reply: the dial was refused, or the stream was
    reset or closed. Unlike a timeout or a bad reply, this is what a dead peer looks like
    (`node.routing.Router` avoids the peer until the membership shows it alive again)."""


class RequestTimeout(TransportError):
    """No reply arrived within the request's deadline."""

    def __init__(self, *, peer_id: str, protocol_id: str, timeout: float) -> None:
        super().__init__(
            f"request {protocol_id} to peer {peer_id} timed out after {timeout:g} s",
            peer_id=peer_id,
        )
        self.protocol_id = protocol_id
        self.timeout = timeout


class RequestRefused(TransportError):
    """The peer answered with `Refused` (not a member, rate-limited, banned, ...)."""

    def __init__(self, *, peer_id: str, reason: str, retry_after: float, detail: str) -> None:
        text = f"peer {peer_id} refused the request: {reason}"
        if retry_after:
            text += f" (retry after {retry_after:.3g} s)"
        if detail:
            text += f": {detail}"
        super().__init__(text, peer_id=peer_id)
        self.reason = reason
        self.retry_after = retry_after


class Transport(Protocol):
    """Request/reply messaging between peers, one protocol id per message family."""

    @property
    def peer_id(self) -> str: ...

    @property
    def listen_addrs(self) -> list[str]:
        """Multiaddrs this node can be reached at, each ending in /p2p/<peer id>."""
        ...

    @property
    def max_frame(self) -> int:
        """Bytes: the largest frame payload this transport sends or accepts."""
        ...

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        """Remember where `peer_id` listens; `ValueError` if an address or the id does not
        parse (they come from other participants)."""
        ...

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        """Serve `protocol_id` with `handler` (replacing any earlier one)."""
        ...

    def set_membership(self, allow: MembershipFilter) -> None:
        """Serve only peers for which `allow(peer_id)` is true (the run's members)."""
        ...

    async def request(
        self,
        peer_id: str,
        addrs: Sequence[str],
        protocol_id: str,
        msg: Message,
        *,
        timeout: float,
    ) -> Message:
        """Send `msg` and return the reply; raise `TransportError` (or a subclass)."""
        ...


@dataclasses.dataclass(kw_only=True, slots=True)
class P2PConfig:
    """Data-plane transport settings (TOML table `[p2p]`)."""

    listen: list[str] = dataclasses.field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"]
    )  # multiaddrs; empty = outbound only; 0.0.0.0 / :: announce each interface's IP
    # multiaddrs announced instead of the bound ones (a port a router forwards to this
    # host, a proxy in front of it); empty = the bound ones
    announce: list[str] = dataclasses.field(default_factory=list)
    max_frame: int = DEFAULT_MAX_FRAME  # bytes, largest accepted frame payload
    read_timeout_s: float = 60.0  # seconds a peer may take to send one whole request
    handler_timeout_s: float = 300.0  # seconds a local handler may take to answer
    reply_timeout_s: float = 60.0  # seconds to write a reply to a slow reader
    stream_idle_timeout_s: float = 120.0  # seconds a served stream may wait for its next request
    pool_idle_s: float = 30.0  # seconds an idle outbound stream is kept for reuse
    pool_max_idle_per_peer: int = 8  # idle outbound streams kept per (peer, protocol)
    max_outbound_streams_per_peer: int = 32  # concurrent outbound requests per peer; more wait
    limits: LimitsConfig = dataclasses.field(default_factory=LimitsConfig)
    # circuit relay v2 (node.p2p.relay)
    relays: list[str] = dataclasses.field(default_factory=list)  # relay multiaddrs (/p2p/<id>)
    relay_hop: bool = False  # also serve as a relay hop for other peers
    relay_renew_s: float = 60.0  # seconds between reservation renewals (at most)
    relay_timeout_s: float = 20.0  # seconds one reservation attempt may take
    relay_reservation_ttl_s: float = 600.0  # seconds a reservation we grant (as hop) lasts
    relay_max_reservations: int = 1024  # reservations we hold for others (as hop)
    relay_max_circuits: int = 64  # concurrent relayed connections per reserved peer (as hop)
    relay_circuit_bytes: int = 1 << 30  # bytes one relayed circuit carries (both ways) (as hop)
    relay_circuit_duration_s: float = 3600.0  # seconds one relayed circuit may last (as hop)

    def __post_init__(self) -> None:
        for addr in self.announce:
            if (problem := announce_problem(addr)) is not None:
                raise ValueError(f"announce {addr!r:.80}: {problem}")
        if not 16 <= self.max_frame <= 2**32 - 1:
            raise ValueError(f"max_frame must be in [16, 2**32 - 1] bytes, got {self.max_frame}")
        for name in (
            "read_timeout_s",
            "handler_timeout_s",
            "reply_timeout_s",
            "stream_idle_timeout_s",
            "pool_idle_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.pool_idle_s >= self.stream_idle_timeout_s:
            raise ValueError(
                "pool_idle_s must be below stream_idle_timeout_s, or a pooled stream could "
                "be reused just as the serving side closes it"
            )
        if not 1 <= self.max_outbound_streams_per_peer <= self.limits.max_streams_per_peer:
            raise ValueError(
                "max_outbound_streams_per_peer must be in [1, limits.max_streams_per_peer] "
                "(peers share one config, so more would be refused by the other side)"
            )
        if not 0 <= self.pool_max_idle_per_peer <= self.max_outbound_streams_per_peer:
            raise ValueError("pool_max_idle_per_peer must be in [0, max_outbound_streams_per_peer]")
        if not 0 < self.relay_renew_s < self.relay_reservation_ttl_s:
            raise ValueError("relay_renew_s must be positive and below relay_reservation_ttl_s")
        if self.relay_timeout_s <= 0:
            raise ValueError("relay_timeout_s must be positive")
        if self.relay_max_reservations < 1 or self.relay_max_circuits < 1:
            raise ValueError("relay_max_reservations and relay_max_circuits must be >= 1")
        if not 4096 <= self.relay_circuit_bytes < 1 << 63:
            raise ValueError("relay_circuit_bytes must be in [4096, 2**63) bytes")
        if not 1 <= self.relay_circuit_duration_s < 1 << 31:
            raise ValueError("relay_circuit_duration_s must be in [1, 2**31) seconds")
        if self.limits.max_bytes_in_flight_per_peer < self.max_frame:
            raise ValueError(
                "limits.max_bytes_in_flight_per_peer must be at least max_frame, "
                "or no full-size request could ever be admitted"
            )

    @classmethod
    def from_dict(cls, table: dict[str, Any]) -> P2PConfig:
        table = dict(table)
        limits = LimitsConfig(**table.pop("limits", {}))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"unknown [p2p] keys: {', '.join(sorted(unknown))}")
        return cls(limits=limits, **table)

    @classmethod
    def from_toml(cls, path: Path) -> P2PConfig:
        with path.open("rb") as f:
            return cls.from_dict(tomllib.load(f).get("p2p", {}))
