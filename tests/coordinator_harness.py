"""Helpers for the multi-process coordinator tests: a small dataset, a coordinator
subprocess on an OS-chosen port, and a trio client factory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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
    values.update(extra)
    lines = []
    for k, v in values.items():
        if isinstance(v, str):
            lines.append(f'{k} = "{v}"')
        elif isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, list):
            lines.append(f"{k} = [{', '.join(repr(x).replace(chr(39), chr(34)) for x in v)}]")
        else:
            lines.append(f"{k} = {v}")
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return path


class Coordinator:
    """A coordinator subprocess; `port` is read from its port file."""

    def __init__(self, tmp: Path, config: Path, db: Path, env: dict[str, str], *args: str):
        self.port_file = tmp / f"port-{time.monotonic_ns()}"
        self.log = open(tmp / f"coord-{time.monotonic_ns()}.log", "w+")
        cmd = [
            sys.executable,
            "-m",
            "coordinator.main",
            "--config",
            str(config),
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            "--db",
            str(db),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"coordinator exited with {self.proc.returncode}: {self.output()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"coordinator did not write its port within 60 s: {self.output()}"
                )
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def kill(self, sig: int = signal.SIGKILL) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            return self.kill(signal.SIGTERM)
        return self.proc.returncode


def audit(db: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.audit", "--db", str(db)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def wait_for(pred, what: str, timeout_s: float = 30.0, step_s: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        out = pred()
        if out:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        time.sleep(step_s)


os.environ.setdefault("OMP_NUM_THREADS", "1")
