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
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

log = logging.getLogger(__name__)
T = TypeVar("T")


class TorchWorker:
    def __init__(
        self, name: str = "agora-torch", on_cpu: Callable[[float], None] | None = None
    ) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._on_cpu = on_cpu  # called on the thread with each job's CPU seconds
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.busy_s = 0.0  # seconds spent running jobs, for utilisation metrics

    def _loop(self) -> None:
        import time

        while (job := self._jobs.get()) is not None:
            t0, c0 = time.perf_counter(), time.thread_time()
            job()
            self.busy_s += time.perf_counter() - t0
            if self._on_cpu is not None:
                self._on_cpu(time.thread_time() - c0)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the torch thread and return its result (or raise its error)."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def job() -> None:
            box.append(outcome.capture(fn, *args))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._jobs.put(job)
        await done.wait()
        return box[0].unwrap()

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish queued jobs and stop the thread (waits at most `timeout_s`)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "torch worker still busy after %.0fs; leaving it to exit with the process",
                timeout_s,
            )
