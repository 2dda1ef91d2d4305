"""The node's one torch thread.

Trio owns the network; every torch call runs on a single dedicated thread so that the
event loop stays responsive and torch never sees two callers at once. Trio tasks submit a
function and await its result; cancelling the waiting task abandons the result (the call
itself still finishes, since torch work cannot be interrupted safely).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

log = logging.getLogger(__name__)
T = TypeVar("T")
_Job = tuple[Callable[[], None], Callable[[float], None]]


class TorchWorker:
    def __init__(
        self, name: str = "agora-torch", on_cpu: Callable[[float], None] | None = None
    ) -> None:
        # each job: its work, then its finish, called with the work's thread-CPU seconds
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._on_cpu = on_cpu  # called on the thread with each job's CPU seconds
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.busy_s = 0.0  # seconds spent running jobs, for utilisation metrics

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, finish = job
            t0, c0 = time.perf_counter(), time.thread_time()
            work()
            cpu_s = time.thread_time() - c0
            self.busy_s += time.perf_counter() - t0
            if self._on_cpu is not None:
                self._on_cpu(cpu_s)
            finish(cpu_s)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the torch thread and return its result (or raise its error)."""
        return (await self.run_timed(fn, *args))[0]

    async def run_timed(self, fn: Callable[..., T], *args: Any) -> tuple[T, float]:
        """`run`, with the CPU seconds the torch thread spent in `fn`."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []
        spent = [0.0]

        def work() -> None:
            box.append(outcome.capture(fn, *args))

        def finish(cpu_s: float) -> None:
            spent[0] = cpu_s
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._jobs.put((work, finish))
        await done.wait()
        return box[0].unwrap(), spent[0]

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued jobs and stop the thread (waits at most `timeout_s`)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "torch worker still busy after %.0fs; leaving it to exit with the process",
                timeout_s,
            )
