"""The node's key file: a 32-byte ed25519 seed, created with mode 0600 on first use.

One key is the node's libp2p peer id and signs its coordinator requests; the launcher
has a key of its own in the same format.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from protocol.identity import PRIVATE_KEY_SIZE, NodeKey

log = logging.getLogger(__name__)


def load_or_create_key(path: Path) -> NodeKey:
    """The key at `path`; a new one is generated and written there if none exists."""
    path = Path(path).expanduser()
    if path.exists():
        seed = path.read_bytes()
        if len(seed) != PRIVATE_KEY_SIZE:
            raise ValueError(f"identity file {path} must hold a 32-byte ed25519 seed")
        return NodeKey(seed)
    key = NodeKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.seed)
    log.info("created identity %s (peer id %s)", path, key.peer_id)
    return key


def read_token_file(path: Path) -> str:
    """The first line of `path`, stripped; `ValueError` if it holds no token."""
    lines = path.expanduser().read_text().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"{path} holds no token")
    return token
