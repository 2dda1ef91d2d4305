"""The discrete-event core of `agora plan`: simulated time, shared CPUs, torch workers and
links. No knowledge of Agora's rules (swarmlab/plan/sim.py has those).

- `Engine`: a heap of (time, callback); `run(until)` advances simulated seconds.
- `Host`: cores shared by processor sharing: n busy tasks on c cores each progress at
  min(1, c / (n + b)) / (1 + k max(0, (n + b) / c - 1)) of a core, where b counts
  always-runnable threads outside the simulation (a node's outer process and p2p daemon;
  a loopback swarm's nodes share this machine's two cores) and k (`contention`) is the
  extra CPU the same work costs per thread of oversubscription (switching, caches).
- `Worker`: a node's one torch thread, running one job at a time on its host in the
  order of the node's `WorkerGate`: retried work, then backwards, then fresh forwards,
  each in arrival order; `URGENT` (outer-round snapshots and merges, inner steps) goes
  before all of them, as a direct call to the worker queues behind only the running job.
- `Link`: a peer's uplink and downlink, each serialising what crosses it; one-way
  latency is half the mean of the two peers' RTTs; loss caps a TCP flow's rate
  (Mathis et al.: MSS / (RTT sqrt(2p/3))).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

Callback = Callable[[], object]
MSS_BITS = 1460 * 8  # TCP segment payload (bits)


class Engine:
    def __init__(self) -> None:
        self.now = 0.0  # simulated seconds
        self._heap: list[tuple[float, int, Callback]] = []
        self._seq = 0
        self.events = 0  # callbacks run so far

    def at(self, t: float, fn: Callback) -> None:
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn))
        self._seq += 1

    def after(self, dt: float, fn: Callback) -> None:
        self.at(self.now + dt, fn)

    def run(self, until: float) -> None:
        while self._heap and self._heap[0][0] <= until:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn()
        self.now = until


class Host:
    """Processor sharing over `cores`; `submit(work_s, done)` runs `work_s` core-seconds."""

    def __init__(self, engine: Engine, cores: float, contention: float = 0.0) -> None:
        self.engine = engine
        self.cores = cores
        self.contention = contention  # extra CPU per unit of oversubscription (fraction)
        self.background = 0.0  # always-runnable threads outside the simulation (count)
        self._tasks: dict[int, list[object]] = {}  # id -> [remaining core-seconds, done]
        self._ids = 0
        self._last = 0.0
        self._version = 0
        self.busy_s = 0.0  # core-seconds served
        self.over_s = 0.0  # core-seconds served, each times the oversubscription it ran under

    def _rate(self) -> float:
        if not self._tasks:
            return 0.0
        load = len(self._tasks) + self.background
        return min(1.0, self.cores / load) / (1.0 + self.contention * self._over())

    def _over(self) -> float:
        """Oversubscription: runnable threads per core beyond one."""
        return max(0.0, (len(self._tasks) + self.background) / self.cores - 1.0)

    def _advance(self) -> None:
        dt = self.engine.now - self._last
        self._last = self.engine.now
        if dt > 0 and self._tasks:
            r = self._rate()
            for t in self._tasks.values():
                t[0] = float(t[0]) - dt * r  # type: ignore[arg-type]
            self.busy_s += dt * r * len(self._tasks)
            self.over_s += dt * r * len(self._tasks) * self._over()

    def _schedule(self) -> None:
        self._version += 1
        if not self._tasks:
            return
        v = self._version
        left = min(float(t[0]) for t in self._tasks.values())  # type: ignore[arg-type]
        self.engine.after(max(0.0, left) / self._rate(), lambda: self._fire(v))

    def _fire(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        done = [k for k, t in self._tasks.items() if float(t[0]) <= 1e-12]  # type: ignore[arg-type]
        callbacks = [self._tasks.pop(k)[1] for k in done]
        self._schedule()
        for cb in callbacks:
            cb()  # type: ignore[operator]

    def add_background(self, threads: float) -> None:
        """`threads` more (fewer, when negative) always-runnable threads share the cores
        with the tasks: a node's outer process and daemon on a shared host."""
        self._advance()
        self.background = max(0.0, self.background + threads)
        self._schedule()

    def submit(self, work_s: float, done: Callback) -> int:
        """Run `work_s` core-seconds, then `done`; returns the task's id for `cancel`."""
        self._advance()
        self._ids += 1
        self._tasks[self._ids] = [max(work_s, 0.0), done]
        self._schedule()
        return self._ids

    def cancel(self, task: int) -> None:
        """Drop a task that has not finished (its thread was killed): it stops taking a
        share of the cores at once, and its callback never runs."""
        self._advance()
        if self._tasks.pop(task, None) is not None:
            self._schedule()


URGENT, RETRIED, BACKWARD, FRESH = 0, 1, 2, 3  # worker priorities, most urgent first


@dataclass(slots=True)
class Worker:
    host: Host
    alive: bool = True
    busy: bool = False
    jobs: list[tuple[int, int, float, Callback]] = field(default_factory=list)
    running: int | None = None  # the host task of the job being run
    _arrivals: int = 0

    def submit(self, work_s: float, done: Callback, priority: int = FRESH) -> None:
        self._arrivals += 1
        heapq.heappush(self.jobs, (priority, self._arrivals, work_s, done))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self.jobs or not self.alive:
            self.busy = False
            return
        self.busy = True
        _, _, work, done = heapq.heappop(self.jobs)

        def finished() -> None:
            self.running = None
            if self.alive:
                done()
                self._next()

        self.running = self.host.submit(work, finished)

    def stop(self) -> None:
        """The node is gone: its queue is dropped and its running job stops using the
        host's cores at once (a SIGKILLed process frees its CPU)."""
        self.alive = False
        self.jobs.clear()
        if self.running is not None:
            self.host.cancel(self.running)
            self.running = None


@dataclass(slots=True)
class Link:
    up_bps: float  # uplink (bit/s)
    down_bps: float  # downlink (bit/s)
    rtt_s: float  # RTT to a typical peer (s)
    loss: float = 0.0  # packet loss (fraction)
    up_free: float = 0.0  # simulated time the uplink is next idle
    down_free: float = 0.0  # simulated time the downlink is next idle
    sent: int = 0  # bytes sent
    received: int = 0  # bytes received


def one_way_s(a: Link, b: Link) -> float:
    return (a.rtt_s + b.rtt_s) / 4.0


def transfer(engine: Engine, a: Link, b: Link, nbytes: int, done: Callback) -> None:
    """Send `nbytes` from a to b: queued on a's uplink and b's downlink, then the latency."""
    rtt = 2 * one_way_s(a, b)
    rate = min(a.up_bps, b.down_bps)
    loss = max(a.loss, b.loss)
    if loss > 0 and rtt > 0:
        rate = min(rate, MSS_BITS / (rtt * math.sqrt(2 * loss / 3)))
    start = max(engine.now, a.up_free, b.down_free)
    end = start + nbytes * 8 / rate
    a.up_free = b.down_free = end
    a.sent += nbytes
    b.received += nbytes
    engine.at(end + one_way_s(a, b), done)
