"""Per-peer admission control for the data plane: caps, rate limits, membership and bans.

Pure bookkeeping with an injected clock (`now` arguments, seconds), so every rule is
unit-tested without sockets or sleeps. The transport asks `PeerLimits` before it reads
a request and tells it when the request is finished; a peer that sent malformed,
oversized or invalid input is banned with exponential back-off.

Memory is bounded too: a request's declared payload is reserved before it is read, per
peer (`max_bytes_in_flight_per_peer`) and for all peers together
(`max_bytes_in_flight_total`), and stays reserved until its reply is written, so the
bytes read plus their decoded message (at most twice the reservation while decoding)
never pass twice the total, however many members send at once.

State is bounded: per-peer entries are dropped when idle, and the ban list keeps at most
`max_tracked_peers` entries (expired bans go first).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from node.p2p import metrics

MembershipFilter = Callable[[str], bool]


def allow_everyone(peer_id: str) -> bool:
    """The membership filter of an open run: every authenticated peer may be served."""
    return True


@dataclasses.dataclass(kw_only=True, slots=True)
class LimitsConfig:
    """Per-peer limits applied by the serving side of the transport."""

    max_streams_per_peer: int = 64  # concurrent inbound requests per peer
    max_bytes_in_flight_per_peer: int = 256 * 1024 * 1024  # bytes of request payload held
    max_bytes_in_flight_total: int = 1024 * 1024 * 1024  # bytes held for all peers together
    rate_per_s: float = 1000.0  # sustained requests per second per peer (token refill)
    burst: float = 2000.0  # token bucket capacity (requests)
    ban_base_s: float = 10.0  # first ban duration (seconds); doubles per strike
    ban_max_s: float = 3600.0  # longest ban (seconds)
    strike_forget_s: float = 3600.0  # a clean peer's strike count resets after this (seconds)
    max_tracked_peers: int = 100_000  # bound on per-peer and ban entries (peers)

    def __post_init__(self) -> None:
        if self.max_streams_per_peer < 1:
            raise ValueError("max_streams_per_peer must be at least 1")
        if self.max_bytes_in_flight_per_peer < 1:
            raise ValueError("max_bytes_in_flight_per_peer must be positive")
        if self.max_bytes_in_flight_total < self.max_bytes_in_flight_per_peer:
            raise ValueError("max_bytes_in_flight_total must be at least the per-peer cap")
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError("rate_per_s must be positive and burst at least 1")
        if not 0 < self.ban_base_s <= self.ban_max_s:
            raise ValueError("need 0 < ban_base_s <= ban_max_s")
        if self.max_tracked_peers < 1:
            raise ValueError("max_tracked_peers must be at least 1")


class Refusal(enum.Enum):
    """Why a request was not admitted (the value is the metrics label)."""

    BANNED = "banned"
    NOT_MEMBER = "not_member"
    STREAMS = "streams"
    RATE = "rate"
    BYTES = "bytes"


class TokenBucket:
    """A token bucket refilled at `rate` tokens per second up to `capacity`."""

    __slots__ = ("capacity", "rate", "tokens", "updated")

    def __init__(self, *, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.tokens = capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, now: float, n: float = 1.0) -> bool:
        self._refill(now)
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def wait_time(self, now: float, n: float = 1.0) -> float:
        """Seconds until `n` tokens are available (0 if they are now)."""
        self._refill(now)
        return max(0.0, (n - self.tokens) / self.rate)

    def is_full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.capacity


@dataclasses.dataclass(slots=True)
class _Ban:
    strikes: int
    until: float  # clock seconds
    last_strike: float  # clock seconds


class BanList:
    """Bans with exponential back-off: base, 2*base, 4*base, ... up to a maximum."""

    __slots__ = ("_bans", "_cfg")

    def __init__(self, cfg: LimitsConfig) -> None:
        self._cfg = cfg
        self._bans: dict[str, _Ban] = {}

    def ban(self, peer_id: str, now: float) -> float:
        """Add a strike against `peer_id`; return the ban duration in seconds."""
        entry = self._bans.get(peer_id)
        if entry is None or now - entry.last_strike > self._cfg.strike_forget_s:
            strikes = 1
        else:
            strikes = entry.strikes + 1
        duration = min(self._cfg.ban_base_s * 2.0 ** min(strikes - 1, 62), self._cfg.ban_max_s)
        self._bans[peer_id] = _Ban(strikes=strikes, until=now + duration, last_strike=now)
        self._bound(now)
        metrics.BANS.inc()
        return duration

    def banned_for(self, peer_id: str, now: float) -> float:
        """Seconds of ban left for `peer_id` (0 when not banned)."""
        entry = self._bans.get(peer_id)
        return 0.0 if entry is None else max(0.0, entry.until - now)

    def strikes(self, peer_id: str) -> int:
        entry = self._bans.get(peer_id)
        return 0 if entry is None else entry.strikes

    def __len__(self) -> int:
        return len(self._bans)

    def _bound(self, now: float) -> None:
        if len(self._bans) <= self._cfg.max_tracked_peers:
            return
        forget = self._cfg.strike_forget_s
        for pid in [
            p for p, b in self._bans.items() if b.until <= now and now - b.last_strike > forget
        ]:
            del self._bans[pid]
        while len(self._bans) > self._cfg.max_tracked_peers:  # oldest entries go first
            del self._bans[next(iter(self._bans))]


@dataclasses.dataclass(slots=True)
class _PeerState:
    bucket: TokenBucket
    streams: int = 0
    bytes_in_flight: int = 0


class PeerLimits:
    """Admission decisions for inbound requests, per remote peer id.

    Use: `refusal = admit_stream(peer, now)` when a stream opens; if None, the caller
    holds a stream slot (and spent a rate token for its first request) and must call
    `release_stream(peer, now)`. Each further request on that stream calls
    `admit_request(peer, now)`. After reading a frame header, `reserve_bytes(peer, n)`
    (and `release_bytes(peer, n)` when done). `strike(peer, now)` bans a peer.
    """

    __slots__ = ("_allow", "_peers", "bans", "cfg", "total_bytes_in_flight")

    def __init__(self, cfg: LimitsConfig, allow: MembershipFilter = allow_everyone) -> None:
        self.cfg = cfg
        self._allow = allow
        self._peers: dict[str, _PeerState] = {}
        self.bans = BanList(cfg)
        self.total_bytes_in_flight = 0  # bytes reserved for all peers together

    def set_membership(self, allow: MembershipFilter) -> None:
        self._allow = allow

    def is_member(self, peer_id: str) -> bool:
        return bool(self._allow(peer_id))

    def admit_stream(self, peer_id: str, now: float) -> Refusal | None:
        """Take a stream slot and a rate token for its first request, or say why not."""
        refusal = self._check(peer_id, now, new_stream=True)
        if refusal is not None:
            metrics.REFUSED.labels(reason=refusal.value).inc()
        return refusal

    def admit_request(self, peer_id: str, now: float) -> Refusal | None:
        """Take a rate token for a further request on an admitted stream."""
        refusal = self._check(peer_id, now, new_stream=False)
        if refusal is not None:
            metrics.REFUSED.labels(reason=refusal.value).inc()
        return refusal

    def _check(self, peer_id: str, now: float, *, new_stream: bool) -> Refusal | None:
        if self.bans.banned_for(peer_id, now) > 0:
            return Refusal.BANNED
        if not self._allow(peer_id):
            return Refusal.NOT_MEMBER
        state = self._state(peer_id, now)
        if new_stream and state.streams >= self.cfg.max_streams_per_peer:
            return Refusal.STREAMS
        if not state.bucket.take(now):
            return Refusal.RATE
        if new_stream:
            state.streams += 1
        return None

    def retry_after(self, peer_id: str, now: float) -> float:
        """Seconds a refused peer should wait before asking again (a hint)."""
        banned = self.bans.banned_for(peer_id, now)
        if banned > 0:
            return banned
        state = self._peers.get(peer_id)
        return 0.0 if state is None else state.bucket.wait_time(now)

    def release_stream(self, peer_id: str, now: float) -> None:
        """Give back the stream slot taken by a successful `admit_stream`."""
        state = self._peers.get(peer_id)
        if state is None:
            return
        state.streams = max(0, state.streams - 1)
        self._maybe_forget(peer_id, state, now)

    def reserve_bytes(self, peer_id: str, n: int) -> bool:
        """Hold `n` payload bytes for this peer; False (and a counter) if that would pass
        the peer's cap or the total cap."""
        state = self._peers.get(peer_id)
        if state is None:  # admit_stream() was not called; refuse rather than track blindly
            metrics.REFUSED.labels(reason=Refusal.BYTES.value).inc()
            return False
        if (
            state.bytes_in_flight + n > self.cfg.max_bytes_in_flight_per_peer
            or self.total_bytes_in_flight + n > self.cfg.max_bytes_in_flight_total
        ):
            metrics.REFUSED.labels(reason=Refusal.BYTES.value).inc()
            return False
        state.bytes_in_flight += n
        self.total_bytes_in_flight += n
        return True

    def release_bytes(self, peer_id: str, n: int) -> None:
        state = self._peers.get(peer_id)
        if state is not None:
            n = min(n, state.bytes_in_flight)
            state.bytes_in_flight -= n
            self.total_bytes_in_flight -= n

    def strike(self, peer_id: str, now: float) -> float:
        """Ban a peer that sent bad input; returns the ban duration in seconds."""
        return self.bans.ban(peer_id, now)

    def streams(self, peer_id: str) -> int:
        state = self._peers.get(peer_id)
        return 0 if state is None else state.streams

    def bytes_in_flight(self, peer_id: str) -> int:
        state = self._peers.get(peer_id)
        return 0 if state is None else state.bytes_in_flight

    @property
    def tracked_peers(self) -> int:
        return len(self._peers)

    def _state(self, peer_id: str, now: float) -> _PeerState:
        state = self._peers.get(peer_id)
        if state is None:
            if len(self._peers) >= self.cfg.max_tracked_peers:
                self.prune(now)
            state = _PeerState(
                bucket=TokenBucket(rate=self.cfg.rate_per_s, capacity=self.cfg.burst, now=now)
            )
            self._peers[peer_id] = state
        return state

    def _maybe_forget(self, peer_id: str, state: _PeerState, now: float) -> None:
        if state.streams == 0 and state.bytes_in_flight == 0 and state.bucket.is_full(now):
            del self._peers[peer_id]

    def prune(self, now: float) -> None:
        """Drop the state of idle peers whose bucket has refilled."""
        for pid, state in list(self._peers.items()):
            self._maybe_forget(pid, state, now)
