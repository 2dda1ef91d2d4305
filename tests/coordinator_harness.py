"""Test-only data for the coordinator tests: a small dataset, a run config over it
(written with swarmlab's TOML writer), and the real SQLite store with its transactions
counted. Processes, waits and the audit are swarmlab's."""

from __future__ import annotations

from pathlib import Path

from coordinator.journal import Batch
from coordinator.store import SQLiteStore
from swarmlab.configs import write_toml

SHARD_TOKENS = 2048  # tokens per shard in the test dataset


def small_dataset(tmp: Path) -> Path:
    d = tmp / "data"
    if not d.exists():
        d.mkdir()
        text = "".join(
            f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(700)
        )
        (d / "a.txt").write_text(text)
    return d


def write_config(tmp: Path, name: str = "run.toml", **extra: object) -> Path:
    """A run config over `small_dataset` with fast heartbeats, leases and sweeps;
    `extra` adds or overrides keys."""
    values: dict[str, object] = {
        "run_id": "test-run",
        "dataset": str(small_dataset(tmp)),
        "shard_tokens": SHARD_TOKENS,
        "heartbeat_interval_s": 0.5,
        "lease_ttl_s": 3.0,
        "sweep_interval_s": 0.2,
        "sync": "normal",
        "min_grant_tokens": 16,
    }
    return write_toml(tmp / name, values | extra)


class CountingStore(SQLiteStore):
    """The real SQLite store (`sync="normal"`), counting its transactions."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, sync="normal")
        self.writes = 0  # committed transactions

    def write(self, batch: Batch) -> None:
        super().write(batch)
        self.writes += 1
