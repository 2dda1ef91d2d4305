"""The node's event file: one JSON object per line, names from a fixed set, a half-written
last line skipped by readers, and a drain recorded once with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from node.drain import Drain
from node.events import EventLog, read_events


def test_events_are_json_lines_and_readers_skip_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    log = EventLog(path)
    log.emit("joined", peer_id="p", stage=1, n_stages=2, run_id="r")
    log.emit("left", tokens_trained=10, tokens_committed=8)
    with pytest.raises(ValueError, match="unknown event"):
        log.emit("joind")
    log.close()
    with path.open("a") as fh:
        fh.write('{"t": 1, "event": "lef')  # a writer killed mid-line
    assert [e["event"] for e in read_events(path)] == ["joined", "left"]
    assert read_events(path, "left")[0]["tokens_committed"] == 8
    assert read_events(tmp_path / "missing.jsonl") == []
    EventLog(None).emit("left", tokens_trained=0, tokens_committed=0)  # no file: dropped


def test_a_drain_is_recorded_once_with_its_reason(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"

    async def main() -> None:
        drain = Drain(5.0, EventLog(path))
        drain.start("deadline in 40 s")
        drain.start("SIGINT")  # already draining: nothing changes
        assert drain.started and not drain.past_deadline()

    trio.run(main)
    assert [e["reason"] for e in read_events(path, "draining")] == ["deadline in 40 s"]
