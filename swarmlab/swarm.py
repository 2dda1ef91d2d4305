"""A local swarm of real processes: one coordinator and any number of nodes on loopback.

`LocalSwarm` owns a work directory and everything in it: the run config (`run.toml`),
the coordinator's database, and per process a log (`NAME.log`), an identity
(`NAME.key`) and, for nodes, the structured event file (`NAME.events.jsonl`, read with
`events`) and, with `checkpoints`, the stage checkpoints (`checkpoints/NAME/`). Every process is a fresh interpreter; ports are chosen by the OS. Nodes serve
Prometheus metrics, which is where the swarm reads loss and tokens from, as an operator
would. Used by `agora demo`, `agora chaos`, the multi-process tests and the benchmarks.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from node.coordinator_client import CoordinatorClient
from node.events import read_events
from protocol.control import StatusReply
from protocol.identity import NodeKey
from protocol.pinning import parse_address
from swarmlab.configs import write_toml
from swarmlab.coordinator import AuditResult, CoordinatorProc, audit, start_coordinator
from swarmlab.procs import Proc, free_port, spawn, wait_for

T = TypeVar("T")
EVENTS_SUFFIX = ".events.jsonl"  # a node's event file in the work directory: NAME + this

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEinfINFNa]+)$")


@dataclass
class LocalSwarm:
    workdir: Path
    preset: str = "tiny"  # model preset
    stages: int = 2  # pipeline stages
    codec: str = "subspace_int4"  # boundary codec
    run_config: dict[str, Any] = field(default_factory=dict)  # extra/overriding run.toml keys
    coordinator_args: list[str] = field(default_factory=list)  # extra agora-coordinator flags
    node_args: list[str] = field(default_factory=list)  # extra agora-node flags
    metrics: bool = False  # the coordinator serves Prometheus (`coordinator.metrics_port`)
    checkpoints: bool = False  # each node writes stage checkpoints to `checkpoint_root/NAME`
    coordinator: CoordinatorProc | None = None
    nodes: dict[str, Proc] = field(default_factory=dict)
    address: str = ""  # HOST:PORT of the coordinator

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()  # children run with it as their cwd
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.db = self.workdir / "coordinator.sqlite"
        self._port = 0

    @property
    def checkpoint_root(self) -> Path:
        """With `checkpoints`: node NAME's `--checkpoint-dir` is `checkpoint_root/NAME`."""
        return self.workdir / "checkpoints"

    def write_run_config(self) -> Path:
        """`run.toml`: the swarm's preset, stages and codec, fast heartbeats and leases,
        then `run_config`."""
        values: dict[str, Any] = {
            "run_id": "local-swarm",
            "model_preset": self.preset,
            "n_stages": self.stages,
            "codec": self.codec,
            "heartbeat_interval_s": 1.0,
            "lease_ttl_s": 10.0,
        }
        return write_toml(self.workdir / "run.toml", values | self.run_config)

    def write_node_config(self, name: str = "node", **values: Any) -> Path:
        """`NAME.toml` in the work directory with a `[node]` table of `values`, for
        `--config`."""
        return write_toml(self.workdir / f"{name}.toml", {"node": values})

    def start_coordinator(self, timeout_s: float = 60.0) -> str:
        """Start (or restart, on the same port and database) the coordinator; returns its
        pinned address, HOST:PORT#sha256:HEX (the certificate persists beside the database,
        so a restart keeps the pin)."""
        self.coordinator = start_coordinator(
            self.workdir,
            config=self.write_run_config(),
            db=self.db,
            args=self.coordinator_args,
            port=self._port,
            metrics=self.metrics,
            timeout_s=timeout_s,
        )
        self._port = self.coordinator.port
        self.address = self.coordinator.address
        return self.address

    def add_node(self, name: str, stage: int | None = None, *extra: str) -> Proc:
        """Start `agora-node NAME` against the coordinator, with its identity, metrics
        port and event file in the work directory (and, with `checkpoints`, its checkpoint
        directory)."""
        metrics_port = free_port()
        args = [
            "-m", "node.main",
            "--coordinator", self.address,
            "--identity", str(self.workdir / f"{name}.key"),
            "--metrics-port", str(metrics_port),
            "--events", str(self.events_path(name)),
            *(["--stage", str(stage)] if stage is not None else []),
            *(["--checkpoint-dir", str(self.checkpoint_root / name)] if self.checkpoints else []),
            *self.node_args, *extra,
        ]  # fmt: skip
        log = self.workdir / f"{name}.log"
        # held: a stop sent while it starts (a drain right after a join) is kept, not fatal
        popen = spawn(log, args, cwd=self.workdir, hold_stop_signals=True)
        proc = Proc(name, popen, log, metrics_port, stage)
        self.nodes[name] = proc
        return proc

    def events_path(self, name: str) -> Path:
        return self.workdir / f"{name}{EVENTS_SUFFIX}"

    def events(self, name: str, event: str | None = None) -> list[dict[str, Any]]:
        """The structured events node `name` has written so far (`node.events`),
        optionally only those named `event`."""
        return read_events(self.events_path(name), event)

    def status(self, timeout_s: float = 10.0) -> StatusReply:
        address = parse_address(self.address)

        async def ask() -> StatusReply:
            with trio.fail_after(timeout_s):
                async with CoordinatorClient.to(address, NodeKey.generate()) as client:
                    return await client.status()

        return trio.run(ask)

    def scrape(self, name: str, timeout_s: float = 2.0) -> dict[str, float]:
        """A node's Prometheus metrics as {name{labels}: value}; {} if unreachable."""
        return scrape_metrics(f"127.0.0.1:{self.nodes[name].metrics_port}", timeout_s)

    def audit(self, json_out: Path | None = None) -> AuditResult:
        """`agora audit` of the coordinator's database (stop the coordinator first)."""
        return audit(self.db, json_out)

    def tails(self, lines: int = 15) -> str:
        procs = [*self.nodes.values(), *([self.coordinator] if self.coordinator else [])]
        return "\n".join(f"--- {p.name}:\n{p.tail(lines)}" for p in procs)

    def wait_for(
        self, predicate: Callable[[], T], what: str, timeout_s: float, poll_s: float = 0.5
    ) -> T:
        """`swarmlab.procs.wait_for`, with every process's log tail in the TimeoutError."""
        return wait_for(predicate, what, timeout_s, poll_s=poll_s, detail=self.tails)

    def stop_node(self, name: str, timeout_s: float = 60.0) -> int:
        """Ctrl-C a node and wait for its clean exit; SIGKILL past the timeout."""
        proc = self.nodes[name]
        proc.signal(signal.SIGINT)
        try:
            return proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
            proc.popen.wait(10)
            return -9

    def stop_nodes(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Ctrl-C every node and wait for the drains, SIGKILL past the timeout: stage 0
        first, then the rest. Stage 0 holds the data: its drain finishes the micro-batches
        it has in the pipeline, which needs the later stages still serving (stopped all at
        once, they leave within a second or two and that work is lost, its leases
        released uncommitted)."""
        codes: dict[str, int] = {}
        deadline = time.monotonic() + timeout_s
        first = {n for n in self.nodes if self.stage_of(n) == 0}
        for wave in (first, set(self.nodes) - first):
            for name in wave:
                self.nodes[name].signal(signal.SIGINT)
            for name in sorted(wave):
                proc = self.nodes[name]
                try:
                    codes[name] = proc.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.signal(signal.SIGKILL)
                    codes[name] = proc.popen.wait(10)
        return codes

    def stage_of(self, name: str) -> int | None:
        """The stage node `name` last joined (its `joined` events), else the one it was
        started on, else None."""
        joined = self.events(name, "joined")
        return int(joined[-1]["stage"]) if joined else self.nodes[name].stage

    def stop_coordinator(self, timeout_s: float = 30.0) -> dict[str, int]:
        if self.coordinator is None or not self.coordinator.alive():
            return {}
        self.coordinator.signal(signal.SIGINT)
        try:
            return {"coordinator": self.coordinator.popen.wait(timeout_s)}
        except subprocess.TimeoutExpired:
            self.coordinator.signal(signal.SIGKILL)
            return {"coordinator": self.coordinator.popen.wait(10)}

    def stop(self, timeout_s: float = 60.0) -> dict[str, int]:
        """Drain every node, then stop the coordinator; returns exit codes."""
        return self.stop_nodes(timeout_s) | self.stop_coordinator()

    def kill_all(self) -> None:
        for proc in [*self.nodes.values(), *([self.coordinator] if self.coordinator else [])]:
            if proc.alive():
                proc.signal(signal.SIGCONT)
                proc.signal(signal.SIGKILL)
                proc.popen.wait(10)


def scrape_metrics(address: str, timeout_s: float = 2.0) -> dict[str, float]:
    """Prometheus text from http://ADDRESS/metrics as {name{labels}: value}; {} if
    unreachable."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out
