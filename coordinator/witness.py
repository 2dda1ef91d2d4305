"""Claimed throughput checked against work other members witnessed. Pure, no clock.

A member's claimed throughput (tokens/s, in its join and heartbeats) decides where new
members go, when a replica is moved and how large a deadline-bound lease is, so a claim
has to be backed by work. Members report, per adjacent member, the tokens of
micro-batches that completed with it (`protocol.control.Witnessed`): a stage's replies
as the stage before it saw them, and stage 0's forwards as stage 1 served them.
`WitnessBook` keeps what others witnessed for each member over the last `window_s`
(in `BUCKETS` time buckets, so memory is fixed per member) and decides what to count:

- Routing spreads a stage's micro-batches by measured speed (node.routing), so within
  a stage every honest replica's claim / witnessed rate is about the same, whatever the
  demand. At a recount, for each stage with at least `MIN_MEASURED` replicas that have
  been members for a whole window and were witnessed, a replica counts
  `min(claim, slack x median(claim / rate) x its rate)`: an honest replica within
  `slack` of the stage's median keeps its claim, and one that claims 100x what it does
  counts about `slack` x its share of the work. One that did nothing in a whole window
  counts 0 (placement counts `membership.MIN_RATE`).
- A replica younger than a window (nothing witnessed yet) counts its claim up to
  `claim_ratio` x the median counted throughput of its stage's measured replicas.
- A stage with fewer measured replicas is not checked: a median of two is either one.

The book also issues each member's credit (`protocol.credit`): the rate others witnessed
for it over the part of the window it was measured in, signed (a heartbeat reply
carries it; groupmates bound its outer-loop token claim by it, node.outer.credit). The
rate moves at most once a bucket, so a credit is re-signed at most once a bucket, and
only when its rate changed or it is `CREDIT_HOLD_S` old: an ed25519 signature costs
about a third of a heartbeat's CPU, and most heartbeats reuse the last one. A member
nothing was witnessed for gets no credit (groups read that as a rate of 0), nor does
one measured for less than half a window: its witnessed work lags what it did by up to
a report interval and a bucket, which is most of a young member's time (in a chaos run,
young honest members' credits backed 13 to 30 % of what they had trained).

What it does not stop: members that witness for each other (a Sybil on stage 0 and one
on stage 1) can back each other's claims; a minority of them cannot move a stage's
median, so honest replicas keep their claims. Soft state: a restarted coordinator starts
measuring again (every member is young for one window).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.control import HeartbeatRequest
from protocol.credit import sign_credit
from protocol.identity import NodeKey

if TYPE_CHECKING:  # the coordinator's types, read here, never built
    from coordinator.config import CoordinatorConfig
    from coordinator.membership import Peer

BUCKETS = 8  # time buckets per window
MIN_MEASURED = 3  # measured replicas a stage needs before its claims are checked
# seconds an unchanged credit is handed out before it is signed anew (well inside the
# age a group still counts: node.outer.credit.MAX_CREDIT_AGE_S, 300 s)
CREDIT_HOLD_S = 120.0


@dataclass(frozen=True, slots=True)
class Member:
    """What a recount needs of a live member."""

    peer_id: str
    stage: int
    joined_at: float  # unix seconds
    claim: float  # its claimed throughput (tokens/s)


@dataclass(frozen=True, slots=True)
class Issued:
    """The credit a member's heartbeats get, and what it says."""

    at: float  # unix seconds at signing
    stage: int
    rate: float  # tokens/s witnessed
    data: bytes  # the encoded, signed credit


def witnesses(reporter_stage: int, peer_stage: int) -> bool:
    """Whether a member of `reporter_stage` sees the work of one of `peer_stage`: the
    stage before it (its replies), or stage 1 for stage 0 (the forwards it served)."""
    return peer_stage == reporter_stage + 1 or (peer_stage == 0 and reporter_stage == 1)


class WitnessBook:
    """Witnessed tokens per member, and the throughput to count for each."""

    def __init__(
        self,
        *,
        window_s: float,
        slack: float,
        claim_ratio: float,
        started: float = 0.0,
        key: NodeKey | None = None,
        run: str = "",
    ) -> None:
        if window_s <= 0 or slack < 1 or claim_ratio < 1:
            raise ValueError(
                f"need window_s > 0, slack >= 1, claim_ratio >= 1; got {window_s}, {slack},"
                f" {claim_ratio}"
            )
        self.window_s = window_s  # seconds of work a claim is checked against
        self.slack = slack  # a replica may claim this x the stage's median claim/rate
        self.claim_ratio = claim_ratio  # a young replica's claim, x its stage's median
        self.started = started  # unix seconds: nobody was measured before
        self.key = key  # signs the credits of `run`'s members; None: none are issued
        self.run = run
        self.claims: dict[str, float] = {}  # member -> its latest claim (tokens/s)
        self._bucket_s = window_s / BUCKETS
        # peer -> bucket index -> tokens witnessed in it (at most BUCKETS + 1 kept)
        self._seen: dict[str, dict[int, int]] = {}
        self._stage_median: dict[int, float] = {}  # stage -> median counted (last recount)
        self.tokens_total = 0  # witnessed tokens taken since the start
        self._issued: dict[str, Issued] = {}  # member -> the credit its heartbeats get

    @classmethod
    def from_config(
        cls, cfg: CoordinatorConfig, *, started: float, key: NodeKey | None = None
    ) -> WitnessBook | None:
        """The book a coordinator config asks for, issuing credits signed by `key` (None:
        a fresh one); None when `witness_window_s` is 0."""
        if cfg.witness_window_s <= 0:
            return None
        return cls(
            window_s=cfg.witness_window_s, slack=cfg.witness_slack,
            claim_ratio=cfg.claim_ratio, started=started, key=key or NodeKey.generate(),
            run=cfg.run_id,
        )  # fmt: skip

    def admit(self, peer: str, stage: int, claim: float) -> float:
        """A joining member's claim: recorded, and counted as a young member's."""
        self.claims[peer] = claim
        return self.cap_young(stage, claim)

    def heartbeat(
        self,
        peer: Peer,
        req: HeartbeatRequest,
        stage_of: Callable[[str], int | None],
        now: float,
    ) -> float | None:
        """Record what a heartbeat says `peer` witnessed and claims; the throughput to
        count for it now: a young member's capped claim, else None (the next `recount`
        decides). An observer's claim is taken as it is (it is on no stage)."""
        if peer.observer:
            return req.throughput
        if req.witnessed:
            self.report(peer.peer_id, peer.stage, [(x.peer, x.tokens) for x in req.witnessed],
                        stage_of, now)  # fmt: skip
        if req.throughput is None:
            return None
        self.claims[peer.peer_id] = req.throughput
        return (
            self.cap_young(peer.stage, req.throughput) if self.young(peer.joined_at, now) else None
        )

    def recount(self, live: Iterable[Peer], now: float) -> dict[str, float]:
        """The throughput to count for every live training member (`counted`), its claim
        taken from what it last claimed (else what it is counted at now)."""
        members = [
            Member(p.peer_id, p.stage, p.joined_at, self.claims.setdefault(p.peer_id, p.throughput))
            for p in live
            if not p.observer
        ]
        return dict(self.counted(members, now))

    def young(self, joined_at: float, now: float) -> bool:
        """Whether a member that joined at `joined_at` has not been measured for a whole
        window yet (a restarted coordinator measures everyone afresh)."""
        return now - max(joined_at, self.started) < self.window_s

    def report(
        self,
        reporter: str,
        reporter_stage: int,
        entries: Iterable[tuple[str, int]],
        stage_of: Callable[[str], int | None],
        now: float,
    ) -> int:
        """Record what `reporter` witnessed: (peer, tokens) entries; `stage_of` gives a
        live training member's stage (None for anyone else). Entries for itself, for a
        non-member or for a stage it does not witness are dropped. Returns how many
        were taken."""
        bucket = int(now // self._bucket_s)
        taken = 0
        for peer, tokens in entries:
            stage = stage_of(peer)
            if peer == reporter or stage is None or not witnesses(reporter_stage, stage):
                continue
            seen = self._seen.setdefault(peer, {})
            seen[bucket] = seen.get(bucket, 0) + tokens
            if len(seen) > BUCKETS + 1:
                del seen[min(seen)]
            taken += 1
            self.tokens_total += tokens
        return taken

    def rate(self, peer: str, now: float) -> float:
        """Tokens/s others witnessed for `peer` over the last window."""
        first = int(now // self._bucket_s) - BUCKETS
        seen = self._seen.get(peer, {})
        return sum(t for b, t in seen.items() if b > first) / self.window_s

    def witnessed_rate(self, peer: str, joined_at: float, now: float) -> float:
        """Tokens/s others witnessed for `peer` over the part of the last window it has
        been measured in (a member younger than a window: its own time, at least a
        bucket), so a joiner's rate is not its share of a window it was absent for."""
        age = now - max(joined_at, self.started)
        measured = min(self.window_s, max(self._bucket_s, age))
        return self.rate(peer, now) * self.window_s / measured

    def credit(self, peer: Peer, now: float) -> bytes:
        """`peer`'s signed credit (`protocol.credit`): the one issued last while it is
        younger than a bucket, or names the rate and stage of now and is younger than
        `CREDIT_HOLD_S`; else a new one. b"" for an observer, for a member measured for
        less than half a window or nothing was witnessed for (a group reads a member
        without a credit as one with a rate of 0), or without a key."""
        if peer.observer or self.key is None:
            return b""
        issued = self._issued.get(peer.peer_id)
        if issued is not None and issued.stage != peer.stage:
            issued = None
        if issued is not None and now - issued.at < self._bucket_s:
            return issued.data
        rate = self.witnessed_rate(peer.peer_id, peer.joined_at, now)
        young = now - max(peer.joined_at, self.started) < self.window_s / 2
        if young or rate <= 0.0:  # nothing (or too little) to credit
            self._issued.pop(peer.peer_id, None)
            return b""
        if issued is not None and rate == issued.rate and now - issued.at < CREDIT_HOLD_S:
            return issued.data
        data = sign_credit(
            self.key, run=self.run, peer=peer.peer_id, stage=peer.stage, rate=rate, issued_at=now
        )
        self._issued[peer.peer_id] = Issued(at=now, stage=peer.stage, rate=rate, data=data)
        return data

    def counted(self, members: Iterable[Member], now: float) -> Iterator[tuple[str, float]]:
        """(peer, tokens/s to count) for every member, by the rules above."""
        by_stage: dict[int, list[Member]] = {}
        for m in members:
            by_stage.setdefault(m.stage, []).append(m)
        self._stage_median = {}
        for stage, ms in by_stage.items():
            aged = [
                (m, self.rate(m.peer_id, now)) for m in ms if now - m.joined_at >= self.window_s
            ]
            ratios = [m.claim / r for m, r in aged if r > 0]
            checked = len(ratios) >= MIN_MEASURED
            median = statistics.median(ratios) if checked else 0.0
            got = {
                m.peer_id: min(m.claim, self.slack * median * r) if checked else m.claim
                for m, r in aged
            }
            if got:
                self._stage_median[stage] = statistics.median(got.values())
            for m in ms:
                p = m.peer_id
                yield p, got[p] if p in got else self.cap_young(stage, m.claim)

    def cap_young(self, stage: int, claim: float) -> float:
        """A member too young to be measured: its claim, up to `claim_ratio` x its
        stage's median counted throughput at the last recount (uncapped without one)."""
        median = self._stage_median.get(stage)
        return claim if median is None else min(claim, self.claim_ratio * median)

    def forget(self, peer: str) -> None:
        """A member that left, lapsed or was banned."""
        self._seen.pop(peer, None)
        self.claims.pop(peer, None)
        self._issued.pop(peer, None)
