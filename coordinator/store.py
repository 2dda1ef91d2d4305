"""The durable store: coordinator state written through to SQLite in WAL mode.

`Store` is the small interface the server depends on (tests inject faults through it);
`SQLiteStore` is the embedded default. One `write(batch)` is one transaction: the
group commit of everything the event loop changed since the previous write. The audit
table is append-only; nothing ever updates or deletes its rows. Renewals are never
written (liveness is soft state): the `expires_at` columns hold each row's expiry as of
its last write, and a restarted coordinator grants live peers and leases a grace period.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any, Protocol

from coordinator.journal import AuditEvent, Batch

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS shards (
    shard_id INTEGER PRIMARY KEY, tokens INTEGER NOT NULL, committed INTEGER NOT NULL,
    epoch INTEGER NOT NULL, state TEXT NOT NULL, lease_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id INTEGER PRIMARY KEY, shard_id INTEGER NOT NULL, holder TEXT NOT NULL,
    epoch INTEGER NOT NULL, data_epoch INTEGER NOT NULL, committed INTEGER NOT NULL,
    lim INTEGER NOT NULL, shard_tokens INTEGER NOT NULL, expires_at REAL NOT NULL,
    state TEXT NOT NULL, last_start INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases (state);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, public_key BLOB NOT NULL, stage INTEGER NOT NULL,
    addrs TEXT NOT NULL, device TEXT NOT NULL, throughput REAL NOT NULL, deadline REAL,
    metrics_host TEXT, metrics_port INTEGER, fixed_stage INTEGER NOT NULL,
    joined_at REAL NOT NULL, expires_at REAL NOT NULL, state TEXT NOT NULL,
    drain INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS peers_state ON peers (state);
CREATE TABLE IF NOT EXISTS membership_log (
    version INTEGER PRIMARY KEY, peer_id TEXT NOT NULL, change TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, data_epoch INTEGER NOT NULL,
    kind TEXT NOT NULL, shard_id INTEGER NOT NULL, lease_id INTEGER NOT NULL,
    holder TEXT NOT NULL, epoch INTEGER NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, stage INTEGER NOT NULL DEFAULT -1,
    round INTEGER NOT NULL DEFAULT -1, digest TEXT NOT NULL DEFAULT '');
"""
# Columns added to the audit table after its first release; `migrate` adds them to an
# older database (its rows read as "lineage not known").
AUDIT_ADDED = (
    ("stage", "INTEGER NOT NULL DEFAULT -1"),
    ("round", "INTEGER NOT NULL DEFAULT -1"),
    ("digest", "TEXT NOT NULL DEFAULT ''"),
)
AUDIT_COLUMNS = 'ts, data_epoch, kind, shard_id, lease_id, holder, epoch, start, "end"'


MLOG_KEEP = 100_000  # membership changes loaded at start (deltas older than that get a full view)
RECENT_LEASES = 10_000  # finished leases loaded at start (for idempotent retries)


@dataclasses.dataclass(slots=True)
class Snapshot:
    meta: dict[str, str]
    shards: list[tuple[Any, ...]]
    leases: list[tuple[Any, ...]]
    peers: list[tuple[Any, ...]]
    mlog: list[tuple[int, str, str]]


class Store(Protocol):
    def load(self) -> Snapshot: ...

    def write(self, batch: Batch) -> None: ...

    def close(self) -> None: ...


def connect(path: Path | str, *, sync: str = "full") -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


class SQLiteStore:
    """SQLite in WAL mode. `sync="full"` fsyncs every transaction (power-loss safe);
    `"normal"` survives a killed process but not a power cut."""

    def __init__(self, path: Path | str, *, sync: str = "full") -> None:
        if sync not in ("full", "normal"):
            raise ValueError(f"sync must be 'full' or 'normal', not {sync!r}")
        self.path = Path(path)
        self.conn = connect(self.path, sync=sync)
        self.conn.executescript(SCHEMA)
        migrate(self.conn)

    def load(self) -> Snapshot:
        c = self.conn
        meta = {k: v for k, v in c.execute("SELECT key, value FROM meta")}
        shards = c.execute("SELECT * FROM shards ORDER BY shard_id").fetchall()
        leases = c.execute(
            "SELECT * FROM leases WHERE state = 'active' OR lease_id > ("
            "SELECT COALESCE(MAX(lease_id), 0) - ? FROM leases) ORDER BY lease_id",
            (RECENT_LEASES,),
        ).fetchall()
        peers = c.execute("SELECT * FROM peers WHERE state IN ('live', 'banned')").fetchall()
        mlog = c.execute(
            "SELECT version, peer_id, change FROM membership_log ORDER BY version DESC LIMIT ?",
            (MLOG_KEEP,),
        ).fetchall()
        mlog.reverse()
        return Snapshot(meta=meta, shards=shards, leases=leases, peers=peers, mlog=mlog)

    def write(self, batch: Batch) -> None:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            if batch.meta:
                c.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", batch.meta)
            if batch.shards:
                c.executemany("INSERT OR REPLACE INTO shards VALUES (?,?,?,?,?,?)", batch.shards)
            if batch.leases:
                c.executemany(
                    "INSERT OR REPLACE INTO leases VALUES (?,?,?,?,?,?,?,?,?,?,?)", batch.leases
                )
            if batch.peers:
                c.executemany(
                    "INSERT OR REPLACE INTO peers VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    batch.peers,
                )
            if batch.mlog:
                c.executemany("INSERT OR REPLACE INTO membership_log VALUES (?,?,?)", batch.mlog)
            if batch.audit:
                c.executemany(
                    f"INSERT INTO audit ({AUDIT_COLUMNS}, stage, round, digest)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    [dataclasses.astuple(e) for e in batch.audit],
                )
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.conn.close()


def migrate(conn: sqlite3.Connection) -> None:
    """Add the audit columns an older database lacks (idempotent)."""
    have = _columns(conn, "audit")
    for name, decl in AUDIT_ADDED:
        if name not in have:
            conn.execute(f"ALTER TABLE audit ADD COLUMN {name} {decl}")


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {str(r[1]) for r in conn.execute(f"PRAGMA table_info({table})")}


def _audit_select(conn: sqlite3.Connection) -> str:
    """The audit columns to read, with defaults for those an unmigrated file lacks."""
    have = _columns(conn, "audit")
    added = [
        name if name in have else f"{decl.split()[-1]} AS {name}" for name, decl in AUDIT_ADDED
    ]
    return f"{AUDIT_COLUMNS}, {', '.join(added)}"


def read_audit(path: Path | str) -> list[AuditEvent]:
    """Every audit record, in order (read-only; an older file's lineage reads as unknown)."""
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        rows = conn.execute(f"SELECT {_audit_select(conn)} FROM audit ORDER BY seq").fetchall()
    finally:
        conn.close()
    return [AuditEvent(*r) for r in rows]


def read_meta(path: Path | str) -> dict[str, str]:
    """The meta table (read-only)."""
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        return {str(k): str(v) for k, v in conn.execute("SELECT key, value FROM meta")}
    finally:
        conn.close()


def read_peer_states(path: Path | str) -> dict[str, str]:
    """Each recorded peer's state (live, left, dead, banned), by peer id (read-only)."""
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        return {str(k): str(v) for k, v in conn.execute("SELECT peer_id, state FROM peers")}
    finally:
        conn.close()


def read_leases(path: Path | str) -> list[tuple[Any, ...]]:
    """Every lease row (read-only), in lease id order."""
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT * FROM leases ORDER BY lease_id").fetchall()
    finally:
        conn.close()


def read_epoch_events(path: Path | str, min_epoch: int) -> list[AuditEvent]:
    """The `commit` and `epoch` audit records of data epochs >= `min_epoch`, in order."""
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            f"SELECT {_audit_select(conn)}"
            " FROM audit WHERE data_epoch >= ? AND kind IN ('commit', 'epoch') ORDER BY seq",
            (min_epoch,),
        ).fetchall()
    finally:
        conn.close()
    return [AuditEvent(*r) for r in rows]


def read_shard_sizes(path: Path | str) -> dict[int, int]:
    conn = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        return {int(a): int(b) for a, b in conn.execute("SELECT shard_id, tokens FROM shards")}
    finally:
        conn.close()
