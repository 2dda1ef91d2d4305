"""Membership and stage placement: the versioned view of live peers. Pure, no clock.

- `join` places a peer on the stage whose aggregate throughput relative to its cost is
  lowest (ties: fewest peers, then lowest index), unless the peer asked for a stage;
  `place(allowed)` chooses among the stages the peer's device memory fits
  (coordinator/placement.py), which the peer keeps in `Peer.fits`.
- A heartbeat (`renew`) extends the peer's expiry to now + TTL and takes its reported
  throughput; `expire_due` removes peers whose TTL lapsed. Liveness is soft state: a
  renewal changes memory only and journals nothing (the stored expiry and throughput
  are those of the row's last write), and a restarted view gives every stored live
  peer `grace_until` (the restart plus one TTL) instead. Joins, leaves, lapses, bans,
  moves and announced addresses bump the version and are logged (durably), so
  `delta(since)` can answer "what changed since version v".
- `rebalance` moves one peer when the weakest stage's throughput/cost falls below
  `ratio` times the strongest's (and the strongest stage has a peer to spare), never
  one whose `fits` leaves the weakest stage out.
- Per-stage peer counts and throughput sums are kept incrementally, so placement, a
  join and the gauges cost O(stages), not O(peers) (the sums are recomputed exactly on
  every rebalance check to shed float drift). Change a live peer's stage only through
  `move`.
- Announced addresses are kept as `protocol.addrs.observed` rewrites them from the
  source IP the member's join came from (`Peer.metrics_host`): no wildcard, no
  loopback address from another host, the observed IP first.
- Observers (`agora export`) are live members listed in the view, so nodes serve their
  data-plane requests, but they sit on no stage (`stage == n_stages`): placement,
  rebalancing, the per-stage counts and sums never see them.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from coordinator.journal import Journal
from protocol.addrs import fit, is_loopback_ip, observed
from protocol.control import DeviceMemory, MembershipReply, PeerInfo

LIVE, LEFT, DEAD, BANNED = "live", "left", "dead", "banned"
MLOG_KEEP = 100_000  # membership changes kept for deltas
MIN_RATE = 1.0  # tokens/s counted for a peer that reported none


@dataclasses.dataclass(slots=True)
class Peer:
    peer_id: str
    public_key: bytes
    stage: int
    # kept as tuples once joined or restored: a tuple of str is not tracked by the GC
    addrs: Sequence[str]
    dht_addrs: Sequence[str]
    device: str
    throughput: float  # tokens/s
    deadline: float | None  # unix seconds
    metrics_host: str | None
    metrics_port: int | None
    fixed_stage: bool
    joined_at: float  # unix seconds
    expires_at: float  # unix seconds; renewals move it in memory only (soft state)
    state: str = LIVE
    drain: bool = False
    moved: bool = False  # not persisted: reported once in the next heartbeat reply
    observer: bool = False  # on no stage; persisted in the addrs JSON (no schema change)
    # the device memory it reported at join, and the stages whose need fits it (None: any
    # stage, nothing was reported); both persisted in the addrs JSON
    memory: DeviceMemory | None = None
    fits: tuple[int, ...] | None = None
    # unix seconds when it first announced a DHT (not persisted: None for a peer restored
    # from the store, whose join time stands in for it)
    dht_since: float | None = None

    def row(self) -> tuple[Any, ...]:
        book: dict[str, Any] = {"p2p": list(self.addrs), "dht": list(self.dht_addrs)}
        if self.observer:
            book["observer"] = True
        if self.memory is not None:
            book["memory"] = self.memory.to_wire()
        if self.fits is not None:
            book["fits"] = list(self.fits)
        return (
            self.peer_id,
            self.public_key,
            self.stage,
            json.dumps(book),
            self.device,
            self.throughput,
            self.deadline,
            self.metrics_host,
            self.metrics_port,
            int(self.fixed_stage),
            self.joined_at,
            self.expires_at,
            self.state,
            int(self.drain),
        )

    @classmethod
    def from_row(cls, r: tuple[Any, ...]) -> Peer:
        (pid, pk, stage, addrs, device, thr, dl, mh, mp, fixed, joined, exp, state, drain) = r
        book = json.loads(addrs)
        memory = book.get("memory")
        fits = book.get("fits")
        return cls(
            pid,
            bytes(pk),
            int(stage),
            tuple(fit(list(book["p2p"]))),  # an entry stored under older, looser bounds is cut
            tuple(fit(list(book["dht"]))),
            device,
            float(thr),
            dl,
            mh,
            mp,
            bool(fixed),
            float(joined),
            float(exp),
            state,
            bool(drain),
            observer=bool(book.get("observer", False)),
            memory=None if memory is None else DeviceMemory.from_wire(memory),
            fits=None if fits is None else tuple(int(k) for k in fits),
        )

    def info(self) -> PeerInfo:
        return PeerInfo(
            peer_id=self.peer_id,
            stage=self.stage,
            addrs=list(self.addrs),
            dht_addrs=list(self.dht_addrs),
            device=self.device,
            throughput=self.throughput,
            deadline=self.deadline,
            observer=self.observer,
        )


class Membership:
    def __init__(
        self,
        *,
        n_stages: int,
        stage_costs: list[float],
        ttl_s: float,
        journal: Journal,
        version: int = 0,
        peers: Iterable[Peer] = (),
        mlog: Iterable[tuple[int, str, str]] = (),
        grace_until: float = 0.0,
        max_source_share: float = 1.0,
    ) -> None:
        """`peers` are stored rows (`Peer.from_row`); each live one expires no earlier
        than `grace_until` (unix seconds), as renewals were never stored."""
        if len(stage_costs) != n_stages:
            raise ValueError(f"{len(stage_costs)} stage costs for {n_stages} stages")
        self.n_stages = n_stages
        self.stage_costs = stage_costs
        self.ttl_s = ttl_s  # seconds
        self.journal = journal
        self.version = version
        # live peers ordered by expiry (TTL is uniform, so renewal moves a peer to the end)
        self.live: collections.OrderedDict[str, Peer] = collections.OrderedDict()
        self.banned: set[str] = set()
        self._sums = [0.0] * n_stages  # tokens/s per stage (peer rates floored at MIN_RATE)
        self._counts = [0] * n_stages  # live peers per stage
        self._by_source: collections.Counter[tuple[int, str]] = collections.Counter()
        self.max_source_share = max_source_share  # see `source_allows`
        self.observers = 0  # live observers (on no stage)
        peers = list(peers)
        for p in peers:
            if p.state == LIVE:
                p.expires_at = max(p.expires_at, grace_until)
        for p in sorted(peers, key=lambda p: p.expires_at):
            if p.state == LIVE:
                self.live[p.peer_id] = p
            elif p.state == BANNED:
                self.banned.add(p.peer_id)
        self._ids = sorted(self.live)  # live peer ids in order: the full view's pages
        self.resum()
        self._log_versions: list[int] = []
        self._log: list[tuple[str, str]] = []
        for v, pid, change in mlog:
            self._log_versions.append(v)
            self._log.append((pid, change))
        self.joins_total = 0
        self.leaves_total: dict[str, int] = collections.defaultdict(int)

    # -- placement ----------------------------------------------------------------------

    def stage_rates(self) -> list[float]:
        """Aggregate throughput / cost per stage."""
        return [max(s, 0.0) / c for s, c in zip(self._sums, self.stage_costs, strict=True)]

    def stage_counts(self) -> list[int]:
        return list(self._counts)

    def resum(self) -> None:
        """Recompute the per-stage aggregates from the live peers (O(peers))."""
        sums, counts = [0.0] * self.n_stages, [0] * self.n_stages
        by_source: collections.Counter[tuple[int, str]] = collections.Counter()
        observers = 0
        for p in self.live.values():
            if p.observer:
                observers += 1
            elif p.stage < self.n_stages:
                sums[p.stage] += max(p.throughput, MIN_RATE)
                counts[p.stage] += 1
                if p.metrics_host:
                    by_source[(p.stage, p.metrics_host)] += 1
        self._sums, self._counts, self.observers = sums, counts, observers
        self._by_source = by_source

    def _account(self, peer: Peer, sign: int) -> None:
        if peer.observer:
            self.observers += sign
        elif peer.stage < self.n_stages:
            self._sums[peer.stage] += sign * max(peer.throughput, MIN_RATE)
            self._counts[peer.stage] += sign
            if peer.metrics_host:
                self._by_source[(peer.stage, peer.metrics_host)] += sign

    def move(self, peer: Peer, stage: int) -> None:
        """Put a live peer on `stage` (keeps the aggregates right; not versioned)."""
        if peer.observer:
            raise ValueError(f"observer {peer.peer_id} cannot be put on a stage")
        live = self.live.get(peer.peer_id) is peer
        if live:
            self._account(peer, -1)
        peer.stage = stage
        if live:
            self._account(peer, +1)

    def source_allows(self, source: str | None, stage: int) -> bool:
        """Whether one more member joining from `source` (the IP its connection came
        from) may go on `stage`: that source then holds at most `max_source_share` of the
        stage's replicas, or one. A Sybil with many keys behind one address cannot become
        the majority of a stage (and so of its medians). Loopback sources (a swarm on one
        machine) and an unknown source are not capped."""
        if self.max_source_share >= 1.0 or not source or is_loopback_ip(source):
            return True
        mine = self._by_source[(stage, source)] + 1
        return mine <= max(1, math.floor(self.max_source_share * (self._counts[stage] + 1)))

    def open_stages(self, source: str | None, fits: Iterable[int] | None) -> list[int]:
        """The stages among `fits` (None: all) that `source_allows` for one more member."""
        stages = range(self.n_stages) if fits is None else fits
        return [s for s in stages if self.source_allows(source, s)]

    def place(self, allowed: Iterable[int] | None = None) -> int:
        """The weakest stage among `allowed` (None: all; it must not be empty)."""
        rates, counts = self.stage_rates(), self.stage_counts()
        stages = range(self.n_stages) if allowed is None else allowed
        return min(stages, key=lambda s: (rates[s], counts[s], s))

    def rebalance(self, ratio: float, busy: Callable[[str], bool]) -> Peer | None:
        """Move one peer from the strongest to the weakest stage if that stage is clearly
        behind (rate < ratio * strongest). Peers with a fixed stage, draining peers, peers
        for which `busy(peer_id)` is true (e.g. lease holders) and peers whose device
        memory does not fit the weakest stage (`fits`) stay put."""
        if self.n_stages < 2:
            return None
        self.resum()
        rates, counts = self.stage_rates(), self.stage_counts()
        lo = min(range(self.n_stages), key=lambda s: (rates[s], s))
        hi = max(range(self.n_stages), key=lambda s: (rates[s], -s))
        if counts[hi] < 2 or rates[lo] >= ratio * rates[hi]:
            return None
        c_lo, c_hi = self.stage_costs[lo], self.stage_costs[hi]
        best: tuple[float, Peer] | None = None
        for p in self.live.values():
            if p.stage != hi or p.fixed_stage or p.drain or p.observer or busy(p.peer_id):
                continue
            if p.fits is not None and lo not in p.fits:
                continue  # its device cannot hold the weakest stage
            if not self.source_allows(p.metrics_host, lo):
                continue  # its source holds its share of the weakest stage already
            t = max(p.throughput, MIN_RATE)
            new_lo, new_hi = rates[lo] + t / c_lo, rates[hi] - t / c_hi
            if min(new_lo, new_hi) <= rates[lo]:
                continue  # the move would not lift the weakest stage
            gap = abs(new_hi - new_lo)
            if best is None or gap < best[0]:
                best = (gap, p)
        if best is None:
            return None
        peer = best[1]
        self.move(peer, lo)
        peer.moved = True
        self._change(peer, "move")
        return peer

    # -- lifecycle ----------------------------------------------------------------------

    def join(self, peer: Peer) -> Peer:
        # what the member announced, as the others can dial it (`protocol.addrs.observed`,
        # from the source address the coordinator saw; an observer's is not kept)
        peer.addrs = tuple(observed(list(peer.addrs), peer.metrics_host))
        peer.dht_addrs = tuple(observed(list(peer.dht_addrs), peer.metrics_host))
        if peer.dht_addrs and peer.dht_since is None:
            peer.dht_since = peer.joined_at
        old = self.live.pop(peer.peer_id, None)
        if old is not None:
            self._account(old, -1)
        else:
            bisect.insort(self._ids, peer.peer_id)
        self.live[peer.peer_id] = peer
        self._account(peer, +1)
        self.joins_total += 1
        self._change(peer, "join")
        return peer

    def renew(self, peer_id: str, now: float, throughput: float | None) -> Peer | None:
        peer = self.live.get(peer_id)
        if peer is None:
            return None
        peer.expires_at = now + self.ttl_s
        if throughput is not None:
            self.set_throughput(peer_id, throughput)
        self.live.move_to_end(peer_id)
        return peer

    def stage_of(self, peer_id: str) -> int | None:
        """A live training member's stage; None for anyone else (observers included)."""
        peer = self.live.get(peer_id)
        return None if peer is None or peer.observer else peer.stage

    def set_throughput(self, peer_id: str, throughput: float) -> None:
        """The throughput (tokens/s) counted for a live peer (soft state, like renew)."""
        peer = self.live.get(peer_id)
        if peer is not None and throughput != peer.throughput:
            self._account(peer, -1)
            peer.throughput = throughput
            self._account(peer, +1)

    def announce(self, peer_id: str, dht_addrs: list[str], now: float) -> None:
        """A live peer's new DHT addresses (versioned: other nodes bootstrap from them),
        at `now` (unix s)."""
        peer = self.live.get(peer_id)
        if peer is None:
            return
        announced = tuple(observed(list(dht_addrs), peer.metrics_host))
        if announced and peer.dht_since is None:
            peer.dht_since = now
        if tuple(peer.dht_addrs) != announced:
            peer.dht_addrs = announced
            self._change(peer, "update")

    def remove(self, peer_id: str, state: str) -> Peer | None:
        """Take a peer out of the view: `left`, `dead` (TTL lapsed) or `banned`."""
        peer = self.live.pop(peer_id, None)
        if state == BANNED:
            self.banned.add(peer_id)
        if peer is None:
            return None
        del self._ids[bisect.bisect_left(self._ids, peer_id)]
        self._account(peer, -1)
        peer.state = state
        self.leaves_total[state] += 1
        self._change(peer, state)
        return peer

    def expire_due(self, now: float) -> list[Peer]:
        out = []
        while self.live:
            peer = next(iter(self.live.values()))
            if peer.expires_at > now:
                break
            self.remove(peer.peer_id, DEAD)
            out.append(peer)
        return out

    # -- views --------------------------------------------------------------------------

    def delta(
        self, since: int, stage: int | None = None, *, after: str = "", page: int = 512
    ) -> MembershipReply:
        """One page of what changed since version `since`, at most `page` entries (see
        `protocol.control.MembershipRequest`): a delta complete up to the reply's
        version, or, when `since` is 0 or older than the log, a page of the full view
        in peer-id order after `after`."""

        def wanted(p: Peer) -> bool:
            return stage is None or p.stage == stage

        root = self.dht_root()
        first = self._log_versions[0] if self._log_versions else self.version + 1
        if since == 0 or since + 1 < first or since > self.version:
            i = bisect.bisect_right(self._ids, after) if after else 0
            ids = self._ids[i : i + page]
            more = i + page < len(self._ids)
            peers = [self.live[pid].info() for pid in ids if wanted(self.live[pid])]
            return MembershipReply(
                version=self.version, full=True, peers=peers, more=more,
                cursor=ids[-1] if more else "", dht_root=root,
            )  # fmt: skip
        i = bisect.bisect_right(self._log_versions, since)
        chunk = self._log[i : i + page]
        upto = self._log_versions[i + len(chunk) - 1] if chunk else self.version
        joined, left = [], []
        for pid in dict.fromkeys(pid for pid, _ in chunk):
            p = self.live.get(pid)
            if p is not None and wanted(p):
                joined.append(p.info())
            else:
                left.append(pid)
        more = i + page < len(self._log)
        return MembershipReply(
            version=upto, full=False, peers=joined, left=left, more=more, dht_root=root
        )

    def dht_root(self) -> str:
        """The run's DHT bootstrap that nodes join (and move to): the live member, not an
        observer, that first announced a DHT, preferring members with a direct (non-relay)
        data-plane address, since a node behind NAT cannot be dialled as a bootstrap; ties
        by peer id. The coordinator assigns it so that no member can take the role by
        choosing its key (the smallest peer id used to win), and it stays put while its
        holder lives, so nodes converge on it: ordered by join time instead, a member that
        joined earlier but announced its DHT later took the role from a root others had
        already moved to, splitting a starting swarm over two DHTs. "" when no member
        qualifies."""
        best: tuple[bool, float, str] | None = None
        for p in self.live.values():
            if p.observer or not p.dht_addrs:
                continue
            relayed = all("/p2p-circuit" in a for a in p.addrs)
            since = p.dht_since if p.dht_since is not None else p.joined_at
            key = (relayed, since, p.peer_id)
            if best is None or key < best:
                best = key
        return best[2] if best is not None else ""

    def _change(self, peer: Peer, change: str) -> None:
        self.version += 1
        self._log_versions.append(self.version)
        self._log.append((peer.peer_id, change))
        if len(self._log) > 2 * MLOG_KEEP:
            del self._log_versions[:MLOG_KEEP], self._log[:MLOG_KEEP]
        self.journal.peers[peer.peer_id] = peer
        self.journal.mlog.append((self.version, peer.peer_id, change))
        self.journal.meta["membership_version"] = str(self.version)
