"""The outer process's start on an OS-chosen port: a port taken before its daemon bound it
is tried again, a fixed port that is taken is the user's error at once."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from node.outer.lifecycle import PORT_TRIES, port_retried


@pytest.fixture
def taken() -> Iterator[int]:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    yield held.getsockname()[1]
    held.close()


def test_a_taken_os_chosen_port_is_tried_again_and_a_fixed_one_is_not(taken: int) -> None:
    tries: list[socket.socket] = []

    def start(free_after: int) -> socket.socket:
        s = socket.socket()
        tries.append(s)
        s.bind(("127.0.0.1", taken if len(tries) <= free_after else 0))
        return s

    try:
        got = port_retried(lambda: start(PORT_TRIES - 1), os_chosen=True)
        assert len(tries) == PORT_TRIES and got.getsockname()[1] != taken
        _close(tries)
        with pytest.raises(OSError, match="in use"):
            port_retried(lambda: start(PORT_TRIES), os_chosen=True)  # never free: gives up
        assert len(tries) == PORT_TRIES
        _close(tries)
        with pytest.raises(OSError, match="in use"):
            port_retried(lambda: start(PORT_TRIES), os_chosen=False)
        assert len(tries) == 1
    finally:
        _close(tries)


def _close(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()
    socks.clear()
