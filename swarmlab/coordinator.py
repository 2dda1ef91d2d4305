"""A coordinator as a child process, and the lease audit of its database.

`start_coordinator` runs `python -m coordinator.main` on loopback with a port file
(port 0: the OS chooses, and the launcher reads the bound port back) and an events file,
whose `listening` event gives the certificate fingerprint clients pin; optionally with
Prometheus metrics on a port chosen here. It returns a `CoordinatorProc` once the port
is bound: its `address` (`127.0.0.1:PORT#sha256:HEX`) is what nodes are given. `audit(db)` runs `agora audit --json` on a database and returns the parsed
report. Both are torch-free.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.pinning import CoordinatorAddress
from swarmlab.procs import REPO, Proc, child_env, free_port, spawn, wait_for


@dataclass
class CoordinatorProc(Proc):
    """A running coordinator: `port` is its bound control port, `fingerprint` the pin of
    its TLS certificate (`sha256:<hex>`, from its `listening` event)."""

    port: int = 0
    host: str = "127.0.0.1"
    fingerprint: str | None = None
    events: Path | None = None  # its structured events (JSON lines)

    @property
    def address(self) -> str:
        """`HOST:PORT#sha256:HEX`, the pinned address nodes and tools are given."""
        return str(self.pinned)

    @property
    def pinned(self) -> CoordinatorAddress:
        return CoordinatorAddress(host=self.host, port=self.port, pin=self.fingerprint)

    def listening(self) -> dict[str, Any]:
        """The last `listening` event of this coordinator (each start appends one)."""
        found: dict[str, Any] = {}
        if self.events is not None and self.events.exists():
            for line in self.events.read_text(encoding="utf-8").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if isinstance(event, dict) and event.get("event") == "listening":
                    found = event
        return found

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
        """Send `sig` and wait for the exit code."""
        self.signal(sig)
        return self.popen.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a clean shutdown) and its exit code; SIGKILL past the timeout."""
        if not self.alive():
            return int(self.popen.returncode)
        try:
            return self.kill(signal.SIGTERM, timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill(signal.SIGKILL, 10)


def start_coordinator(
    workdir: Path,
    *,
    config: Path | None,
    db: Path,
    args: list[str] | tuple[str, ...] = (),
    port: int = 0,
    metrics: bool = False,
    name: str = "coordinator",
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> CoordinatorProc:
    """Start a coordinator in `workdir` (its log is `workdir/<name>.log`) and wait until
    it has bound `port` (0: OS-chosen). With `metrics`, it serves Prometheus on a port
    chosen here (`metrics_port`). Raises RuntimeError if it exits first, TimeoutError
    past `timeout_s`."""
    workdir = Path(workdir).resolve()
    port_file = workdir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    events = workdir / f"{name}.events.jsonl"
    events.unlink(missing_ok=True)
    metrics_port = free_port() if metrics else None
    argv = [
        "-m", "coordinator.main",
        "--host", "127.0.0.1", "--port", str(port),
        "--port-file", str(port_file),
        "--db", str(db),
        "--events", str(events),
        *(["--config", str(config)] if config is not None else []),
        *(["--metrics-port", str(metrics_port)] if metrics_port is not None else []),
        *args,
    ]  # fmt: skip
    log = workdir / f"{name}.log"
    proc = CoordinatorProc(name, spawn(log, argv, cwd=workdir, env=env), log, metrics_port)
    proc.events = events

    def bound() -> str:
        if not proc.alive():
            raise RuntimeError(f"{name} exited with {proc.popen.returncode}:\n{proc.tail(40)}")
        return port_file.read_text().strip() if port_file.exists() else ""

    try:
        port_text = wait_for(
            bound, f"{name} to bind a port", timeout_s, poll_s=0.01, detail=proc.tail
        )
    except TimeoutError:
        proc.signal(signal.SIGKILL)
        raise
    proc.port = int(port_text)
    event = proc.listening()  # written before the port file
    if int(event.get("port", -1)) != proc.port:
        proc.signal(signal.SIGKILL)
        raise RuntimeError(f"{name} wrote no listening event for port {proc.port} to {events}")
    proc.fingerprint = str(event["fingerprint"])
    return proc


@dataclass
class AuditResult:
    """`agora audit` of one database: its exit code (0 clean, 1 lost or duplicated data),
    printed summary and per-data-epoch reports (`coordinator.audit.EpochReport` as dicts)."""

    exit_code: int
    stdout: str
    epochs: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)  # the whole `--json` report

    @property
    def clean(self) -> bool:
        return self.exit_code == 0

    @property
    def lost_ranges(self) -> int:
        return sum(len(e["lost"]) for e in self.epochs)

    @property
    def duplicated_ranges(self) -> int:
        return sum(len(e["duplicated"]) for e in self.epochs)

    @property
    def committed_tokens(self) -> int:
        return sum(int(e["committed_tokens"]) for e in self.epochs)

    def summary(self) -> dict[str, Any]:
        """The totals, for a JSON report."""
        return {
            "exit": self.exit_code,
            "lost_ranges": self.lost_ranges,
            "duplicated_ranges": self.duplicated_ranges,
            "committed_tokens": self.committed_tokens,
            "epochs": len(self.epochs),
            "mode": self.report.get("mode"),
            "trained_twice_tokens": self.report.get("trained_twice_tokens"),
            "findings": [f["name"] for f in self.report.get("findings", [])][:20],
            "summary": self.stdout.strip().splitlines()[-5:],
        }


def audit(db: Path, json_out: Path | None = None, timeout_s: float = 300.0) -> AuditResult:
    """Run `agora audit --db DB --json FILE` and parse it. The JSON report is kept at
    `json_out` if given. Raises RuntimeError if the audit itself fails (exit 2)."""
    with tempfile.TemporaryDirectory(prefix="agora-audit-") as tmp:
        out = Path(json_out) if json_out is not None else Path(tmp) / "audit.json"
        proc = subprocess.run(
            [sys.executable, "-m", "coordinator.audit", "--db", str(db), "--json", str(out)],
            env=child_env(), capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
        )  # fmt: skip
        if proc.returncode not in (0, 1) or not out.exists():
            raise RuntimeError(
                f"agora audit of {db} failed ({proc.returncode}): "
                f"{proc.stdout[-1000:]}{proc.stderr[-2000:]}"
            )
        report = json.loads(out.read_text())
        return AuditResult(proc.returncode, proc.stdout, report["epochs"], report)
