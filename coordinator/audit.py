"""`agora audit --db PATH`: replay the lease audit log and check exactly-once coverage.

Only `commit` records count as coverage; grants, expiries and fences explain how the
commits came about. Per data epoch and shard the committed ranges are sorted and:

- a **duplicated** range is any token committed more than once;
- a **lost** range of a *completed* epoch (one followed by an `epoch` rollover record)
  is any token in `[0, shard tokens)` never committed;
- a **lost** range of the *in-progress* epoch is a hole below the shard's highest
  committed offset (tokens above it are simply not processed yet).

The command exits 1 if any range is lost or duplicated, 2 on a usage error, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from coordinator.journal import AuditEvent
from coordinator.store import read_audit, read_shard_sizes

Range = tuple[int, int, int]  # (shard_id, start, end)


@dataclasses.dataclass(slots=True)
class EpochReport:
    data_epoch: int
    complete: bool
    committed_tokens: int  # distinct tokens committed
    commits: int
    lost: list[Range]
    duplicated: list[Range]

    @property
    def clean(self) -> bool:
        return not self.lost and not self.duplicated


def replay(events: Iterable[AuditEvent], shard_sizes: dict[int, int]) -> list[EpochReport]:
    commits: dict[int, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    completed: set[int] = set()
    epochs: set[int] = {0}
    for e in events:
        epochs.add(e.data_epoch)
        if e.kind == "commit":
            commits[e.data_epoch][e.shard_id].append((e.start, e.end))
        elif e.kind == "epoch":
            completed.add(e.data_epoch - 1)
    reports = []
    for epoch in sorted(epochs):
        complete = epoch in completed
        lost: list[Range] = []
        dup: list[Range] = []
        distinct = 0
        n = 0
        by_shard = commits.get(epoch, {})
        shard_ids = sorted(set(shard_sizes) | set(by_shard)) if complete else sorted(by_shard)
        for sid in shard_ids:
            ranges = sorted(by_shard.get(sid, []))
            n += len(ranges)
            d, sl, sd = check_shard(sid, ranges, shard_sizes.get(sid, 0), complete)
            distinct += d
            lost += sl
            dup += sd
        reports.append(EpochReport(epoch, complete, distinct, n, lost, dup))
    return reports


def check_shard(
    sid: int, ranges: list[tuple[int, int]], shard_tokens: int, complete: bool
) -> tuple[int, list[Range], list[Range]]:
    """(distinct tokens, lost, duplicated) of one shard's committed ranges in one data
    epoch; `ranges` sorted. A complete epoch must cover `[0, shard_tokens)`; an epoch in
    progress only below its highest committed offset."""
    lost: list[Range] = []
    dup: list[Range] = []
    distinct = 0
    end_of = shard_tokens if complete else max((b for _, b in ranges), default=0)
    covered = 0  # highest offset covered so far
    for a, b in ranges:
        if a > covered:
            lost.append((sid, covered, a))
        if a < covered:
            dup.append((sid, a, min(b, covered)))
        distinct += max(0, b - max(a, covered))
        covered = max(covered, b)
    if covered < end_of:
        lost.append((sid, covered, end_of))
    if complete and covered > end_of:
        dup.append((sid, end_of, covered))  # beyond the shard: impossible but checked
    return distinct, lost, dup


class AuditMonitor:
    """Incremental `replay` for the live gauge `agora_coordinator_audit_problem_ranges`.

    Fed the durable audit events in order (`feed`), it keeps per shard the committed
    ranges of the current data epoch and of the one completed last, merging a commit
    that starts where the previous one ended into it (the normal, monotonic case: one
    range per shard). Merging disjoint neighbours keeps every token's commit count, so
    the lost and duplicated *tokens* are exactly `agora audit`'s and the counts are zero
    exactly when it is clean for those epochs; a run of overlapping or gapped commits
    can count as fewer ranges than `agora audit` lists. `problems()` re-checks only the
    shards changed since the last call.
    """

    def __init__(self, shard_sizes: dict[int, int], data_epoch: int) -> None:
        self.shard_sizes = dict(shard_sizes)
        self.current = data_epoch
        self._ranges: dict[int, dict[int, list[list[int]]]] = {data_epoch: {}}
        self._complete: set[int] = set()
        self._counts: dict[tuple[int, int], tuple[int, int]] = {}  # (epoch, shard) -> (l, d)
        self._dirty: set[tuple[int, int]] = set()

    def feed(self, events: Iterable[AuditEvent]) -> None:
        for e in events:
            if e.kind == "commit":
                self._commit(e.data_epoch, e.shard_id, e.start, e.end)
            elif e.kind == "epoch":
                self._rollover(e.data_epoch)

    def _commit(self, epoch: int, sid: int, start: int, end: int) -> None:
        shards = self._ranges.get(epoch)
        if shards is None:
            if epoch < self.current - 1:
                return  # older than what the gauge covers
            shards = self._ranges[epoch] = {}
            if epoch > self.current:
                self.current = epoch
        ranges = shards.setdefault(sid, [])
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = end
        else:
            ranges.append([start, end])
        self._dirty.add((epoch, sid))

    def _rollover(self, new_epoch: int) -> None:
        done = new_epoch - 1
        self._complete.add(done)
        self._ranges.setdefault(done, {})
        self._ranges.setdefault(new_epoch, {})
        self.current = max(self.current, new_epoch)
        for epoch in [e for e in self._ranges if e < self.current - 1]:
            del self._ranges[epoch]
        self._counts = {k: v for k, v in self._counts.items() if k[0] >= self.current - 1}
        self._dirty = {k for k in self._dirty if k[0] >= self.current - 1}
        # a completed epoch must cover every shard, committed to or not
        self._dirty.update((done, sid) for sid in self.shard_sizes)

    def problems(self) -> tuple[int, int]:
        """(lost, duplicated) ranges in the current and the last completed data epoch."""
        for epoch, sid in self._dirty:
            shards = self._ranges.get(epoch)
            if shards is None:
                continue
            ranges = sorted((a, b) for a, b in shards.get(sid, []))
            complete = epoch in self._complete
            _, lost, dup = check_shard(sid, ranges, self.shard_sizes.get(sid, 0), complete)
            self._counts[(epoch, sid)] = (len(lost), len(dup))
        self._dirty.clear()
        lost_n = sum(v[0] for v in self._counts.values())
        dup_n = sum(v[1] for v in self._counts.values())
        return lost_n, dup_n


def _fmt(ranges: list[Range], limit: int = 20) -> str:
    text = ", ".join(f"shard {s} [{a}, {b})" for s, a, b in ranges[:limit])
    return text + (f" ... (+{len(ranges) - limit} more)" if len(ranges) > limit else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agora audit",
        description="Replay a coordinator's lease audit log and report, per data epoch, lost"
        " and duplicated token ranges and the committed tokens. Exit 1 if any range is lost"
        " or duplicated.",
    )
    parser.add_argument("--db", required=True, type=Path, help="the coordinator's SQLite file")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if not args.db.is_file():
        print(f"agora audit: no such database: {args.db}", file=sys.stderr)
        return 2
    try:
        events = read_audit(args.db)
        sizes = read_shard_sizes(args.db)
    except Exception as exc:  # sqlite3.Error and friends: report, do not trace
        print(f"agora audit: cannot read {args.db}: {exc}", file=sys.stderr)
        return 2
    reports = replay(events, sizes)
    print(f"audit of {args.db}: {len(events)} records, {len(sizes)} shards")
    for r in reports:
        state = "complete" if r.complete else "in progress"
        verdict = "clean" if r.clean else "NOT CLEAN"
        print(
            f"data epoch {r.data_epoch} ({state}): committed {r.committed_tokens} tokens in"
            f" {r.commits} commits; lost {len(r.lost)} ranges; duplicated"
            f" {len(r.duplicated)} ranges: {verdict}"
        )
        if r.lost:
            print(f"  lost: {_fmt(r.lost)}")
        if r.duplicated:
            print(f"  duplicated: {_fmt(r.duplicated)}")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=2))
    return 0 if all(r.clean for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
