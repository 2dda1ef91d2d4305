"""A local swarm of real processes: one coordinator and any number of nodes on loopback.

Used by `agora demo`, the multi-process tests and the benchmarks. Every process is a
fresh interpreter (`python -m ...`) with its own log file in the work directory; ports
are chosen by the OS. Nodes serve Prometheus metrics, which is where the swarm reads
loss and tokens from, as an operator would.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from node.coordinator_client import CoordinatorClient
from protocol.control import StatusReply
from protocol.identity import NodeKey

_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([-+0-9.eEinfINFNa]+)$")


def workdir_path(text: str) -> Path:
    """An argparse type for --workdir: absolute, since children run with their own cwd
    and are handed paths of files written there."""
    return Path(text).expanduser().resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(threads: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        AGORA_TORCH_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    metrics_port: int | None = None
    stage: int | None = None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalSwarm:
    workdir: Path
    preset: str = "tiny"  # model preset
    stages: int = 2  # pipeline stages
    codec: str = "subspace_int4"  # boundary codec
    coordinator_args: list[str] = field(default_factory=list)  # extra agora-coordinator flags
    node_args: list[str] = field(default_factory=list)  # extra agora-node flags
    coordinator: Proc | None = None
    nodes: dict[str, Proc] = field(default_factory=dict)
    address: str = ""  # HOST:PORT of the coordinator

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir).resolve()  # children run with it as their cwd
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.db = self.workdir / "coordinator.sqlite"

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.workdir / f"{name}.log"
        fh = log.open("ab")
        popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(),
            cwd=self.workdir,
        )
        fh.close()
        return popen, log

    def start_coordinator(self, timeout_s: float = 60.0) -> str:
        port_file = self.workdir / "coordinator.port"
        port_file.unlink(missing_ok=True)
        args = [
            "-m", "coordinator.main",
            "--host", "127.0.0.1", "--port", str(self._port or 0),
            "--port-file", str(port_file),
            "--db", str(self.db),
            "--config", str(self._run_toml()),
            *self.coordinator_args,
        ]  # fmt: skip
        popen, log = self._spawn("coordinator", args)
        self.coordinator = Proc("coordinator", popen, log)
        deadline = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if popen.poll() is not None:
                raise RuntimeError(
                    f"coordinator exited with {popen.returncode}:\n{self.coordinator.tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator did not start within {timeout_s}s")
            time.sleep(0.05)
        self._port = int(port_file.read_text().strip())
        self.address = f"127.0.0.1:{self._port}"
        return self.address

    _port: int = 0

    def _run_toml(self) -> Path:
        path = self.workdir / "run.toml"
        path.write_text(
            f'run_id = "local-swarm"\nmodel_preset = "{self.preset}"\n'
            f'n_stages = {self.stages}\ncodec = "{self.codec}"\n'
            f"heartbeat_interval_s = 1.0\nlease_ttl_s = 10.0\n"
        )
        return path

    def add_node(self, name: str, stage: int | None = None, *extra: str) -> Proc:
        metrics_port = free_port()
        args = [
            "-m", "node.main",
            "--coordinator", self.address,
            "--identity", str(self.workdir / f"{name}.key"),
            "--metrics-port", str(metrics_port),
            *(["--stage", str(stage)] if stage is not None else []),
            *self.node_args, *extra,
        ]  # fmt: skip
        popen, log = self._spawn(name, args)
        proc = Proc(name, popen, log, metrics_port, stage)
        self.nodes[name] = proc
        return proc

    def status(self, timeout_s: float = 10.0) -> StatusReply:
        host, port = self.address.rsplit(":", 1)

        async def ask() -> StatusReply:
            with trio.fail_after(timeout_s):
                async with CoordinatorClient(host, int(port), NodeKey.generate()) as client:
                    return await client.status()

        return trio.run(ask)

    def scrape(self, name: str, timeout_s: float = 2.0) -> dict[str, float]:
        """A node's Prometheus metrics as {name{labels}: value}; {} if unreachable."""
        proc = self.nodes[name]
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=timeout_s
            ) as resp:
                text = resp.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            m = _METRIC.match(line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def wait_for(
        self, predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5
    ) -> Any:
        """Poll `predicate` until it returns something truthy, and return that; past
        `timeout_s` raise TimeoutError naming `what`, with every process's log tail."""
        deadline = time.monotonic() + timeout_s
        while not (value := predicate()):
            if time.monotonic() > deadline:
                procs = [*self.nodes.values(), *([self.coordinator] if self.coordinator else [])]
                tails = "\n".join(f"--- {p.name}:\n{p.tail(15)}" for p in procs)
                raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{tails}")
            time.sleep(poll_s)
        return value

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
        """Ctrl-C every node and wait for the drains; SIGKILL past the timeout."""
        codes = {}
        for proc in self.nodes.values():
            proc.signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.nodes.items():
            try:
                codes[name] = proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.signal(signal.SIGKILL)
                codes[name] = proc.popen.wait(10)
        return codes

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
