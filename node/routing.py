"""Next-hop choice for micro-batches: lowest expected finish time, with bans.

Pure and clock-injected. For each candidate peer of the next stage the router estimates
`(queued + 1) * seconds_per_item`, where the per-item time is a moving geometric average
of measured round trips (the first reply sets it), and picks the smallest after
multiplying by a little random jitter so that load spreads; a share `explore` of the
choices (5 %) goes to a usable candidate at random instead. A peer that errors or times
out is banned for a back-off that doubles with each consecutive failure and resets on
success.

A peer whose request failed at the transport level (`unreachable`: dial refused, stream
reset or closed) is *down*: that is what a dead peer looks like, and a ban that lapses
after 2 s only invites the next micro-batch to fail the same way. A down peer is not
chosen while any candidate is up, until the membership shows it alive again: its entry
changed (`revive`: a re-join with new addresses), or a membership view asked for at
least the coordinator's peer TTL (plus a sweep and a heartbeat) after the failure still
lists it (`listed`): a dead peer would have lapsed by then, so it heartbeated since.
When every candidate is down they are chosen as banned peers are (once the ban lapses),
so a stage whose one replica blipped still makes progress.

An estimate ages: the longer a peer goes unmeasured, the closer its per-item time drifts
to the fastest known one (half-life `stale_half_life_s`). Without that, one slow first
reply (a cold joiner: a fresh connection and the first forward) rated a replica so slow
that it was never chosen, so never measured again, and starved for good (the failover
bench's idle replacements: 1.77 s/item against 0.22 for the survivor, for minutes). A
new measurement updates the aged estimate, not the stale one: otherwise the first fast
reply after the gap rated the replica slow again, and it starved for another stretch.
Ageing alone is slow to forgive a large excess: the jittered comparison turns only once
the excess is within a fifth of the best, so a replica once rated 15 x slower than its
partner waits about six half-lives (60 s) for its next micro-batch, and with a linear
average one reply 50 x slow (a stall at the peer) rated it 15 x slower. In a 2 x 2
swarm with one micro-batch in flight per sender, one stage-1 replica got about 3 % of
its stage's micro-batches from its first outer round on, and its partner rounded alone
(docs/reliability.md). Hence the geometric average (that reply raises the estimate
3.2 x, and five normal ones undo it) and the exploration: a replica rated slow by a bad
reply is measured again within a few dozen micro-batches, and one that is really slow
costs at most that share of the traffic.

With `affinity` (the node's `route_affinity`; off by default) a sender names a
preferred set of candidates, its paired replicas of the next stage
(`PeerView.partners`), and the router takes the soonest usable one while its expected
finish is within `affinity` times the best candidate's: each pipeline of paired
replicas then trains as one model between outer rounds, and a dead, banned or far
slower partner still loses the micro-batch to the others. Measured side by side it
lowered the 2 x 2 swarm's loss gap to the central run and not the 4 x 2 one's
(docs/outer-loop.md, "Pairing replicas across stages"), so it is not the default.

A peer never measured is as fast as the fastest measured one at each choice, not at the
moment it was first seen: two replicas seen before either answered were both fixed at
the prior, and once one was measured the other lost every choice, for good, whenever
the sender kept one micro-batch in flight (an unmeasured estimate did not age).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

MIN_SECONDS = 1e-6  # floor of a per-item measurement, so that ratios stay finite (s)


@dataclass(slots=True)
class PeerStats:
    seconds_per_item: float  # EMA of measured request time (s)
    in_flight: int = 0  # requests sent and not yet answered
    failures: int = 0  # consecutive failures
    banned_until: float = 0.0  # monotonic seconds
    measured_at: float | None = None  # monotonic seconds of the last reply; None = never
    down_at: float | None = None  # monotonic seconds of a transport failure; None = up


@dataclass(kw_only=True, slots=True)
class Router:
    prior_s: float = 0.5  # seconds per item assumed when no peer is measured yet
    ema: float = 0.3  # weight of the newest measurement (in log space)
    jitter: float = 0.2  # multiplicative randomness, 0 = deterministic
    explore: float = 0.05  # share of choices given to a usable candidate at random
    ban_base_s: float = 2.0  # first ban length (s)
    ban_max_s: float = 60.0  # longest ban (s)
    stale_half_life_s: float = 10.0  # seconds for an unmeasured estimate to halve its excess
    # a preferred candidate (`choose(prefer=...)`) is taken while its expected finish is
    # at most this many times the best candidate's; 0 = no preference (ratio)
    affinity: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    peers: dict[str, PeerStats] = field(default_factory=dict)

    def _stats(self, peer: str) -> PeerStats:
        st = self.peers.get(peer)
        if st is None:
            st = self.peers[peer] = PeerStats(seconds_per_item=self._fastest())
        return st

    def _fastest(self) -> float:
        """The lowest estimate of a measured peer (the prior while none is measured)."""
        measured = (s.seconds_per_item for s in self.peers.values() if s.measured_at is not None)
        return min(measured, default=self.prior_s)

    def seconds_per_item(self, peer: str, now: float) -> float:
        """The peer's per-item estimate, its excess over the fastest peer decayed by age.

        Optimistic: a peer never measured is as fast as the fastest measured one *now*,
        so it is tried (and measured) instead of starving behind fast, measured peers."""
        st = self._stats(peer)
        return self._aged(st, self._fastest(), now)

    def _aged(self, st: PeerStats, best: float, now: float) -> float:
        """`st`'s estimate given the fastest one, `best` (`seconds_per_item`)."""
        if st.measured_at is None:
            return best
        age = max(0.0, now - st.measured_at)
        return best + (st.seconds_per_item - best) * math.pow(0.5, age / self.stale_half_life_s)

    def _finish(self, peer: str, best: float, now: float) -> float:
        """Expected seconds until `peer` finishes one more item: its queue and that item."""
        st = self.peers[peer]
        return (st.in_flight + 1) * self._aged(st, best, now)

    def is_down(self, peer: str) -> bool:
        st = self.peers.get(peer)
        return st is not None and st.down_at is not None

    def usable(
        self, candidates: list[str], now: float, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[str]:
        """The candidates a micro-batch may go to now: not excluded, not banned, and not
        down unless every candidate is down."""
        up = [p for p in candidates if not self.is_down(p)]
        pool = up if up else candidates
        return [p for p in pool if p not in exclude and self._stats(p).banned_until <= now]

    def choose(
        self,
        candidates: list[str],
        now: float,
        exclude: frozenset[str] | set[str] = frozenset(),
        prefer: Collection[str] = (),
    ) -> str | None:
        """The usable candidate with the lowest jittered expected finish time, or None;
        the soonest of the usable ones in `prefer` while that is within `affinity` times
        the best one's finish."""
        live = self.usable(candidates, now, exclude)
        if not live:
            return None
        best = self._fastest()  # once a choice: the simulator asks it of hundreds of peers
        if self.affinity > 0 and prefer:
            finish = {p: self._finish(p, best, now) for p in live}
            paired = [p for p in live if p in prefer]
            if paired:
                soonest = min(paired, key=finish.__getitem__)
                if finish[soonest] <= self.affinity * min(finish.values()):
                    return soonest
        if len(live) > 1 and self.rng.random() < self.explore:
            return self.rng.choice(live)
        rand, jitter = self.rng.random, self.jitter
        return min(live, key=lambda p: self._finish(p, best, now) * (1 + jitter * rand()))

    def started(self, peer: str) -> None:
        self._stats(peer).in_flight += 1

    def succeeded(self, peer: str, elapsed_s: float, now: float) -> None:
        """A reply from `peer` took `elapsed_s`. The moving average starts from the aged
        estimate, the one `choose` went by: starting from the stored one, which ageing
        does not change, a fast reply after a long gap set the estimate back up to near
        the old slow value and starved the replica for another stretch."""
        st = self._stats(peer)
        current = self.seconds_per_item(peer, now)
        first = st.measured_at is None
        st.measured_at = now
        st.in_flight = max(0, st.in_flight - 1)
        st.failures = 0
        # A reply took `elapsed_s` with `in_flight + 1` items queued at the peer. The
        # first one replaces the optimistic guess; later ones move a geometric average:
        # one reply 50 x slow (a stall at the peer) raises the estimate 3.2 x, not
        # 16 x, and five normal replies undo it.
        per_item = max(elapsed_s / (st.in_flight + 1), MIN_SECONDS)
        if first:
            st.seconds_per_item = per_item
        else:
            st.seconds_per_item = current * math.pow(per_item / current, self.ema)

    def failed(self, peer: str, now: float, *, unreachable: bool = False) -> float:
        """Record a failure; returns the ban length in seconds. `unreachable` (a transport
        failure) also marks the peer down until the membership shows it alive again."""
        st = self._stats(peer)
        st.in_flight = max(0, st.in_flight - 1)
        st.failures += 1
        ban = min(self.ban_max_s, self.ban_base_s * 2.0 ** (st.failures - 1))
        st.banned_until = now + ban
        if unreachable and st.down_at is None:
            st.down_at = now
        return ban

    def revive(self, peer: str) -> bool:
        """The membership shows `peer` alive again: up, and its ban lifted (its failure
        count stays, so a new failure bans it longer). True if it was down."""
        st = self.peers.get(peer)
        if st is None or st.down_at is None:
            return False
        st.down_at = None
        st.banned_until = 0.0
        return True

    def listed(self, members: Iterable[str], failed_before: float) -> list[str]:
        """A membership view lists `members`, and proves alive each that went down before
        `failed_before` (monotonic seconds: the view was asked for at least the
        coordinator's TTL after that). Returns the peers revived."""
        return [
            p
            for p in members
            if (st := self.peers.get(p)) is not None
            and st.down_at is not None
            and st.down_at <= failed_before
            and self.revive(p)
        ]

    def forget(self, keep: set[str]) -> None:
        """Drop the stats of peers that left the membership view (bounded memory)."""
        for peer in set(self.peers) - keep:
            del self.peers[peer]
