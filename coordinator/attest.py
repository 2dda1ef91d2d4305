"""Attested global states: the state of a stage that a majority of its replicas hold.

Each replica reports the global state it holds, `(round, digest)`, in its heartbeats
(`HeartbeatRequest.state`). The coordinator keeps each replica's last `HISTORY` distinct
reports. A state is attested when more than half of the stage's reporting replicas hold it
now or held it among those reports (a replica that stepped on from a state vouched for
it); the stage's attested state is the newest such state among its live replicas, and
the last one found stays while no state has a majority. Joiners, replicas that rebase and the live export take only that state, so a
minority of a stage's replicas cannot hand the others a state of their own by claiming a
higher round. A lone replica attests its own state. Soft state, like heartbeats: a
restarted coordinator rebuilds it from the next reports.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Container, Mapping
from typing import Any

HISTORY = 8  # distinct states kept per replica (newest last)

State = tuple[int, str]  # (outer round, digest)


class Attestations:
    """Reports per stage and replica, and each stage's attested state."""

    def __init__(self, history: int = HISTORY) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.history = history
        self._held: dict[int, dict[str, deque[State]]] = {}  # stage -> peer -> states
        self._stage_of: dict[str, int] = {}
        self._attested: dict[int, State] = {}
        self._dirty: set[int] = set()
        self.disagreeing = 0  # reports of an attested round with another digest

    def report(self, peer_id: str, stage: int, state: State) -> None:
        """`peer_id`, a replica of `stage`, holds `state` now."""
        was = self._stage_of.get(peer_id)
        if was is not None and was != stage:
            self.forget(peer_id)
        held = self._held.setdefault(stage, {}).setdefault(peer_id, deque(maxlen=self.history))
        self._stage_of[peer_id] = stage
        if held and held[-1] == state:
            return
        held.append(state)
        self._dirty.add(stage)
        known = self._attested.get(stage)
        if known is not None and known[0] == state[0] and known[1] != state[1]:
            self.disagreeing += 1

    def forget(self, peer_id: str) -> None:
        """`peer_id` left its stage (it left the run, lapsed, or moved)."""
        stage = self._stage_of.pop(peer_id, None)
        if stage is not None and self._held.get(stage, {}).pop(peer_id, None) is not None:
            self._dirty.add(stage)

    def attested(self, stage: int, live: Container[str]) -> State | None:
        """The stage's attested state, counting only the replicas in `live` (a peer that
        is no longer a live replica of the stage is forgotten here)."""
        if stage in self._dirty:
            self._dirty.discard(stage)
            held = self._held.get(stage, {})
            for gone in [p for p in held if p not in live]:
                self.forget(gone)
            found = newest_majority(list(held.values()))
            if found is not None:
                self._attested[stage] = found
        return self._attested.get(stage)


class LiveOn:
    """The live replicas of one stage, as a container of peer ids: `live` maps a peer id
    to a member with `stage` and `observer` (coordinator.membership.Peer)."""

    def __init__(self, live: Mapping[str, Any], stage: int) -> None:
        self.live, self.stage = live, stage

    def __contains__(self, peer_id: object) -> bool:
        peer = self.live.get(peer_id) if isinstance(peer_id, str) else None
        return peer is not None and peer.stage == self.stage and not peer.observer


def newest_majority(histories: list[deque[State]] | list[list[State]]) -> State | None:
    """The newest state that more than half of `histories` (one per replica) contain;
    among states of one round, the one most replicas hold, then the smaller digest."""
    if not histories:
        return None
    counts: Counter[State] = Counter()
    for h in histories:
        counts.update(set(h))
    need = len(histories) // 2 + 1
    found = [s for s, n in counts.items() if n >= need]
    if not found:
        return None
    return max(found, key=lambda s: (s[0], counts[s], [-ord(ch) for ch in s[1]]))
