"""`RoundBook`: the group rounds an averaging scheme is running, by group id.

A groupmate's push can arrive before this member has registered the round (the handler
waits for it) or after the round ended here: a resend of a push whose reply was lost on
a connection the p2p daemons were replacing. The book remembers the last ended rounds,
with a receipt for each push the round accepted, so a resend is answered at once:
acknowledged when its receipt is held, refused otherwise. Waiting out the timeout for a
round that will never register again held the resending member, and its own round,
until its deadline. Pure asyncio: no hivemind, so it is tested on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable
from typing import Generic, TypeVar

R = TypeVar("R")
ENDED_KEPT = 64  # group ids of ended rounds remembered (count)


class RoundBook(Generic[R]):
    def __init__(self, ended_kept: int = ENDED_KEPT) -> None:
        self._running: dict[bytes, R] = {}
        self._ended: dict[bytes, frozenset[Hashable]] = {}  # receipts by round, oldest first
        self._ended_kept = ended_kept
        # set (then cleared) whenever a round registers; made in the loop that waits on it
        self._registered: asyncio.Event | None = None

    def _event(self) -> asyncio.Event:
        if self._registered is None:
            self._registered = asyncio.Event()
        return self._registered

    def register(self, gid: bytes, rnd: R) -> None:
        """`rnd` runs under `gid`: wake the handlers waiting for it."""
        self._running[gid] = rnd
        event = self._event()
        event.set()
        event.clear()

    def end(self, gid: bytes, receipts: frozenset[Hashable] = frozenset()) -> None:
        """The round `gid` is over, having accepted the pushes `receipts` names: later
        pushes for it are answered at once."""
        self._running.pop(gid, None)
        self._ended[gid] = receipts
        while len(self._ended) > self._ended_kept:
            del self._ended[next(iter(self._ended))]

    async def find(self, gid: bytes, timeout: float) -> R | None:
        """The round running under `gid`, waiting up to `timeout` (s) for it to register;
        None past that, and at once when it already ended here."""
        deadline = time.monotonic() + timeout
        while (found := self._running.get(gid)) is None:
            left = deadline - time.monotonic()
            if gid in self._ended or left <= 0:
                return None
            try:
                await asyncio.wait_for(self._event().wait(), left)
            except TimeoutError:
                return self._running.get(gid)
        return found

    def receipts(self, gid: bytes) -> frozenset[Hashable]:
        """What the ended round `gid` accepted (nothing for a round not remembered)."""
        return self._ended.get(gid, frozenset())
