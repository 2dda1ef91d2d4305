"""The audit's reconciliation: the lease log against itself, the tables, the manifest and
an export's lineage. Pure: it takes what `coordinator.store` read and returns findings.

What each check reads and what it proves (docs/audit.md has the whole story):

- **Leases** (`check_leases`): every lease's records in log order must be one `grant`,
  then commits that continue each other from the granted start within the granted
  range, by the grant's holder and fencing epoch, then exactly one end (`complete` at
  the limit, `expire` or `release` at the committed offset), unless the lease is still
  active in the leases table. A lease that ended short of its limit must have its rest
  re-queued: the shard's next grant in that data epoch starts at the offset it ended
  at. Together with the coverage replay (`coordinator.audit.replay`: every token once
  per complete epoch, no hole below the high-water mark of the epoch in progress), a
  range granted and not committed was re-queued and later committed exactly once.
- **Tables** (`check_tables`): the shards table against the manifest the database was
  made for (`train_shards` in meta: shard ids and sizes; or a manifest rebuilt from the
  run's dataset), and each shard's committed offset in the data epoch in progress
  against the end of its last commit in the log.
- **Trained twice** (`trained_twice`): a `fence` record of a refused commit that names a
  lineage is a range whose training a fenced holder put into its stage's state (it
  commits only once a round carrying the range was applied with its contribution) while
  the coordinator had re-queued it: that range is trained once more by the new holder.
  With an export, only fences whose (round, digest) is on the exported lineage count:
  the others' training is on a lineage the export does not contain.
- **Lineage** (`check_lineage`, with an export): every stage-0 commit's (round, digest)
  is on the exported stage 0's chain. A round of the chain with another digest is an
  abandoned lineage; a round not on it at all was never applied on that lineage.
  Commits older than the chain's first entry (it keeps the newest
  `protocol.lineage.MAX_LINEAGE`) cannot be checked and are counted, not flagged.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from coordinator.journal import AuditEvent
from protocol.lineage import Link

ENDS = ("complete", "expire", "release")


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """One named problem; the fields locate it (-1 / 0 when they do not apply)."""

    name: str
    detail: str
    data_epoch: int = -1
    shard_id: int = -1
    lease_id: int = 0
    start: int = 0  # tokens
    end: int = 0  # tokens


@dataclasses.dataclass(slots=True)
class _LeaseLog:
    grant: AuditEvent | None = None
    offset: int = 0  # end of the last commit (tokens)
    ended: AuditEvent | None = None
    commits: int = 0


def check_leases(events: Sequence[AuditEvent], active: set[int]) -> list[Finding]:
    """Every lease: grant -> contiguous commits -> one end (or still `active`); every
    range a lease ended without committing re-queued at the offset it ended at."""
    out: list[Finding] = []
    leases: dict[int, _LeaseLog] = defaultdict(_LeaseLog)
    # (data epoch, shard) -> offset its next grant must start at, after an early end
    requeued: dict[tuple[int, int], tuple[int, int]] = {}
    for e in events:
        if e.kind not in ("grant", "commit", *ENDS):
            continue
        log = leases[e.lease_id]
        where = dict(data_epoch=e.data_epoch, shard_id=e.shard_id, lease_id=e.lease_id)
        if e.kind == "grant":
            if log.grant is not None:
                out.append(Finding("granted_twice", "a second grant of one lease id", **where))
                continue
            log.grant, log.offset = e, e.start
            want = requeued.pop((e.data_epoch, e.shard_id), None)
            if want is not None and e.start != want[0]:
                out.append(
                    Finding(
                        "not_requeued",
                        f"lease {want[1]} ended at {want[0]} but the shard's next grant starts"
                        f" at {e.start}",
                        start=min(want[0], e.start), end=max(want[0], e.start), **where,
                    )
                )  # fmt: skip
            continue
        g = log.grant
        if g is None:
            out.append(
                Finding(
                    "vanished_grant", f"a {e.kind} record of a lease never granted",
                    start=e.start, end=e.end, **where,
                )
            )  # fmt: skip
            continue
        if (e.holder, e.epoch, e.shard_id, e.data_epoch) != (
            g.holder, g.epoch, g.shard_id, g.data_epoch,
        ):  # fmt: skip
            out.append(
                Finding(
                    "foreign_record", f"a {e.kind} by another holder, epoch or shard than the"
                    " grant", start=e.start, end=e.end, **where,
                )
            )  # fmt: skip
            continue
        if log.ended is not None:
            out.append(
                Finding(
                    "record_after_end", f"a {e.kind} after the lease's {log.ended.kind}",
                    start=e.start, end=e.end, **where,
                )
            )  # fmt: skip
            continue
        if e.kind == "commit":
            if e.start != log.offset or not e.start < e.end <= g.end:
                out.append(
                    Finding(
                        "commit_out_of_order", f"a commit of [{e.start}, {e.end}) where the"
                        f" lease's committed offset is {log.offset} and its limit {g.end}",
                        start=e.start, end=e.end, **where,
                    )
                )  # fmt: skip
            log.offset = max(log.offset, e.end)
            log.commits += 1
            continue
        log.ended = e
        if e.kind == "complete" and log.offset != g.end:
            out.append(
                Finding(
                    "complete_short", f"completed at {g.end} with commits up to {log.offset}",
                    start=log.offset, end=g.end, **where,
                )
            )  # fmt: skip
        if e.kind != "complete" and e.start != log.offset:
            out.append(
                Finding(
                    "end_offset_mismatch", f"{e.kind} at {e.start}, commits reached {log.offset}",
                    start=min(e.start, log.offset), end=max(e.start, log.offset), **where,
                )
            )  # fmt: skip
        if e.kind != "complete" and log.offset < g.end:
            requeued[(e.data_epoch, e.shard_id)] = (log.offset, e.lease_id)
    for lease_id, log in leases.items():
        if log.grant is not None and log.ended is None and lease_id not in active:
            g = log.grant
            out.append(
                Finding(
                    "unended_lease", "granted, not active, and never completed, expired or"
                    " released", data_epoch=g.data_epoch, shard_id=g.shard_id,
                    lease_id=lease_id, start=log.offset, end=g.end,
                )
            )  # fmt: skip
    return out


def check_tables(
    events: Sequence[AuditEvent],
    shards: dict[int, tuple[int, int]],  # shard id -> (tokens, committed) of the table
    data_epoch: int,
    manifest: dict[int, int] | None,  # shard id -> tokens of the run's manifest
) -> list[Finding]:
    """The shards table against the manifest, and its committed offsets against the log."""
    out: list[Finding] = []
    if manifest is not None:
        for sid in sorted(set(manifest) | set(shards)):
            want = manifest.get(sid)
            have = shards.get(sid, (None, 0))[0]
            if want != have:
                out.append(
                    Finding(
                        "shard_mismatch", f"the shards table has {have} tokens, the manifest"
                        f" {want}", shard_id=sid,
                    )
                )  # fmt: skip
    reached: dict[int, int] = {}
    for e in events:
        if e.kind == "commit" and e.data_epoch == data_epoch:
            reached[e.shard_id] = max(reached.get(e.shard_id, 0), e.end)
    for sid, (_tokens, committed) in sorted(shards.items()):
        logged = reached.get(sid, 0)
        if committed != logged:
            out.append(
                Finding(
                    "progress_mismatch", f"the shards table says {committed} committed in data"
                    f" epoch {data_epoch}, the log {logged}", data_epoch=data_epoch,
                    shard_id=sid, start=min(committed, logged), end=max(committed, logged),
                )
            )  # fmt: skip
    return out


def trained_twice(
    events: Iterable[AuditEvent], chain: set[Link] | None
) -> tuple[int, list[Finding]]:
    """(tokens, findings) of refused commits whose training reached a stage's state."""
    tokens = 0
    out: list[Finding] = []
    for e in events:
        if e.kind != "fence" or e.round < 0 or not e.digest or e.end <= e.start:
            continue
        if chain is not None and (e.round, e.digest) not in chain:
            continue
        tokens += e.end - e.start
        out.append(
            Finding(
                "trained_twice", f"{e.holder[:16]} was fenced committing a range its round"
                f" {e.round} ({e.digest}) had put into the state; the range was re-queued",
                data_epoch=e.data_epoch, shard_id=e.shard_id, lease_id=e.lease_id,
                start=e.start, end=e.end,
            )
        )  # fmt: skip
    return tokens, out


def check_lineage(
    events: Iterable[AuditEvent], chain: Sequence[Link]
) -> tuple[dict[str, Any], list[Finding]]:
    """Every stage-0 commit against the exported stage 0's chain: (summary, findings)."""
    out: list[Finding] = []
    on, before, unknown = 0, 0, 0
    if not chain:
        out.append(Finding("export_without_lineage", "the export records no chain for stage 0"))
        return {"checked": 0}, out
    links = set(chain)
    digest_of = dict(chain)
    first, head = chain[0][0], chain[-1][0]
    for e in events:
        if e.kind != "commit":
            continue
        where = dict(
            data_epoch=e.data_epoch, shard_id=e.shard_id, lease_id=e.lease_id, start=e.start,
            end=e.end,
        )  # fmt: skip
        if e.round < 0 or not e.digest:
            unknown += 1
            out.append(Finding("commit_without_lineage", "the commit names no round", **where))
        elif (e.round, e.digest) in links:
            on += 1
        elif e.round < first:
            before += 1
        elif e.round in digest_of:
            out.append(
                Finding(
                    "commit_on_abandoned_lineage", f"round {e.round} is {digest_of[e.round]}"
                    f" on the exported lineage, the commit rode in {e.digest}", **where,
                )
            )  # fmt: skip
        else:
            out.append(
                Finding(
                    "commit_off_lineage", f"round {e.round} ({e.digest}) is not on the"
                    f" exported lineage (rounds {first}..{head})", **where,
                )
            )  # fmt: skip
    summary = {
        "chain_rounds": [first, head],
        "chain_length": len(chain),
        "commits_on_lineage": on,
        "commits_before_chain": before,
        "commits_without_lineage": unknown,
    }
    return summary, out
