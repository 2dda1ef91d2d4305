"""The node's view of the run's members, as the coordinator last reported them.

Who may use this node's data plane (members only), who its next-stage peers are, how
many replicas its stage has, and whose DHT its outer loop should join. Observers
(`PeerInfo.observer`, e.g. `agora export --coordinator`) are members, so their streams
are admitted, but they are on no stage: never routed to, bootstrapped from or counted as
replicas. Updating the view tells the transport the new peers' addresses and lets the
router forget peers that left; `follow` refreshes it from the coordinator (a delta since
the version held) until cancelled. The view is also the router's evidence that a peer
it saw fail at the transport level is alive after all: a member whose listen addresses
changed (it re-joined) is revived at once, and one still listed by a view asked for at
least `proof_s(run)` after the failure (the coordinator's peer TTL, one expiry sweep and
one heartbeat: a dead peer would have lapsed by then) is revived then (`Router.listed`).
Entries come from other participants: a member whose
addresses or DHT addresses do not parse is left out of the view (logged once), so one bad
entry costs that member, never this node.
"""

from __future__ import annotations

import logging

import trio

from node.coordinator_client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable
from node.p2p.transport import Transport
from node.routing import Router
from protocol.addrs import multiaddr_problem
from protocol.control import PeerInfo, RunInfo

log = logging.getLogger(__name__)


def proof_s(run: RunInfo) -> float:
    """Seconds after a peer failed from which a membership view that still lists it shows
    it alive: its last heartbeat before the failure lapses after the peer TTL, the
    coordinator's sweeper drops it within a sweep (the TTL when the run does not say),
    and one heartbeat interval covers the scheduling of both."""
    sweep = run.sweep_interval_s or run.lease_ttl_s
    return run.lease_ttl_s + sweep + run.heartbeat_interval_s


class PeerView:
    def __init__(self, transport: Transport, router: Router, *, stage: int) -> None:
        self.transport = transport
        self.router = router
        self.stage = stage  # this node's stage
        self.members: dict[str, PeerInfo] = {}
        self.version = 0  # the coordinator's membership version of `members`
        self.root_id = ""  # the coordinator's DHT bootstrap assignment (peer id; "" none)
        self.rejected: dict[str, str] = {}  # peer id -> why its entry was left out

    @property
    def me(self) -> str:
        return self.transport.peer_id

    def is_member(self, peer_id: str) -> bool:
        return peer_id in self.members

    def addrs(self, peer_id: str) -> list[str]:
        info = self.members.get(peer_id)
        return list(info.addrs) if info else []

    async def refresh(self, client: CoordinatorClient) -> None:
        """Ask the coordinator what changed and adopt it; the peers it still lists long
        enough after they failed are alive again (module docstring)."""
        asked_at = trio.current_time()
        view = await client.membership()
        self.update(view.version, dict(view.peers), view.dht_root)
        if client.joined is not None:
            revived = self.router.listed(self.members, asked_at - proof_s(client.joined.run))
            for peer_id in revived:
                log.info("node: %s is still a member long after it failed; routing to it", peer_id)

    async def follow(self, client: CoordinatorClient, interval_s: float) -> None:
        """Refresh every `interval_s` seconds until cancelled (failures are retried)."""
        while True:
            await trio.sleep(interval_s)
            try:
                await self.refresh(client)
            except (CoordinatorError, CoordinatorUnavailable) as exc:
                log.debug("node: membership refresh failed: %s", exc)

    def update(self, version: int, peers: dict[str, PeerInfo], dht_root: str = "") -> None:
        """Adopt the coordinator's view at `version`, without the entries that do not
        parse, and its DHT bootstrap assignment `dht_root`."""
        valid = {}
        for peer_id, peer in peers.items():
            problem = self._admit(peer)
            if problem is None:
                valid[peer_id] = peer
            elif self.rejected.get(peer_id) != problem:
                log.warning("node: leaving member %s out of the view: %s", peer_id[:80], problem)
                self.rejected[peer_id] = problem
        self.rejected = {p: why for p, why in self.rejected.items() if p in peers}
        before = set(self.next_stage_peers())
        for peer_id, peer in valid.items():
            known = self.members.get(peer_id)
            if known is not None and known.addrs != peer.addrs and self.router.revive(peer_id):
                log.info("node: %s re-joined with new addresses; routing to it", peer_id)
        self.members = valid
        self.version = version
        self.root_id = dht_root
        self.router.forget(set(self.members))
        after = set(self.next_stage_peers())
        if after != before:  # the last stage has no next stage: always empty
            log.info(
                "node: membership v%d: %d peers on stage %d (+%d, -%d)",
                version, len(after), self.stage + 1, len(after - before), len(before - after),
            )  # fmt: skip

    def _admit(self, peer: PeerInfo) -> str | None:
        """Why a member's entry cannot be admitted, or None. Entries are checked when they
        are new or changed (a refresh repeats the whole view): the DHT addresses by the
        coordinator's own rule, and the listen addresses by the transport, which learns
        them here."""
        known = self.members.get(peer.peer_id)
        if known is not None and known.dht_addrs == peer.dht_addrs:
            return None
        for addr in peer.dht_addrs:
            if (problem := multiaddr_problem(addr)) is not None:
                return f"bad DHT address: {problem}"
        if known is None and peer.addrs:
            try:
                self.transport.add_peer_addrs(peer.peer_id, peer.addrs)
            except ValueError as exc:
                return f"bad address: {str(exc)[:200]}"
        return None

    def _on_stage(self, stage: int) -> list[PeerInfo]:
        return [p for p in self.members.values() if p.stage == stage and not p.observer]

    def next_stage_peers(self) -> list[str]:
        return [p.peer_id for p in self._on_stage(self.stage + 1) if p.peer_id != self.me]

    def replicas(self) -> int:
        """Members training this node's stage, itself included (at least 1)."""
        return max(1, len(self._on_stage(self.stage)))

    def stage_members(self) -> list[str]:
        """The peer ids the coordinator lists on this node's stage, this node's included:
        the only peers its outer loop forms groups with."""
        return sorted({p.peer_id for p in self._on_stage(self.stage)} | {self.me})

    def partners(self) -> list[str]:
        """The next-stage replicas paired with this node, by rank (peer id order) in the
        two stages: with n replicas here and m there, the one at rank i here is paired
        with those at ranks j = i (mod n) when m >= n, so every next-stage replica has a
        partner, else with the one at rank i mod m. Empty on the last stage."""
        nxt = sorted(self.next_stage_peers())
        mine = self.stage_members()
        i = mine.index(self.me)
        if len(nxt) >= len(mine):
            return nxt[i :: len(mine)]
        return [nxt[i % len(nxt)]] if nxt else []

    def other_replicas_have_dht(self) -> bool:
        """Another replica of this stage announces a DHT (so state can be fetched)."""
        return any(p.dht_addrs for p in self._on_stage(self.stage) if p.peer_id != self.me)

    def dht_root(self) -> PeerInfo | None:
        """The run's canonical DHT bootstrap, as the coordinator assigns it
        (`MembershipReply.dht_root`), or None when that is this node, or no member the
        view admits. Nodes that start at the same moment each begin a DHT of their own;
        before their first round they all move to the root's, so groups can form. The
        assignment stays put while its holder lives, so this converges; no member can
        take the role by choosing its key."""
        root = self.members.get(self.root_id)
        if root is None or root.peer_id == self.me or not root.dht_addrs or root.observer:
            return None
        return root

    def dht_bootstrap(self) -> list[str]:
        """DHT addresses to join: the root's first, then every other member's, so a root
        that just died (still listed until its TTL lapses) does not strand us."""
        others = sorted(
            (p for p in self.members.values() if p.dht_addrs and not p.observer),
            key=lambda p: (p.peer_id != self.root_id, p.peer_id),
        )
        return [a for p in others if p.peer_id != self.me for a in p.dht_addrs]
