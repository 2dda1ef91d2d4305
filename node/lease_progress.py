"""Turns micro-batches that finish out of order into monotonic lease commits.

A lease covers [committed, end) of one shard. Micro-batches cover consecutive ranges and
may finish in any order; only the contiguous prefix of finished ranges can be committed,
so the coordinator's committed offset never runs past a gap.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LeaseProgress:
    committed: int  # token offset in the shard the coordinator has accepted
    end: int  # shard length in tokens
    done: dict[int, int] = field(default_factory=dict)  # finished ranges: start -> stop

    def __post_init__(self) -> None:
        if not 0 <= self.committed <= self.end:
            raise ValueError(f"committed offset {self.committed} outside [0, {self.end}]")

    def finish(self, start: int, stop: int) -> None:
        if not self.committed <= start < stop <= self.end:
            raise ValueError(f"range [{start}, {stop}) outside [{self.committed}, {self.end})")
        self.done[start] = stop

    def commit_point(self) -> int:
        """The furthest offset reachable from `committed` through finished ranges."""
        point = self.committed
        while point in self.done:
            point = self.done[point]
        return point

    def accept(self, point: int) -> None:
        """The coordinator accepted a commit up to `point`: forget what it covers."""
        if point < self.committed:
            raise ValueError(f"commit point {point} moves backwards from {self.committed}")
        self.done = {a: b for a, b in self.done.items() if a >= point}
        self.committed = point

    @property
    def complete(self) -> bool:
        return self.committed >= self.end
