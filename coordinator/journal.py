"""The change journal: what the in-memory state changed since the last durable write.

State modules (leases, membership) record every mutation here. The server's group
commit takes the journal once per write cycle (`take()` snapshots the rows to plain
tuples in the event-loop thread) and hands the batch to the store, and only then sends
the replies that depended on those changes.

Renewals (a heartbeat moving a peer's or a lease's expiry, a peer's throughput) are not
journaled: liveness is soft state, kept in memory and granted a grace period after a
restart (see `coordinator.leases`). A stored row carries the expiry it had when it was
last written for another reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


class Row(Protocol):
    def row(self) -> tuple[Any, ...]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class AuditEvent:
    """One append-only audit record (ranges are token offsets within the shard).

    `stage`, `round` and `digest` are a commit's (or a refused commit's, `fence`)
    lineage as the committing replica reported it: the global state that holds the
    range's training. -1 / "" when not known (no outer loop, other kinds, older logs)."""

    ts: float  # unix seconds
    data_epoch: int
    kind: str  # grant | commit | expire | fence | complete | release | epoch
    shard_id: int
    lease_id: int
    holder: str
    epoch: int  # fencing epoch
    start: int  # tokens
    end: int  # tokens
    stage: int = -1  # the committing replica's stage
    round: int = -1  # outer round (outer steps) of the state the range rode in
    digest: str = ""  # that state's digest, hex


@dataclasses.dataclass(slots=True)
class Batch:
    """Plain rows, safe to hand to another thread."""

    shards: list[tuple[Any, ...]]
    leases: list[tuple[Any, ...]]
    peers: list[tuple[Any, ...]]
    audit: list[AuditEvent]
    meta: list[tuple[str, str]]
    mlog: list[tuple[int, str, str]]  # (version, peer_id, change)

    def __len__(self) -> int:
        return (
            len(self.shards)
            + len(self.leases)
            + len(self.peers)
            + len(self.audit)
            + len(self.meta)
            + len(self.mlog)
        )


class Journal:
    __slots__ = ("audit", "leases", "meta", "mlog", "peers", "shards")

    def __init__(self) -> None:
        self.shards: dict[int, Row] = {}
        self.leases: dict[int, Row] = {}
        self.peers: dict[str, Row] = {}
        self.audit: list[AuditEvent] = []
        self.meta: dict[str, str] = {}
        self.mlog: list[tuple[int, str, str]] = []

    def __bool__(self) -> bool:
        return bool(
            self.shards or self.leases or self.peers or self.audit or self.meta or self.mlog
        )

    def take(self) -> Batch:
        batch = Batch(
            shards=[r.row() for r in self.shards.values()],
            leases=[r.row() for r in self.leases.values()],
            peers=[r.row() for r in self.peers.values()],
            audit=self.audit,
            meta=list(self.meta.items()),
            mlog=self.mlog,
        )
        self.shards, self.leases, self.peers = {}, {}, {}
        self.audit, self.meta, self.mlog = [], {}, []
        return batch

    def drop(self) -> None:
        """Forget unwritten changes (what a crash does; used by tests)."""
        self.take()
