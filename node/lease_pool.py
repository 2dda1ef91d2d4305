"""Stage 0's leases: what it holds, which windows it has trained, and what it may commit.

A pure state machine, with no I/O and no clock: the driver asks it what to do and tells
it what happened. Its rules:
- `open(lease, shard)` cuts the lease's range `[committed, limit)` into windows of
  `seq_len + 1` tokens every `seq_len` tokens; a tail too short for a window (the shard's
  end) counts as trained at once, since there is nothing in it to train.
- `take(n, rng)` hands out untaken windows, at random across the open leases with an
  `rng` (so one inner step sees many places of the corpus) or in lease order without.
  A window is handed out at most once.
- `finish(windows)` marks windows trained. Only the contiguous prefix of trained ranges
  from a lease's committed offset can be committed (`LeaseProgress`).
- `snapshot()` is the commit point of every held lease now; an outer round takes one
  when it begins, and `commits(upto)` later names the ranges that round may commit.
  Without an outer loop, `commits()` names everything trained.
- `accept(range)` records a commit the coordinator took; a lease whose range is all
  committed is forgotten. Commits are monotonic per lease.
- `fence(lease_id)` forgets a lease the coordinator fenced: its untaken windows are
  dropped, windows in flight are no longer finished, nothing of it is ever committed.
- `release_all()` hands back every held lease (the node is leaving): what was not
  committed returns to the coordinator's queue at its committed offset.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from node.lease_progress import LeaseProgress
from protocol.control import LeaseInfo, LeaseRef


@dataclass(frozen=True, slots=True)
class Window:
    """One training sequence of a leased shard: `seq_len + 1` tokens from `start`."""

    lease: LeaseInfo
    shard: bytes  # the whole shard (shared by its windows)
    start: int  # token offset in the shard


@dataclass(frozen=True, slots=True)
class CommitRange:
    """`[start, end)` of the lease's shard, ready to be committed."""

    lease: LeaseInfo
    start: int
    end: int


Snapshot = dict[int, int]  # lease id -> commit point


class LeasePool:
    def __init__(self, *, seq_len: int, max_open: int, shard_cache: int) -> None:
        if seq_len < 1 or max_open < 1 or shard_cache < 1:
            raise ValueError("seq_len, max_open and shard_cache must be >= 1")
        self.seq_len = seq_len  # tokens per window (plus one for the last target)
        self.max_open = max_open  # leases with untaken windows at once
        self.shard_cache = shard_cache  # shards whose bytes are kept
        self.leases: dict[int, LeaseInfo] = {}  # held leases by id
        self.tokens_committed = 0  # lease tokens the coordinator accepted from this pool
        self._progress: dict[int, LeaseProgress] = {}
        self._fenced: set[int] = set()
        self._untaken: list[Window] = []
        self._shards: dict[int, bytes] = {}  # shard id -> bytes, oldest first

    # --- shards ------------------------------------------------------------------------

    def shard(self, shard_id: int) -> bytes | None:
        """A cached shard's bytes, or None when it must be fetched."""
        return self._shards.get(shard_id)

    def _cache(self, shard_id: int, data: bytes) -> None:
        if shard_id not in self._shards and len(self._shards) >= self.shard_cache:
            self._shards.pop(next(iter(self._shards)))
        self._shards[shard_id] = data

    # --- leases and windows --------------------------------------------------------------

    def open(self, lease: LeaseInfo, shard: bytes) -> int:
        """Hold a granted lease and cut its windows; returns how many."""
        if lease.lease_id in self.leases or lease.lease_id in self._fenced:
            raise ValueError(f"lease {lease.lease_id} is already held or was fenced")
        self._cache(lease.shard_id, shard)
        progress = LeaseProgress(committed=lease.committed, end=lease.limit)
        t = self.seq_len
        starts = [s for s in range(lease.committed, lease.limit, t) if s + t + 1 <= len(shard)]
        tail = starts[-1] + t if starts else lease.committed
        if tail < lease.limit:
            progress.finish(tail, lease.limit)
        self.leases[lease.lease_id] = lease
        self._progress[lease.lease_id] = progress
        self._untaken.extend(Window(lease, shard, s) for s in starts)
        return len(starts)

    @property
    def open_leases(self) -> int:
        """Leases that still have untaken windows."""
        return len({w.lease.lease_id for w in self._untaken})

    @property
    def untaken(self) -> int:
        return len(self._untaken)

    def wants_lease(self) -> bool:
        return self.open_leases < self.max_open

    def take(self, n: int, rng: random.Random | None = None) -> list[Window]:
        """Up to `n` untaken windows: drawn with `rng`, or the oldest ones without."""
        n = min(n, len(self._untaken))
        if rng is None:
            out, self._untaken = self._untaken[:n], self._untaken[n:]
            return out
        return [self._untaken.pop(rng.randrange(len(self._untaken))) for _ in range(n)]

    def finish(self, windows: Iterable[Window]) -> None:
        """These windows were trained (fenced leases' windows are ignored)."""
        for w in windows:
            progress = self._progress.get(w.lease.lease_id)
            if progress is not None:
                progress.finish(w.start, min(w.start + self.seq_len, w.lease.limit))

    def is_fenced(self, lease_id: int) -> bool:
        return lease_id in self._fenced

    def fence(self, lease_id: int) -> bool:
        """The coordinator fenced this lease; True if it was held."""
        held = lease_id in self.leases
        self._fenced.add(lease_id)
        self._forget(lease_id)
        return held

    def fence_all(self) -> list[int]:
        """Fence every held lease (the membership lapsed); their ids."""
        ids = list(self.leases)
        for lease_id in ids:
            self.fence(lease_id)
        return ids

    def _forget(self, lease_id: int) -> None:
        self.leases.pop(lease_id, None)
        self._progress.pop(lease_id, None)
        self._untaken = [w for w in self._untaken if w.lease.lease_id != lease_id]

    def refs(self) -> list[LeaseRef]:
        """The held leases as the heartbeat renews them."""
        return [LeaseRef(lease_id=i, epoch=le.epoch) for i, le in self.leases.items()]

    # --- commits -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The commit point of every held lease now."""
        return {i: p.commit_point() for i, p in self._progress.items()}

    def commits(self, upto: Snapshot | None = None) -> list[CommitRange]:
        """Ranges that may be committed now: up to `upto`'s points (the leases it names),
        or up to every lease's commit point when `upto` is None."""
        out = []
        for lease_id, progress in self._progress.items():
            if upto is not None and lease_id not in upto:
                continue
            point = progress.commit_point()
            if upto is not None:
                point = min(point, upto[lease_id])
            if point > progress.committed:
                out.append(CommitRange(self.leases[lease_id], progress.committed, point))
        return out

    def pending(self, commit: CommitRange) -> bool:
        """`commit` can still be sent: its lease is held and its start is the committed
        offset (a commit that raced with another, or with a fence, cannot)."""
        progress = self._progress.get(commit.lease.lease_id)
        return progress is not None and progress.committed == commit.start

    def accept(self, commit: CommitRange) -> bool:
        """The coordinator accepted `commit`; True when its lease is now complete (and
        forgotten)."""
        lease_id = commit.lease.lease_id
        progress = self._progress[lease_id]
        if commit.start != progress.committed:
            raise ValueError(
                f"lease {lease_id}: commit from {commit.start} but committed is {progress.committed}"
            )
        progress.accept(commit.end)
        self.tokens_committed += commit.end - commit.start
        if progress.complete:
            self._forget(lease_id)
            return True
        return False

    def release_all(self) -> list[LeaseInfo]:
        """Every held lease, forgotten (the node is leaving)."""
        held = list(self.leases.values())
        for lease in held:
            self._forget(lease.lease_id)
        return held
