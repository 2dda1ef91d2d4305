"""`agora audit --db PATH [--export DIR]`: reconcile a coordinator's records.

The coverage replay (`replay`): only `commit` records count as coverage. Per data epoch
and shard the committed ranges are sorted and:

- a **duplicated** range is any token committed more than once;
- a **lost** range of a *completed* epoch (one followed by an `epoch` rollover record)
  is any token in `[0, shard tokens)` never committed;
- a **lost** range of the *in-progress* epoch is a hole below the shard's highest
  committed offset (tokens above it are simply not processed yet).

The command adds the reconciliation of `coordinator.reconcile` (every lease's life,
re-queues, the shards table against the manifest and the log, refused commits whose
training reached the state: "trained twice"), and with `--export DIR` the check that
every stage-0 commit rode in a state on the exported model's lineage. It says which mode
it ran in: `full_epoch` (at least one data epoch complete) or `in_progress`, and what
that mode proves (docs/audit.md). Every problem is a named finding; the command exits 1
on any finding, 2 on a usage error, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from coordinator import reconcile
from coordinator.journal import AuditEvent
from coordinator.reconcile import Finding
from coordinator.store import read_audit, read_leases, read_meta, read_shard_sizes
from protocol.errors import ProtocolError
from protocol.lineage import LINEAGE_FILE, LINEAGE_FORMAT, Link, check_lineage

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


PROVES = {
    "full_epoch": "every token of every training shard in each complete data epoch was"
    " committed exactly once, by a lease granted for it; in the epoch in progress, no"
    " token below a shard's committed offset was lost or committed twice",
    "in_progress": "no data epoch is complete yet: no token below a shard's committed"
    " offset was lost or committed twice; tokens above it are not trained yet, so"
    " nothing is proven about them",
}
LINEAGE_PROVES = (
    "every stage-0 commit rode in a state (round, digest) of the exported stage 0's chain:"
    " the committing replica's stage-0 state held the range's training, and the exported"
    " stage-0 state descends from that state. It proves nothing about other stages' states"
    " beyond their own exported chains."
)


def export_chain(directory: Path) -> tuple[list[Link], dict[str, Any]]:
    """Stage 0's chain from `DIR/lineage.json` and the per-stage summary; ValueError
    when the file is missing or malformed."""
    path = directory / LINEAGE_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != LINEAGE_FORMAT:
        raise ValueError(f"{path} is not an {LINEAGE_FORMAT} file")
    stages = doc.get("stages")
    if not isinstance(stages, dict) or not isinstance(stages.get("0"), dict):
        raise ValueError(f"{path} has no stage 0")
    summary: dict[str, Any] = {}
    chain: list[Link] = []
    for key, entry in stages.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: stage {key!r} is not a map")
        try:
            links = check_lineage(entry.get("lineage", []), f"{path}: stage {key}")
        except ProtocolError as exc:
            raise ValueError(str(exc)) from exc
        summary[str(key)] = {"round": entry.get("round"), "digest": entry.get("digest")}
        if key == "0":
            chain = links
    return chain, summary


def manifest_shards(meta: dict[str, str], config: Path | None) -> dict[int, int] | None:
    """Shard id -> tokens of the manifest the database belongs to: rebuilt from the run's
    dataset when `config` is given (checked against the database's dataset hash), else
    as the coordinator recorded it at the run's start; None when neither is known."""
    if config is not None:
        from coordinator.config import load_config
        from coordinator.dataset import load_dataset

        manifest, _ = load_dataset(load_config(config, {}))
        if meta.get("dataset_hash") != manifest.content_hash:
            raise ValueError(
                f"the database belongs to dataset {meta.get('dataset_hash')}, {config}'s"
                f" dataset hashes to {manifest.content_hash}"
            )
        return {s.shard_id: s.tokens for s in manifest.train}
    recorded = meta.get("train_shards")
    if recorded is None:
        return None
    return {int(a): int(b) for a, b in json.loads(recorded)}


def audit(
    events: list[AuditEvent],
    sizes: dict[int, int],
    meta: dict[str, str],
    lease_rows: list[tuple[Any, ...]],
    shard_rows: dict[int, tuple[int, int]],
    manifest: dict[int, int] | None,
    chain: list[Link] | None,
) -> dict[str, Any]:
    """The whole report (plain data; `findings` empty when clean)."""
    reports = replay(events, sizes)
    findings: list[Finding] = []
    for r in reports:
        for name, what, ranges in (
            ("lost_range", "never committed", r.lost),
            ("duplicated_range", "committed more than once", r.duplicated),
        ):
            findings += [
                Finding(name, what, r.data_epoch, shard_id=sid, start=a, end=b)
                for sid, a, b in ranges
            ]
    active = {int(row[0]) for row in lease_rows if row[9] == "active"}
    findings += reconcile.check_leases(events, active)
    data_epoch = int(meta.get("data_epoch", "0"))
    findings += reconcile.check_tables(events, shard_rows, data_epoch, manifest)
    twice, found = reconcile.trained_twice(events, None if chain is None else set(chain))
    findings += found
    lineage: dict[str, Any] | None = None
    if chain is not None:
        lineage, found = reconcile.check_lineage(events, chain)
        findings += found
    mode = "full_epoch" if any(r.complete for r in reports) else "in_progress"
    return {
        "mode": mode,
        "proves": PROVES[mode] + ("; " + LINEAGE_PROVES if chain is not None else ""),
        "records": len(events),
        "shards": len(sizes),
        "manifest_checked": manifest is not None,
        "committed_tokens": sum(r.committed_tokens for r in reports),
        "lost_ranges": [[r.data_epoch, *x] for r in reports for x in r.lost],
        "duplicated_ranges": [[r.data_epoch, *x] for r in reports for x in r.duplicated],
        "trained_twice_tokens": twice,
        "lineage": lineage,
        "findings": [dataclasses.asdict(f) for f in findings],
        "epochs": [dataclasses.asdict(r) for r in reports],
    }


def _print(db: Path, report: dict[str, Any]) -> None:
    print(
        f"audit of {db}: {report['records']} records, {report['shards']} shards;"
        f" mode {report['mode']}"
    )
    for r in report["epochs"]:
        state = "complete" if r["complete"] else "in progress"
        print(
            f"data epoch {r['data_epoch']} ({state}): committed {r['committed_tokens']} tokens"
            f" in {r['commits']} commits; lost {len(r['lost'])} ranges; duplicated"
            f" {len(r['duplicated'])} ranges"
        )
        if r["lost"]:
            print(f"  lost: {_fmt([tuple(x) for x in r['lost']])}")
        if r["duplicated"]:
            print(f"  duplicated: {_fmt([tuple(x) for x in r['duplicated']])}")
    print(f"trained twice: {report['trained_twice_tokens']} tokens")
    if not report["manifest_checked"]:
        print("shards vs manifest: not checked (no manifest recorded; pass --config)")
    if report["lineage"] is not None:
        print(f"lineage: {json.dumps(report['lineage'])}")
    findings = report["findings"]
    for f in findings[:50]:
        print(
            f"FINDING {f['name']}: {f['detail']} (data epoch {f['data_epoch']}, shard"
            f" {f['shard_id']}, lease {f['lease_id']}, [{f['start']}, {f['end']}))"
        )
    if len(findings) > 50:
        print(f"... and {len(findings) - 50} more findings")
    print(f"proves: {report['proves']}")
    print("NOT CLEAN" if findings else "clean")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agora audit",
        description="Reconcile a coordinator's lease audit log: lost and duplicated token"
        " ranges per data epoch, every lease's life, re-queues, the shards table against"
        " the manifest, tokens trained twice, and with --export the lineage of every"
        " commit. Exit 1 on any finding.",
    )
    parser.add_argument("--db", required=True, type=Path, help="the coordinator's SQLite file")
    parser.add_argument(
        "--export", type=Path, help="an `agora export` directory: check every stage-0 commit"
        " against its lineage.json",
    )  # fmt: skip
    parser.add_argument(
        "--config", type=Path, help="the run's config: rebuild the manifest from its dataset"
        " and check the shards table against it",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    if not args.db.is_file():
        print(f"agora audit: no such database: {args.db}", file=sys.stderr)
        return 2
    try:
        events = read_audit(args.db)
        sizes = read_shard_sizes(args.db)
        meta = read_meta(args.db)
        leases = read_leases(args.db)
        shard_rows = _shard_rows(args.db)
    except Exception as exc:  # sqlite3.Error and friends: report, do not trace
        print(f"agora audit: cannot read {args.db}: {exc}", file=sys.stderr)
        return 2
    try:
        manifest = manifest_shards(meta, args.config)
        chain, stages = export_chain(args.export) if args.export else (None, None)
    except (ValueError, OSError) as exc:
        print(f"agora audit: {exc}", file=sys.stderr)
        return 2
    report = audit(events, sizes, meta, leases, shard_rows, manifest, chain)
    if stages is not None:
        report["export"] = {"path": str(args.export), "stages": stages}
    _print(args.db, report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if report["findings"] else 0


def _shard_rows(db: Path) -> dict[int, tuple[int, int]]:
    import sqlite3

    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT shard_id, tokens, committed FROM shards").fetchall()
    finally:
        conn.close()
    return {int(a): (int(b), int(c)) for a, b, c in rows}


if __name__ == "__main__":
    sys.exit(main())
