"""`agora audit`: a real run's database and export audit clean, and every fault planted
in a copy of them is caught (exit 1) and named.

The run (once per module): a coordinator, one stage-0 and one stage-1 node with DiLoCo
outer rounds (commits ride in applied rounds) and checkpoints, stopped cleanly, then
`agora export` from the checkpoints. Each planted fault edits a copy of the database
with plain SQL, as a bug or a tampering would. A second, smaller fixture runs the real
lease book through a whole data epoch into a real SQLite file for the full-epoch mode,
and an older database without the lineage columns is read and migrated.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.audit import main as audit_main
from coordinator.journal import Journal
from coordinator.leases import LeaseBook, Shard
from coordinator.store import SQLiteStore, read_audit
from node.export_assembly import export_checkpoints
from swarmlab.swarm import LocalSwarm

Plant = Callable[[sqlite3.Connection, list[list[Any]]], None]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(database, export directory) of a short real run with outer rounds."""
    tmp = tmp_path_factory.mktemp("audit-run")
    swarm = LocalSwarm(workdir=tmp / "run", preset="tiny")
    toml = swarm.write_node_config(
        outer_every_steps=3, inner_batch_tokens=2048, outer_matchmaking_s=2.0
    )
    swarm.node_args = ["--config", str(toml)]
    ckpt = tmp / "ckpt"
    try:
        swarm.start_coordinator()
        for name, stage in (("a0", 0), ("a1", 1)):
            swarm.add_node(name, stage, "--checkpoint-dir", str(ckpt / name))
        swarm.wait_for(lambda: swarm.status().committed_tokens >= 8 * 1024, "commits", 420)
        swarm.wait_for(lambda: (ckpt / "a0" / "stage0.safetensors").is_file(), "checkpoint", 120)
        codes = swarm.stop(timeout_s=120)
    finally:
        swarm.kill_all()
    assert codes == {"a0": 0, "a1": 0, "coordinator": 0}, swarm.tails()
    export_checkpoints([ckpt / "a0", ckpt / "a1"], tmp / "export")
    yield swarm.db, tmp / "export"


def _audit(db: Path, export: Path | None, out: Path) -> tuple[int, dict[str, Any]]:
    args = ["--db", str(db), "--json", str(out)]
    code = audit_main(args + (["--export", str(export)] if export else []))
    return code, json.loads(out.read_text())


def _names(report: dict[str, Any]) -> set[str]:
    return {f["name"] for f in report["findings"]}


def test_the_clean_run_audits_clean(run: tuple[Path, Path], tmp_path: Path) -> None:
    db, export = run
    code, report = _audit(db, export, tmp_path / "a.json")
    assert code == 0 and report["findings"] == [], report["findings"]
    assert report["mode"] == "in_progress" and report["manifest_checked"]
    assert report["lost_ranges"] == [] and report["duplicated_ranges"] == []
    assert report["trained_twice_tokens"] == 0
    lineage = report["lineage"]
    assert lineage["commits_on_lineage"] >= 1 and lineage["commits_without_lineage"] == 0
    commits = [e for e in read_audit(db) if e.kind == "commit"]
    assert commits and all(e.stage == 0 and e.round >= 1 and e.digest for e in commits)
    doc = json.loads((export / "lineage.json").read_text())
    assert doc["stages"]["0"]["lineage"][-1] == [
        doc["stages"]["0"]["round"],
        doc["stages"]["0"]["digest"],
    ]


def _commit_rows(c: sqlite3.Connection) -> list[list[Any]]:
    rows = c.execute(
        "SELECT seq, lease_id, start, \"end\", round, digest FROM audit WHERE kind = 'commit'"
        " ORDER BY seq"
    ).fetchall()
    return [list(r) for r in rows]


def _drop_inner_commit(c: sqlite3.Connection, commits: list[list[Any]]) -> None:
    last = {r[1]: r[0] for r in commits}
    seq = next(r[0] for r in commits if last[r[1]] != r[0])  # a commit another follows
    c.execute("DELETE FROM audit WHERE seq = ?", (seq,))


def _duplicate_commit(c: sqlite3.Connection, commits: list[list[Any]]) -> None:
    c.execute(
        "INSERT INTO audit (ts, data_epoch, kind, shard_id, lease_id, holder, epoch, start,"
        ' "end", stage, round, digest) SELECT ts, data_epoch, kind, shard_id, lease_id,'
        ' holder, epoch, start, "end", stage, round, digest FROM audit WHERE seq = ?',
        (commits[0][0],),
    )


def _commit_of_unapplied_round(c: sqlite3.Connection, commits: list[list[Any]]) -> None:
    top = max(r[4] for r in commits)
    c.execute(
        "UPDATE audit SET round = ?, digest = ? WHERE seq = ?",
        (top + 7, "0123456789abcdef", commits[-1][0]),
    )


def _commit_on_abandoned_lineage(c: sqlite3.Connection, commits: list[list[Any]]) -> None:
    flipped = "".join("0" if ch != "0" else "1" for ch in commits[0][5])
    c.execute("UPDATE audit SET digest = ? WHERE seq = ?", (flipped, commits[0][0]))


def _vanished_grant(c: sqlite3.Connection, commits: list[list[Any]]) -> None:
    c.execute("DELETE FROM audit WHERE kind = 'grant' AND lease_id = ?", (commits[0][1],))


def _fenced_zombie_trained(c: sqlite3.Connection, commits: list[list[Any]]) -> None:
    c.execute(
        "INSERT INTO audit (ts, data_epoch, kind, shard_id, lease_id, holder, epoch, start,"
        " \"end\", stage, round, digest) SELECT ts, data_epoch, 'fence', shard_id, lease_id,"
        " 'zombie', epoch - 1, start, \"end\", stage, round, digest FROM audit WHERE seq = ?",
        (commits[0][0],),
    )


def _shard_resized(c: sqlite3.Connection, commits: list[list[Any]]) -> None:
    c.execute(
        "UPDATE shards SET tokens = tokens + 1 WHERE shard_id = (SELECT MIN(shard_id) FROM shards)"
    )


PLANTS: dict[str, tuple[Plant, set[str]]] = {
    "dropped_commit": (_drop_inner_commit, {"lost_range", "commit_out_of_order"}),
    "duplicated_commit": (_duplicate_commit, {"duplicated_range"}),
    "round_not_applied": (_commit_of_unapplied_round, {"commit_off_lineage"}),
    "abandoned_lineage": (_commit_on_abandoned_lineage, {"commit_on_abandoned_lineage"}),
    "vanished_grant": (_vanished_grant, {"vanished_grant"}),
    "trained_twice": (_fenced_zombie_trained, {"trained_twice"}),
    "shard_resized": (_shard_resized, {"shard_mismatch"}),
}


@pytest.mark.parametrize("fault", sorted(PLANTS))
def test_a_planted_fault_is_caught_and_named(
    run: tuple[Path, Path], tmp_path: Path, fault: str
) -> None:
    db, export = run
    copy = tmp_path / "copy.sqlite"
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    dst = sqlite3.connect(copy)
    src.backup(dst)
    src.close()
    plant, expected = PLANTS[fault]
    with dst:
        plant(dst, _commit_rows(dst))
    dst.close()
    code, report = _audit(copy, export, tmp_path / "a.json")
    assert code == 1, report
    assert expected <= _names(report), (fault, _names(report))
    if fault == "trained_twice":
        assert report["trained_twice_tokens"] > 0 and report["duplicated_ranges"] == []


def test_a_whole_data_epoch_audits_clean_in_full_epoch_mode(tmp_path: Path) -> None:
    """The real lease book through one data epoch (a lease expired half-way and re-queued
    on the way) into a real SQLite file: the full-epoch mode, clean; then a lost range."""
    db = tmp_path / "c.sqlite"
    store = SQLiteStore(db, sync="normal")
    journal = Journal()
    book = LeaseBook([Shard(i, 100) for i in range(3)], journal=journal, ttl_s=10.0)
    for s in book.shards.values():
        journal.shards[s.shard_id] = s
    journal.meta["train_shards"] = json.dumps([[i, 100] for i in range(3)])
    now = 0.0
    lease, _ = book.acquire("zombie", now)
    assert lease is not None
    book.commit("zombie", lease.lease_id, lease.epoch, 0, 40, now, (0, 1, "aa"))
    book.expire_due(now + 11)
    while book.data_epoch == 0:
        now += 1
        lease, _ = book.acquire("p", now, max_tokens=30)
        assert lease is not None
        pos = lease.committed
        while pos < lease.limit:
            end = min(pos + 20, lease.limit)
            book.commit("p", lease.lease_id, lease.epoch, pos, end, now, (0, 2, "bb"))
            pos = end
        store.write(journal.take())
    store.write(journal.take())
    store.close()
    code, report = _audit(db, None, tmp_path / "a.json")
    assert code == 0, report["findings"]
    assert report["mode"] == "full_epoch" and report["committed_tokens"] == 300
    with sqlite3.connect(db) as c:
        c.execute(
            "DELETE FROM audit WHERE seq = (SELECT MAX(seq) FROM audit WHERE kind = 'commit')"
        )
    code, report = _audit(db, None, tmp_path / "b.json")
    assert code == 1 and "lost_range" in _names(report)


def test_an_older_database_reads_as_unknown_lineage_and_migrates(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as c:
        c.execute(
            "CREATE TABLE audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL,"
            " data_epoch INTEGER NOT NULL, kind TEXT NOT NULL, shard_id INTEGER NOT NULL,"
            " lease_id INTEGER NOT NULL, holder TEXT NOT NULL, epoch INTEGER NOT NULL,"
            ' start INTEGER NOT NULL, "end" INTEGER NOT NULL)'
        )
        c.execute("INSERT INTO audit VALUES (1, 0.0, 0, 'grant', 0, 1, 'p', 1, 0, 10)")
    (old,) = read_audit(db)
    assert (old.kind, old.stage, old.round, old.digest) == ("grant", -1, -1, "")
    SQLiteStore(db).close()  # opening it for writing adds the columns
    with sqlite3.connect(db) as c:
        cols = {r[1] for r in c.execute("PRAGMA table_info(audit)")}
    assert {"stage", "round", "digest"} <= cols
    assert read_audit(db) == [old]
