"""`GroupRoundHost`: what the averaging schemes' mixins read of `StageAverager`.

Both schemes (`node.outer.all_gather`, `node.outer.reduce_scatter`) run inside hivemind's
averager process, register a round under the group id, and wake handlers that arrived
before the round was registered through one shared event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from hivemind.compression import CompressionBase
from hivemind.p2p import PeerID

from node.diloco import DilocoConfig

R = TypeVar("R")


class GroupRoundHost:
    """Attributes the averager provides to the scheme mixins (set in its `__init__`)."""

    peer_id: PeerID
    prefix: str
    _p2p: Any
    _averaged_tensors: Any
    _wire: CompressionBase
    _diloco: DilocoConfig
    _exchange_timeout: float  # s: the most one round's exchange may take
    _registered: asyncio.Event | None
    get_stub: Any  # hivemind's ServicerBase.get_stub (a classmethod)

    def _registration_event(self) -> asyncio.Event:
        """Set (then cleared) whenever a round registers: handlers wait on it for theirs."""
        if self._registered is None:
            self._registered = asyncio.Event()
        return self._registered

    def _announce_round(self) -> None:
        event = self._registration_event()
        event.set()
        event.clear()

    async def _registered_round(
        self, rounds: dict[bytes, R], gid: bytes, timeout: float
    ) -> R | None:
        """The round registered under `gid`, waiting up to `timeout` (s) for it to register
        (a groupmate may push before this member's own round began); None past that."""
        deadline = time.monotonic() + timeout
        found = rounds.get(gid)
        while found is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._registration_event().wait(), left)
            except TimeoutError:
                return rounds.get(gid)
            found = rounds.get(gid)
        return found
