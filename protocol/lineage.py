"""A stage's lineage: the chain of global states (outer round, digest) a state descends from.

Every replica's outer process keeps the chain of the state it holds: each state it
steps onto is appended, and adopting another replica's state (a download, a rebase,
a group's canonical state) takes that state's chain with it, so rounds of an abandoned
lineage drop out. The chain travels with the state (hivemind's state sharing, the
outer-process contract), is written into checkpoints and exports, and is what
`agora audit --export` checks stage 0's committed ranges against.

A chain holds at most `MAX_LINEAGE` entries, the newest ones: rounds strictly rising,
digests lowercase hex of at most `MAX_DIGEST_CHARS` characters (`state_digest` makes
them). This module is pure: it validates plain data (msgpack or JSON values) and raises
`ProtocolError`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from protocol.control import MAX_DIGEST_CHARS, digest_problem
from protocol.errors import ProtocolError

MAX_LINEAGE = 2048  # entries kept, the newest (about 45 KiB as msgpack: fits the state metadata)
MAX_ROUND = 2**62  # a sanity bound on an outer round

LINEAGE_FILE = "lineage.json"  # in an export directory, next to model.safetensors
LINEAGE_FORMAT = "agora-export-lineage"

Link = tuple[int, str]  # (outer round, state digest)


def check_lineage(value: Any, where: str = "lineage") -> list[Link]:
    """`value` (a list of [round, digest] pairs) as a chain, or `ProtocolError`."""
    if type(value) is not list or len(value) > MAX_LINEAGE:
        raise ProtocolError(f"{where}: a list of at most {MAX_LINEAGE} [round, digest] pairs")
    out: list[Link] = []
    last = -1
    for item in value:
        if type(item) not in (list, tuple) or len(item) != 2:
            raise ProtocolError(f"{where}: entries are [round, digest] pairs")
        rnd, digest = item
        if type(rnd) is not int or not last < rnd <= MAX_ROUND:
            raise ProtocolError(f"{where}: rounds must be ints rising strictly")
        if type(digest) is not str or not 0 < len(digest) <= MAX_DIGEST_CHARS:
            raise ProtocolError(f"{where}: digests are 1-{MAX_DIGEST_CHARS} characters")
        if digest_problem(digest) is not None:
            raise ProtocolError(f"{where}: digests are lowercase hex")
        out.append((rnd, digest))
        last = rnd
    return out


def extend(chain: list[Link], rnd: int, digest: str) -> list[Link]:
    """`chain` with the state (rnd, digest) appended, cut to the newest `MAX_LINEAGE`;
    a state whose round is not above the chain's head replaces the entries from it on."""
    kept = [link for link in chain if link[0] < rnd]
    kept.append((rnd, digest))
    return kept[-MAX_LINEAGE:]


def to_plain(chain: list[Link]) -> list[list[Any]]:
    return [[r, d] for r, d in chain]


def state_digest(rnd: int, theta_g: memoryview | bytes, m: memoryview | bytes) -> str:
    """The digest naming a stage's global state: blake2b (8 bytes, 16 hex characters) of
    its round (8 bytes, little-endian) and the fp32 bytes of theta_g, then of m."""
    h = hashlib.blake2b(digest_size=8)
    h.update(rnd.to_bytes(8, "little"))
    h.update(theta_g)
    h.update(m)
    return h.hexdigest()
