"""Child processes on one machine: how they are started, found and waited for.

`child_env` is the environment every child gets (one torch thread, this checkout on the
path), `spawn` starts `python ARGS` with its output in a log file (optionally with its stop
signals held until the child handles them), `Proc` is the handle,
`free_port` asks the OS for a port and `wait_for` polls with a deadline. No torch, trio
or node imports: the coordinator tests and `agora audit` use these on a lean install.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent  # the checkout children import from

T = TypeVar("T")


def workdir_path(text: str) -> Path:
    """An argparse type for --workdir: absolute, since children run with their own cwd
    and are handed paths of files written there."""
    return Path(text).expanduser().resolve()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def child_env(threads: int = 1) -> dict[str, str]:
    """The environment of a child process: `threads` torch/BLAS threads, unbuffered
    output, and this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        AGORA_TORCH_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def wait_for(
    predicate: Callable[[], T],
    what: str,
    timeout_s: float = 30.0,
    *,
    poll_s: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy, and return that. Past
    `timeout_s` raise TimeoutError naming `what` (plus `detail()`, e.g. log tails)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}{extra}")
        time.sleep(poll_s)
    return value


@dataclass
class Proc:
    """A child process and its log file (stdout and stderr together)."""

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

    def output(self) -> str:
        """Everything the process has written so far."""
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.output().splitlines()[-lines:])


STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextmanager
def _blocked(signals: frozenset[signal.Signals]) -> Iterator[None]:
    """Block `signals` in this thread meanwhile (a child started now inherits the mask)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def spawn(
    log: Path,
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    hold_stop_signals: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `python ARGS` in `cwd`, appending its output to `log`. With
    `hold_stop_signals` the child starts with SIGINT and SIGTERM blocked: one sent before
    its own handler is up (while the interpreter starts or imports) stays pending instead
    of killing it, and is delivered when the child unblocks them (`agora-node` does once
    its stop handler is installed; a child that never does cannot be stopped by them)."""
    with log.open("ab") as fh, _blocked(STOP_SIGNALS if hold_stop_signals else frozenset()):
        return subprocess.Popen(
            [sys.executable, *args],
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env() if env is None else env,
            cwd=cwd,
        )
