"""What the swarm simulator moves around: peers, their leases, micro-batches, the
requests that carry them from stage to stage, and outer-round groups. Plain records;
swarmlab/plan/sim.py owns the rules that change them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from node.routing import Router
from swarmlab.plan.engine import Link, Worker
from swarmlab.plan.fleet import PeerGroup
from swarmlab.plan.profile import Profile


@dataclass(eq=False, slots=True)
class SimPeer:
    pid: str
    stage: int
    group: PeerGroup
    profile: Profile
    worker: Worker
    link: Link
    router: Router
    alive: bool = True
    serving: dict[Req, None] = field(default_factory=dict)  # open requests to it, in order
    pending_tokens: int = 0
    steps: int = 0  # inner steps since the last round began
    in_round: bool = False
    begin_due: bool = False  # a round is due and begins at the next outer tick
    round_times: list[float] = field(default_factory=list)
    leases: dict[int, LeaseState] = field(default_factory=dict)  # stage 0 only


@dataclass(eq=False, slots=True)
class LeaseState:
    lease_id: int
    epoch: int
    limit: int
    next: int  # next token offset to hand out
    done: set[tuple[int, int]] = field(default_factory=set)  # trained ranges past the prefix
    prefix: int = 0  # contiguous trained end
    mark: int = 0  # prefix at the last round's snapshot
    committed: int = 0


@dataclass(eq=False, slots=True)
class MicroBatch:
    origin: SimPeer
    lease: LeaseState
    span: tuple[int, int]


@dataclass(eq=False, slots=True)
class Req:
    caller: SimPeer
    callee: SimPeer
    mb: MicroBatch
    parent: Req | None  # the request in which `caller` is the callee (None at stage 0)
    sent_at: float
    retry: bool = False  # sent again after a failed attempt
    closed: bool = False


@dataclass(eq=False, slots=True)
class Group:
    stage: int
    members: list[SimPeer]
    closes_at: float
    closed: bool = False
