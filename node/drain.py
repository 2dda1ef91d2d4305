"""A node's graceful exit, shared by the objects that must wind down in order.

`start()` stops new work: the driver finishes its open leases (within half the budget),
in-flight micro-batches finish or are given up by `deadline`, the last outer round runs,
the node commits, releases its leases and leaves. Starting twice changes nothing.
"""

from __future__ import annotations

import logging
import math

import trio

from node.events import EventLog

log = logging.getLogger(__name__)


class Drain:
    def __init__(self, timeout_s: float, events: EventLog | None = None) -> None:
        self.timeout_s = timeout_s  # seconds from the start to give up in-flight work
        self.events = events or EventLog()
        self.deadline = math.inf  # trio time by which in-flight work is given up
        self._event = trio.Event()

    @property
    def started(self) -> bool:
        return self._event.is_set()

    def start(self, why: str = "") -> None:
        if not self._event.is_set():
            log.info("node: draining (finishing in-flight micro-batches, then leaving)%s",
                     f": {why}" if why else "")  # fmt: skip
            self.deadline = trio.current_time() + self.timeout_s
            self.events.emit("draining", reason=why or "asked")
            self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    def past_half(self) -> bool:
        """Half the budget is spent (the driver stops finishing open leases)."""
        return trio.current_time() > self.deadline - self.timeout_s / 2

    def past_deadline(self) -> bool:
        return trio.current_time() > self.deadline
