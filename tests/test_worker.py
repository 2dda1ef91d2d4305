"""The torch worker runs every job on one thread and keeps trio responsive."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from node.worker import TorchWorker


def test_jobs_run_on_one_thread_in_order_and_errors_propagate() -> None:
    worker = TorchWorker()
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * 2

    def boom() -> None:
        raise ValueError("bad tensor")

    async def main() -> list[int]:
        results = []
        async with trio.open_nursery() as nursery:

            async def one(i: int) -> None:
                results.append(await worker.run(job, i))

            for i in range(5):
                nursery.start_soon(one, i)
        with pytest.raises(ValueError, match="bad tensor"):
            await worker.run(boom)
        return sorted(results)

    assert trio.run(main) == [0, 2, 4, 6, 8]
    assert {name for _, name in seen} == {"agora-torch"}
    worker.close()


def test_event_loop_stays_responsive_while_the_worker_is_busy() -> None:
    worker = TorchWorker()
    ticks = 0

    async def main() -> None:
        nonlocal ticks
        async with trio.open_nursery() as nursery:

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await trio.sleep(0.01)

            nursery.start_soon(ticker)
            await worker.run(time.sleep, 0.5)
            nursery.cancel_scope.cancel()

    trio.run(main)
    worker.close()
    assert ticks >= 10  # the loop kept running during the half-second blocking call


def test_each_jobs_cpu_seconds_are_reported_and_waiting_is_not() -> None:
    seen: list[float] = []
    worker = TorchWorker(on_cpu=seen.append)

    def spin() -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass

    timed: list[float] = []

    async def main() -> None:
        await worker.run(spin)
        _, cpu_s = await worker.run_timed(time.sleep, 0.2)  # waiting costs no CPU
        timed.append(cpu_s)

    trio.run(main)
    worker.close()
    assert len(seen) == 2
    assert seen[0] >= 0.05 and seen[1] < 0.05, seen
    assert timed == seen[1:]  # the caller gets the same figure as the metric
