"""Stage 0's driver: lease data, cut micro-batches, keep the pipeline full, commit.

It keeps `lease_pool` leases open (`node.lease_pool.LeasePool` holds their state) and
cuts each micro-batch from windows drawn across them, with `in_flight` micro-batches in
the pipeline at once (`node.pipeline_hop.PipelineHop` carries each one). A micro-batch's
id is its first window's (lease, epoch, offset), and it counts once: stage 0 finishes it
once. Commits go to the coordinator one at a time, in order:
- with an outer loop, when the pool's commit rule says a round's result put the windows
  into the stage's global state (`round_result(facts)`, called by the node's round hook);
  trained ranges the rule hands back are trained again (`ranges_returned` events);
- without one, as soon as the windows are trained.
A fenced lease is dropped at once: its windows in flight are not finished, and nothing
of it is committed. When a heartbeat reply says that ranges of expired or released
leases wait for a holder, the driver asks for one at once (`freed_only`), even with a
full pool (up to twice its size, `LeasePool.room_for_freed`): a dead holder's data is
trained again one heartbeat after its lease expired, not when this node next runs short. On drain the driver finishes its open leases within half the drain
budget; what is left is released at the committed offset when the node leaves.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable

import numpy as np
import trio

from node import metrics
from node.config import NodeConfig
from node.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorUnavailable,
    FencedError,
)
from node.data import stream_tokens
from node.drain import Drain
from node.events import EventLog
from node.lease_pool import CommitRange, LeasePool, RoundFacts, Window
from node.pipeline_hop import PipelineHop
from protocol.control import LeaseInfo

log = logging.getLogger(__name__)

IDLE_WAIT_S = 2.0  # seconds between polls when there is no lease to be had


class Stage0Driver:
    def __init__(
        self,
        pool: LeasePool,
        hop: PipelineHop,
        client: CoordinatorClient,
        drain: Drain,
        *,
        micro_batch: int,  # windows per micro-batch
        in_flight: int,  # micro-batches in the pipeline at once
        max_attempts: int,  # failed tries after which a draining node gives one up
        shuffle: bool,  # draw windows at random across the open leases
        max_tokens: int | None,  # drain after committing this many tokens (None = never)
        seed: str,  # seeds the window draws
        events: EventLog | None = None,
        token_bytes: int = 1,  # bytes a token in the run's shards (Manifest.token_bytes)
    ) -> None:
        self.pool = pool
        self.hop = hop
        self.client = client
        self.drain = drain
        self.micro_batch = micro_batch
        self.in_flight = in_flight
        self.max_attempts = max_attempts
        self.rng = random.Random(seed) if shuffle else None
        self.max_tokens = max_tokens
        self.events = events or EventLog()
        self.token_bytes = token_bytes
        self.commit_on_finish = True  # no outer loop: commit windows once trained
        # called when no lease was granted and no window is left (e.g. to start an outer
        # round early, whose commits free the coordinator's per-peer lease cap)
        self.on_out_of_work: Callable[[], None] | None = None
        self.losses: deque[float] = deque(maxlen=32)  # the last micro-batch losses
        self._commit_lock = trio.Lock()  # commits go out one at a time, in order
        self._open_lock = trio.Lock()  # one lease request at a time
        self._opened = trio.Event()  # set when a freed range was opened (wakes the loop)
        self.freed_opened = 0  # freed ranges taken at a heartbeat reply's word
        # (outer round, digest) of the global state that holds the ranges committed now;
        # None without an outer loop
        self._lineage: tuple[int, str] | None = None

    @classmethod
    def for_node(
        cls,
        cfg: NodeConfig,
        pool: LeasePool,
        hop: PipelineHop,
        client: CoordinatorClient,
        drain: Drain,
        *,
        seed: str,
        events: EventLog | None = None,
        token_bytes: int = 1,
    ) -> Stage0Driver:
        """The driver with a node's settings; with an outer loop, only the round that
        covers trained windows commits them."""
        driver = cls(
            pool, hop, client, drain, micro_batch=cfg.micro_batch, in_flight=cfg.in_flight,
            max_attempts=cfg.max_attempts, shuffle=cfg.shuffle_windows,
            max_tokens=cfg.max_tokens, seed=seed, events=events, token_bytes=token_bytes,
        )  # fmt: skip
        driver.commit_on_finish = cfg.outer_every_steps == 0
        return driver

    @property
    def loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    async def run(self) -> None:
        slots = trio.Semaphore(self.in_flight)
        no_grant_until = 0.0  # trio time before which asking for a lease is pointless
        async with trio.open_nursery() as nursery:
            freed = trio.CancelScope()
            nursery.start_soon(self._take_freed, freed)
            while True:
                if self.drain.started:
                    if not self.pool.untaken or self.drain.past_half():
                        break
                elif self.max_tokens is not None and self.pool.tokens_committed >= self.max_tokens:
                    self.drain.start(f"reached max_tokens={self.max_tokens}")
                    continue
                elif self.pool.wants_lease() and trio.current_time() >= no_grant_until:
                    if await self._open_one():
                        continue
                    no_grant_until = trio.current_time() + IDLE_WAIT_S
                    if not self.pool.untaken and self.on_out_of_work is not None:
                        self.on_out_of_work()
                if not self.pool.untaken:
                    await self._idle()
                    continue
                await slots.acquire()
                # A fence may have emptied the pool while this waited for a slot.
                batch = self.pool.take(self.micro_batch, self.rng)
                if not batch:
                    slots.release()
                    continue
                nursery.start_soon(self._microbatch, batch, slots)
            freed.cancel()
            # In-flight micro-batches finish (or give up); windows never trained stay
            # uncommitted, and their leases are released at the commit point.

    async def _idle(self) -> None:
        """Wait (at most IDLE_WAIT_S) for the drain or for a freed range to be opened."""
        with trio.move_on_after(IDLE_WAIT_S):
            async with trio.open_nursery() as nursery:

                async def first(wait: Callable[[], Awaitable[object]]) -> None:
                    await wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(first, self.drain.wait)
                nursery.start_soon(first, self._opened.wait)
        if self._opened.is_set():
            self._opened = trio.Event()

    async def _take_freed(self, scope: trio.CancelScope) -> None:
        """Take the freed ranges the heartbeat replies announce while the pool has room."""
        with scope:
            while True:
                await self.client.wait_freed()
                while not self.drain.started and self.pool.room_for_freed():
                    if not await self._open_one(freed_only=True):
                        break
                    self.freed_opened += 1
                    self._opened.set()

    async def _open_one(self, *, freed_only: bool = False) -> bool:
        """Ask for a lease (`freed_only`: a range an expired or released lease left) and
        open it; False if none was granted."""
        async with self._open_lock:
            try:
                grant = await self.client.acquire_grant(freed_only=freed_only)
            except (CoordinatorError, CoordinatorUnavailable) as exc:
                log.warning("node: lease request failed: %s", exc)
                return False
            lease = grant.lease
            if lease is None:
                log.debug("node: no lease granted (%s)", grant.reason)
                return False
            shard = self.pool.shard(lease.shard_id)
            if shard is None:
                data = await self.client.fetch_shard(lease.shard_id)  # sha256-checked
                shard = stream_tokens(data, self.token_bytes)
            self.pool.open(lease, shard)
        log.info(
            "node: training lease %d (shard %d, tokens %d..%d, epoch %d%s)",
            lease.lease_id, lease.shard_id, lease.committed, lease.limit, lease.epoch,
            ", a freed range" if freed_only else "",
        )  # fmt: skip
        return True

    async def _microbatch(self, batch: list[Window], slots: trio.Semaphore) -> None:
        try:
            t = self.pool.seq_len
            rows = np.stack([w.shard[w.start : w.start + t + 1] for w in batch])
            first = batch[0]
            mb_id = f"{first.lease.lease_id}.{first.lease.epoch}.{first.start}"
            lease_ids = {w.lease.lease_id for w in batch}

            def give_up(failures: int) -> bool:
                if all(self.pool.is_fenced(i) for i in lease_ids):
                    return True
                return self.drain.started and (
                    failures >= self.max_attempts or self.drain.past_deadline()
                )

            loss = await self.hop.run_microbatch(mb_id, rows, give_up)
            if loss is None:  # fenced or draining: not finished, not committed
                return
            self.losses.append(loss)
            metrics.LOSS.set(self.loss or loss)  # mean of the last 32
            metrics.MICROBATCHES.labels("done").inc()
            self.pool.finish(batch, final=self.commit_on_finish)
            # Without an outer loop finished windows are committed now; with one, only
            # the round that carries them commits them (also while it moves or restarts).
            if self.commit_on_finish:
                await self.commit()
        finally:
            slots.release()

    async def commit(self) -> None:
        """Commit what the pool may commit."""
        async with self._commit_lock:
            for rng in self.pool.commits():
                await self._commit_one(rng)

    async def round_result(self, facts: RoundFacts) -> None:
        """An outer round's result is in: the pool's commit rule decides what is
        committed and what goes back to be trained again."""
        verdict = self.pool.round_result(facts)
        if verdict.rode_in is not None:  # the state these commits rode in (recorded with them)
            self._lineage = verdict.rode_in
        self.ranges_returned(verdict.returned, "did not reach the global state")
        await self.commit()

    def ranges_returned(self, ranges: list[CommitRange], why: str) -> None:
        """Log and record trained ranges the commit rule handed back to be trained again."""
        for rng in ranges:
            log.info(
                "node: lease %d tokens %d..%d %s; training them again",
                rng.lease.lease_id, rng.start, rng.end, why,
            )  # fmt: skip
            self.events.emit(
                "ranges_returned", lease_id=rng.lease.lease_id, shard_id=rng.lease.shard_id,
                start=rng.start, end=rng.end,
            )  # fmt: skip

    async def _commit_one(self, rng: CommitRange) -> None:
        lease = rng.lease
        if not self.pool.pending(rng):  # fenced since the list was made
            return
        try:
            rnd, digest = self._lineage or (None, "")
            await self.client.commit(lease, rng.start, rng.end, stage=0, round_=rnd, digest=digest)
        except FencedError as exc:
            log.warning("node: lease %d fenced at commit: %s", lease.lease_id, exc)
            self.pool.fence(lease.lease_id)
            return
        metrics.COMMITTED.inc(rng.end - rng.start)
        self.events.emit(
            "lease_committed", lease_id=lease.lease_id, shard_id=lease.shard_id,
            start=rng.start, end=rng.end,
        )  # fmt: skip
        if self.pool.accept(rng):
            log.info("node: lease %d complete", lease.lease_id)

    async def release_all(self) -> None:
        """Hand every held lease back (leaving): uncommitted ranges return to the queue."""
        async with self._commit_lock:
            for lease in self.pool.release_all():
                await self._release(lease)

    async def _release(self, lease: LeaseInfo) -> None:
        try:
            await self.client.release(lease)
            log.info("node: released lease %d", lease.lease_id)
        except (CoordinatorError, CoordinatorUnavailable) as exc:
            log.warning("node: could not release lease %d: %s", lease.lease_id, exc)
