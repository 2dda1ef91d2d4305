"""The outer process's dealings with the operating system: the node's key (and a private
file of it for the p2p daemon), starting its DHT again when the port the OS chose was
taken before the daemon bound it, and exiting at once with the whole process group when
the stage process that owns it has died."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NoReturn, TypeVar

from protocol.identity import LIBP2P_ED25519_PRIVATE, PRIVATE_KEY_SIZE, NodeKey

log = logging.getLogger(__name__)

T = TypeVar("T")
# starts of a DHT on an OS-chosen port, while its daemon finds that port taken (count)
PORT_TRIES = 3


def node_key(identity: bytes) -> NodeKey:
    """The key an `Init.identity` holds (an ed25519 libp2p private key: its head, the
    seed, the public key), or a fresh one for b"" (a test's outer process)."""
    if not identity:
        return NodeKey.generate()
    head = len(LIBP2P_ED25519_PRIVATE)
    return NodeKey(identity[head : head + PRIVATE_KEY_SIZE])


@contextlib.contextmanager
def identity_file(identity: bytes) -> Iterator[str | None]:
    """The node's key in a file only this user can read, for the p2p daemon's `-id`
    (which reads it at start), removed afterwards; None (a fresh key) for b""."""
    if not identity:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="agora-outer-id-") as tmp:  # mode 0700
        path = Path(tmp) / "key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity)
        yield str(path)


def port_retried(start: Callable[[], T], os_chosen: bool) -> T:
    """`start()`, again (up to `PORT_TRIES` in all) while it fails because the p2p daemon
    found its listen port in use: seen once in a loaded swarm with port 0 ("listen tcp4
    0.0.0.0:56111: bind: address already in use"), which killed the node at start. A
    fixed port (`os_chosen` False) that is taken stays an error the user must see."""
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return start()
        except Exception as exc:
            if (
                not os_chosen
                or "address already in use" not in str(exc).lower()
                or attempt == PORT_TRIES
            ):
                raise
            log.warning("outer process: the DHT's port was taken (%s); starting it again", exc)
    raise AssertionError("unreachable")


def vanish(paths: Iterable[str]) -> NoReturn:
    """Unlink the shared buffers `paths` and exit at once with this process's group (its
    hivemind DHT and averager processes and their p2p daemons; `node.outer_link` makes
    it a group leader), for a stage process that died: hivemind's graceful shutdown
    would spend about half a CPU-second on a host whose other nodes are taking over the
    dead one's work. Anywhere but a group leader it exits this process alone."""
    for path in paths:
        Path(path).unlink(missing_ok=True)
    log.warning("outer process: the stage process is gone; exiting with its helpers")
    logging.shutdown()
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)
