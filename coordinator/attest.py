"""Attested global states: the state of a stage that a majority of its replicas hold.

Each replica reports the global state it holds, `(round, digest)`, in its heartbeats
(`HeartbeatRequest.state`). The coordinator keeps each replica's last `HISTORY` distinct
reports. A state is attested when more than half of the stage's reporting replicas hold it
now or held it among those reports (a replica that stepped on from a state vouched for
it); the stage's attested state is the newest such state among its live replicas, and
the last one found stays while no state has a majority. Joiners, replicas that rebase and
the live export take only that state, so a minority of a stage's replicas cannot hand the
others a state of their own by claiming a higher round. A lone replica attests its own
state. Soft state, like heartbeats: a restarted coordinator rebuilds it from the next
reports.

The attested state of each round found so far is kept (the newest `CANON_ROUNDS`):
`contradicts` names it for a commit that says its range rode in another state of that
round, one no majority held, which the coordinator refuses (the range goes back to be
trained on the stage's lineage). A commit of a round never found attested is taken as
before; the audit checks it against an export's lineage.

Cost: a report updates per-stage counts of how many replicas hold each state (O(HISTORY));
the attested state is recounted at most once per change of the stage, over its distinct
states and its replicas (to drop those no longer live), not over every report.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

HISTORY = 8  # distinct states kept per replica (newest last)
CANON_ROUNDS = 4096  # attested (round, digest) kept per stage for the commit check (rounds)

State = tuple[int, str]  # (outer round, digest)


@dataclass
class _Stage:
    held: dict[str, deque[State]] = field(default_factory=dict)  # replica -> its states
    counts: Counter[State] = field(default_factory=Counter)  # state -> replicas holding it
    attested: State | None = None
    canon: dict[int, str] = field(default_factory=dict)  # round -> its attested digest
    dirty: bool = False


class Attestations:
    """Reports per stage and replica, and each stage's attested state."""

    def __init__(self, history: int = HISTORY) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.history = history
        self._stages: dict[int, _Stage] = {}
        self._stage_of: dict[str, int] = {}
        self.disagreeing = 0  # reports of an attested round with another digest
        self.contradicted = 0  # commits found riding in another state of an attested round

    def report(self, peer_id: str, stage: int, state: State) -> None:
        """`peer_id`, a replica of `stage`, holds `state` now."""
        if self._stage_of.get(peer_id, stage) != stage:
            self.forget(peer_id)
        st = self._stages.setdefault(stage, _Stage())
        held = st.held.get(peer_id)
        if held is None:
            held = st.held[peer_id] = deque()
            self._stage_of[peer_id] = stage
        elif held[-1] == state:
            return
        if state in held:  # back to a state it held: it moves to the newest place
            held.remove(state)
        else:
            st.counts[state] += 1
            if len(held) == self.history:
                _drop(st.counts, held.popleft())
        held.append(state)
        st.dirty = True
        if st.attested is not None and st.attested[0] == state[0] and st.attested != state:
            self.disagreeing += 1

    def forget(self, peer_id: str) -> None:
        """`peer_id` left its stage (it left the run, lapsed, was banned, or moved)."""
        stage = self._stage_of.pop(peer_id, None)
        st = self._stages.get(stage) if stage is not None else None
        held = st.held.pop(peer_id, None) if st is not None else None
        if st is not None and held is not None:
            for state in held:
                _drop(st.counts, state)
            st.dirty = True

    def attested(self, stage: int, live: Container[str]) -> State | None:
        """The stage's attested state, counting only the replicas in `live` (a peer that
        is no longer a live replica of the stage is forgotten here)."""
        st = self._stages.get(stage)
        if st is None:
            return None
        if st.dirty:
            for gone in [p for p in st.held if p not in live]:
                self.forget(gone)
            st.dirty = False
            found = newest_majority(st.counts, len(st.held))
            if found is not None:
                st.attested = found
                st.canon.pop(found[0], None)  # re-inserted as the newest
                st.canon[found[0]] = found[1]
                if len(st.canon) > CANON_ROUNDS:
                    del st.canon[next(iter(st.canon))]
        return st.attested

    def contradicts(self, stage: int, state: State, live: Container[str]) -> str | None:
        """The digest attested for `state`'s round when it is another one than `state`'s
        (a commit that names `state` rode in no canonical state; counted), else None."""
        self.attested(stage, live)
        st = self._stages.get(stage)
        found = st.canon.get(state[0]) if st is not None else None
        if found is None or found == state[1]:
            return None
        self.contradicted += 1
        return found


def _drop(counts: Counter[State], state: State) -> None:
    counts[state] -= 1
    if counts[state] <= 0:
        del counts[state]


class LiveOn:
    """The live replicas of one stage, as a container of peer ids: `live` maps a peer id
    to a member with `stage` and `observer` (coordinator.membership.Peer)."""

    def __init__(self, live: Mapping[str, Any], stage: int) -> None:
        self.live, self.stage = live, stage

    def __contains__(self, peer_id: object) -> bool:
        peer = self.live.get(peer_id) if isinstance(peer_id, str) else None
        return peer is not None and peer.stage == self.stage and not peer.observer


def newest_majority(counts: Mapping[State, int], replicas: int) -> State | None:
    """The newest state that more than half of `replicas` hold (`counts`: state -> how
    many hold it); among states of one round, the one most hold, then the smaller digest."""
    need = replicas // 2 + 1
    found = [s for s, n in counts.items() if n >= need]
    if not found:
        return None
    return max(found, key=lambda s: (s[0], counts[s], [-ord(ch) for ch in s[1]]))
