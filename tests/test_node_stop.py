"""A node asked to stop at any moment of its life exits 0: while it imports (before trio,
torch or the node's modules have loaded), and after it has joined but before it has built
its stage or trained. The first moment is found without guessing at times: `agora-node`
catches SIGTERM only once its stop handler is installed, which /proc shows (SigCgt).
Earlier still, while the interpreter starts, only a launcher can keep the stop: swarmlab
starts nodes with SIGINT and SIGTERM blocked (`spawn(hold_stop_signals=True)`), and a
SIGINT sent the moment the process exists is then kept too."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from coordinator_harness import write_config

from swarmlab.coordinator import start_coordinator
from swarmlab.procs import REPO, child_env, spawn

EXIT_DEADLINE_S = 120.0  # a drained node leaves well within this on a loaded box


def _node(tmp: Path, coordinator: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "node.main", "--coordinator", coordinator, "--device", "cpu",
         "--outer-every-steps", "0", "--identity", str(tmp / "node.key"),
         "--events", str(tmp / "events.jsonl"), "--log-level", "INFO"],
        env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def _events(tmp: Path) -> list[str]:
    path = tmp / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["event"] for line in path.read_text().splitlines() if line]


def _wait(what: str, ready: object, proc: subprocess.Popen[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():  # type: ignore[operator]
        if proc.poll() is not None:
            raise AssertionError(f"node exited {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"node not {what} after {timeout_s:.0f}s")
        time.sleep(0.005)


@pytest.mark.parametrize("moment", ["importing", "joined"])
def test_a_node_stopped_at_any_moment_exits_cleanly(tmp_path: Path, moment: str) -> None:
    coord = start_coordinator(tmp_path, config=write_config(tmp_path), db=tmp_path / "c.sqlite")
    try:
        node = _node(tmp_path, coord.address)
        try:
            _wait("handling SIGTERM", lambda: _catches_sigterm(node.pid), node, 60.0)
            if moment == "joined":
                _wait("joined", lambda: "joined" in _events(tmp_path), node, 120.0)
            node.send_signal(signal.SIGINT)
            out, _ = node.communicate(timeout=EXIT_DEADLINE_S)
        finally:
            if node.poll() is None:
                node.kill()
                node.wait(10)
    finally:
        coord.stop()
    assert node.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    events = _events(tmp_path)
    if moment == "joined":
        assert "left" in events, events  # it left the run instead of lapsing
    else:
        assert "SIGINT during start-up" in out, out[-3000:]


def test_a_node_stopped_as_it_is_launched_exits_cleanly_when_its_launcher_holds_the_stop(
    tmp_path: Path,
) -> None:
    """SIGINT right after the process is created, before Python has even imported the
    node's module: held (blocked) by the launcher, the stop waits for the node's handler
    and the node exits 0 before joining; not held, it kills the interpreter (the control)."""
    args = ["-m", "node.main", "--coordinator", "127.0.0.1:9", "--device", "cpu",
            "--identity", str(tmp_path / "node.key")]  # fmt: skip
    codes = {}
    for held in (True, False):
        log = tmp_path / f"held-{held}.log"
        node = spawn(log, args, cwd=REPO, hold_stop_signals=held)
        try:
            node.send_signal(signal.SIGINT)
            codes[held] = node.wait(timeout=EXIT_DEADLINE_S)
        finally:
            if node.poll() is None:
                node.kill()
                node.wait(10)
        if held:
            out = log.read_text(errors="replace")
            assert codes[held] == 0, out[-3000:]
            assert "SIGINT during start-up" in out and "Traceback" not in out, out[-3000:]
    assert codes[False] != 0, codes  # killed by the signal, or a KeyboardInterrupt
