"""Shared fixtures: every child process a test starts is reaped at the end of the session;
`child_env` for children; `links` for the outer-loop processes a test starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from swarmlab.procs import child_env

if TYPE_CHECKING:
    from node.outer_link import OuterLink

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    kids = [int(x) for x in out.split()]
    return kids + [g for k in kids for g in _children(k)]


@pytest.fixture(scope="session", autouse=True)
def reap_children() -> Iterator[None]:
    """Kill any process a test left behind (including grandchildren)."""
    yield
    for pid in _children(os.getpid()):
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(name="child_env")
def child_env_fixture() -> dict[str, str]:
    """`swarmlab.procs.child_env()`: one torch thread each, this checkout on the path."""
    return child_env()


@pytest.fixture
def links(child_env: dict[str, str]) -> Iterator[list[OuterLink]]:
    """Outer-loop processes a test starts (`OuterLink.start`); each is resumed (a test
    may have stopped it) and closed at the end."""
    made: list[OuterLink] = []
    yield made
    for link in made:
        try:
            os.killpg(link.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        link.close(timeout=10.0)
