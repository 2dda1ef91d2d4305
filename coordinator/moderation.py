"""Who may stay in the run: the admin calls (drain, ban, pause), the verdicts on
replicas that their stage keeps accusing (`coordinator.accuse`), and the refusal of
commits that rode in no attested state (`coordinator.attest`), mixed into
`coordinator.service.Service`. A ban, by an admin or by a stage's accusations, releases
the peer's leases (their ranges go back to the pool), takes it out of the view for good
(`BANNED`, journaled) and forgets its reported states.
"""

from __future__ import annotations

import logging

from coordinator.accuse import Accusations
from coordinator.attest import Attestations, LiveOn
from coordinator.journal import Journal
from coordinator.leases import LeaseBook
from coordinator.membership import BANNED, Membership, Peer
from coordinator.metrics import CoordinatorMetrics
from coordinator.witness import WitnessBook
from protocol import control as c
from protocol.message import Message

log = logging.getLogger(__name__)


class Moderation:
    """The admin calls and accusation verdicts; the attributes are the service's."""

    membership: Membership
    book: LeaseBook
    journal: Journal
    metrics: CoordinatorMetrics
    attest: Attestations
    accusations: Accusations
    witness: WitnessBook | None
    paused: bool

    def forget_peer(self, peer_id: str) -> None:
        """A member that left, lapsed or was banned: what it reported and what was
        reported on it."""
        self.attest.forget(peer_id)
        self.accusations.forget(peer_id)
        if self.witness is not None:
            self.witness.forget(peer_id)

    def ban_peer(self, peer_id: str, now: float, why: str) -> None:
        """Ban `peer_id` from the run (live or not: the ban is recorded either way)."""
        self.book.release_holder(peer_id, now, expired=True)
        peer = self.membership.remove(peer_id, BANNED)
        self.forget_peer(peer_id)
        if peer is None:  # not live: record the ban anyway
            peer = Peer(peer_id, b"", 0, (), (), "", 0.0, None, None, None, False, now, now)
            peer.state = BANNED
            self.journal.peers[peer_id] = peer
        self.metrics.leaves.labels(BANNED).inc()
        log.warning("banned %s: %s", peer_id, why)

    def judge(self, accuser: Peer, accused: list[c.Accusation], now: float) -> None:
        """Record what a live replica caught, and drop each accused replica that most of
        its stage now accuses. Accusations of a peer that is not a live replica of the
        accuser's stage (or by an observer) are ignored and counted."""
        for a in accused:
            target = self.membership.live.get(a.peer)
            if (
                accuser.observer or target is None or target.observer
                or target.stage != accuser.stage or a.peer == accuser.peer_id
            ):  # fmt: skip
                self.metrics.accusations.labels("ignored").inc()
                continue
            self.accusations.record(accuser.peer_id, a.peer, a.round, now)
            self.metrics.accusations.labels("recorded").inc()
            log.info("%s accuses %s (round %d): %s", accuser.peer_id, a.peer, a.round, a.reason)
            stage = LiveOn(self.membership.live, accuser.stage)
            replicas = self.membership.stage_counts()[accuser.stage]
            if self.accusations.guilty(a.peer, stage, replicas, now):
                by = sorted(self.accusations.accusers(a.peer, now))
                self.ban_peer(a.peer, now, f"accused by {len(by)} replicas of stage "
                              f"{accuser.stage}: {', '.join(p[-8:] for p in by)}")  # fmt: skip
                self.metrics.accusations.labels("banned").inc()

    def check_commit_state(self, peer: Peer, req: c.LeaseCommit, now: float) -> None:
        """Refuse a commit that names another state of a round its stage attested: the
        range rode in a state no majority of the replicas held (a replica off the
        stage's lineage, or lying about it). The lease ends and its range goes back to
        the queue (`LeaseBook.refuse_commit`), to be trained on the stage's lineage."""
        if req.round is None or req.round < 0:
            return
        live = LiveOn(self.membership.live, peer.stage)
        canon = self.attest.contradicts(peer.stage, (req.round, req.digest), live)
        if canon is None:
            return
        why = f"round {req.round} of stage {peer.stage} is {canon}, no majority held {req.digest}"
        log.warning("refused a commit of %s: %s", peer.peer_id[:16], why)
        self.book.refuse_commit(
            peer.peer_id, req.lease_id, req.epoch, req.start, req.end, now, why
        )  # fmt: skip

    # -- admin calls --------------------------------------------------------------------

    def _drain(self, req: c.AdminDrain, now: float) -> Message:
        peer = self.membership.live.get(req.peer_id)
        if peer is None:
            return c.ErrorReply(code="not_found", detail=f"no live peer {req.peer_id[:128]}")
        peer.drain = True
        self.journal.peers[peer.peer_id] = peer
        log.info("admin: drain %s", peer.peer_id)
        return c.OkReply(detail="draining")

    def _ban(self, req: c.AdminBan, now: float) -> Message:
        self.ban_peer(req.peer_id, now, "admin")
        return c.OkReply(detail="banned")

    def _pause(self, req: c.AdminPause, now: float) -> Message:
        self.paused = req.paused
        self.journal.meta["paused"] = "1" if req.paused else "0"
        log.info("admin: %s", "pause" if req.paused else "resume")
        return c.OkReply(detail="paused" if req.paused else "resumed")
