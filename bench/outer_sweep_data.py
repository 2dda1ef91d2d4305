"""The training data of `agora bench outer-sweep`'s stage-0 replicas, in lease modes.

- `lease` (`LeaseQueue`, `LeaseBatches`): whole training shards in manifest order, each
  read front to back in consecutive micro-batches (`node.data.shard_batches`); a released
  shard is handed out first, from where it stood. This was the node's data path before
  small grants and pooled leases.
- `pooled` (`GrantQueue`, `PooledBatches`): the lease data path the swarm runs now
  (docs/outer-loop.md, "Data order"). `GrantQueue` grants ranges of at most
  `grant_tokens` tokens from the training shards, visited in a per-data-epoch order seeded
  by the run seed, in round robin: a shard whose granted range is committed waits behind
  the other shards for its next range, a released shard is granted first from its
  committed offset, and when every shard is done the next data epoch starts in a new
  order. `PooledBatches` is one replica's stage 0: the node's own `node.lease_pool.LeasePool`
  keeps `lease_pool` leases open, and each micro-batch takes its windows at random across
  them (`shuffle_windows`, with a seeded `random.Random` as the node's driver does) or in
  lease order; trained windows are committed by the pool's commit rule at the round that
  carries them (`round_start`, `round_end`), and a replica that missed a round gets its
  windows back to train again, as on the node.

`GrantQueue` is a model of `coordinator.leases.LeaseBook`'s grant order (acquire, commit,
release, data-epoch rollover) without its fencing, expiry and journal: bench must not
import the coordinator (tests/test_layering.py). tests/test_bench_outer_sweep.py drives
both with the same calls and checks that they grant the same ranges.

Differences from a node: a micro-batch is short only when no range is left to grant (the
node's driver sends a short one whenever its pool runs dry before its next grant), and a
replica whose pool runs dry within a round with nothing left to grant stops the run (the
node would start a round early: rounds here are synchronous); neither happens before a
data epoch's end (11.8 M tokens of the stdlib corpus).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from node.data import Batch, Dataset, shard_batches, stream_tokens
from node.lease_pool import LeasePool, RoundFacts, RoundMark, Window
from protocol.control import LeaseInfo
from protocol.corpus import ShardInfo, shard_data

# --- lease: whole shards, front to back ------------------------------------------------------


class LeaseQueue:
    """Training shards in the coordinator's order; a released shard is handed out first,
    from where it stood."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.queue: list[tuple[int, int]] = [(i, 0) for i in range(len(dataset.manifest.train))]

    def acquire(self) -> tuple[int, int]:
        if not self.queue:  # a new data epoch
            self.queue = [(i, 0) for i in range(len(self.dataset.manifest.train))]
        return self.queue.pop(0)

    def release(self, shard: int, offset: int) -> None:
        self.queue.insert(0, (shard, offset))


class LeaseBatches:
    """Consecutive windows of leased shards (`shard_batches`), `rows` windows a step."""

    def __init__(self, leases: LeaseQueue, rows: int, seq_len: int) -> None:
        self.leases, self.rows, self.seq_len = leases, rows, seq_len
        self.shard, self.offset = leases.acquire()
        self._it = self._open()

    def _open(self) -> Iterator[tuple[int, Batch]]:
        info = self.leases.dataset.manifest.train[self.shard]
        data = shard_data(self.leases.dataset.data, info)
        return shard_batches(data, self.rows, self.seq_len, self.offset)

    def __next__(self) -> Batch:
        for _ in range(3):
            got = next(self._it, None)
            if got is not None:
                pos, batch = got
                self.offset = pos + self.rows * self.seq_len
                return batch
            self.shard, self.offset = self.leases.acquire()
            self._it = self._open()
        raise ValueError("training shards are shorter than one inner batch")

    def release(self) -> None:
        self.leases.release(self.shard, self.offset)


# --- pooled: small grants in round robin, windows drawn across open leases -------------------


@dataclass(slots=True)
class _Shard:
    tokens: int
    committed: int = 0  # tokens committed in the current data epoch
    epoch: int = 0  # fencing epoch of the last grant
    state: str = "pending"  # pending | leased | done


class GrantQueue:
    """A model of the coordinator's grants (`coordinator.leases.LeaseBook.acquire`,
    `commit`, `release`, with the service's `grant_tokens` cap; module docstring)."""

    def __init__(self, shards: list[ShardInfo], *, grant_tokens: int, seed: int) -> None:
        if not shards:
            raise ValueError("a grant queue needs at least one shard")
        self.grant_tokens = grant_tokens  # 0: the rest of the shard
        self.seed = seed  # the run seed: seeds each data epoch's shard order
        self.shards = {s.shard_id: _Shard(tokens=s.tokens) for s in shards}
        self.data_epoch = 0
        self.leases: dict[int, LeaseInfo] = {}  # active leases by id
        self._next_id = 1
        self.queue: collections.deque[int] = collections.deque()
        self._rebuild_queue()

    def _rebuild_queue(self) -> None:
        """Pending shards, resumed ones first, each group in the data epoch's seeded order
        (`LeaseBook._rebuild_queue`)."""
        ids = sorted(self.shards)
        random.Random(f"{self.seed}/{self.data_epoch}").shuffle(ids)
        rank = {shard_id: i for i, shard_id in enumerate(ids)}
        pending = [i for i, s in self.shards.items() if s.state == "pending"]
        pending.sort(key=lambda i: (self.shards[i].committed == 0, rank[i]))
        self.queue = collections.deque(pending)

    def acquire(self) -> LeaseInfo | None:
        """The next pending shard's next range, or None when every shard is leased."""
        while self.queue:
            shard_id = self.queue.popleft()
            shard = self.shards[shard_id]
            if shard.state == "pending" and shard.committed < shard.tokens:
                break
        else:
            return None
        remaining = shard.tokens - shard.committed
        size = min(remaining, self.grant_tokens) if self.grant_tokens else remaining
        shard.state, shard.epoch = "leased", shard.epoch + 1
        lease = LeaseInfo(
            lease_id=self._next_id, shard_id=shard_id, epoch=shard.epoch,
            data_epoch=self.data_epoch, committed=shard.committed,
            limit=shard.committed + size, shard_tokens=shard.tokens, expires_at=0.0,
            state="active",
        )  # fmt: skip
        self._next_id += 1
        self.leases[lease.lease_id] = lease
        return lease

    def commit(self, lease_id: int, start: int, end: int) -> None:
        """`[start, end)` of the lease's shard is committed; a lease committed up to its
        limit is complete, and its shard waits behind the others for its next range."""
        lease = self.leases[lease_id]
        shard = self.shards[lease.shard_id]
        if start != shard.committed or not start < end <= lease.limit:
            raise ValueError(f"lease {lease_id}: commit [{start}, {end}) out of order")
        shard.committed = end
        if end < lease.limit:
            return
        del self.leases[lease_id]
        if shard.committed < shard.tokens:
            shard.state = "pending"
            self.queue.append(lease.shard_id)  # round robin
            return
        shard.state = "done"
        if all(s.state == "done" for s in self.shards.values()):  # a new data epoch
            self.data_epoch += 1
            for s in self.shards.values():
                s.committed, s.state = 0, "pending"
            self._rebuild_queue()

    def release(self, lease_id: int) -> None:
        """The holder left: the shard is granted first, from its committed offset."""
        lease = self.leases.pop(lease_id)
        self.shards[lease.shard_id].state = "pending"
        self.queue.appendleft(lease.shard_id)


class PooledBatches:
    """One replica's stage 0 on granted ranges: `lease_pool` open leases in the node's
    `LeasePool`, `rows` windows of `seq_len + 1` tokens a micro-batch, drawn with `rng`
    (None: in lease order)."""

    def __init__(
        self,
        grants: GrantQueue,
        dataset: Dataset,
        *,
        rows: int,
        seq_len: int,
        lease_pool: int,
        rng: random.Random | None,
    ) -> None:
        self.grants, self.dataset, self.rows, self.seq_len = grants, dataset, rows, seq_len
        self.rng = rng
        # the node's shard cache (node.runtime): twice the pool, at least 4 shards
        self.pool = LeasePool(
            seq_len=seq_len, max_open=lease_pool, shard_cache=max(4, 2 * lease_pool)
        )
        self._infos = {s.shard_id: s for s in dataset.manifest.train}
        self._mark: RoundMark | None = None

    def _open_leases(self) -> None:
        """Fill the pool with granted ranges, as the node's driver does before each take."""
        width = self.dataset.manifest.token_bytes
        while self.pool.wants_lease():
            lease = self.grants.acquire()
            if lease is None:
                return
            shard = self.pool.shard(lease.shard_id)
            if shard is None:
                chunk = shard_data(self.dataset.data, self._infos[lease.shard_id], width)
                shard = stream_tokens(chunk, width)
            self.pool.open(lease, shard)

    def __next__(self) -> Batch:
        windows: list[Window] = []
        while len(windows) < self.rows:
            self._open_leases()
            got = self.pool.take(self.rows - len(windows), self.rng)
            if not got and windows:  # the last windows of a data epoch: a smaller batch
                break
            if not got:
                # the node would start a round early (its commits end the leases); the
                # simulation's rounds are synchronous
                raise ValueError(
                    "pooled data ran dry within a round: every remaining range is granted"
                    " and waits for a round to commit it (a data epoch's end, or too few"
                    " shards for the replicas' pools)"
                )
            windows += got
        self.pool.finish(windows, final=False)  # committed by the round that carries them
        t = self.seq_len
        rows = np.stack([w.shard[w.start : w.start + t + 1] for w in windows])
        win = torch.from_numpy(rows.astype(np.int64))
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()

    def round_start(self) -> None:
        """An outer round begins: it carries the windows trained so far."""
        self._mark = self.pool.snapshot()

    def round_end(self, *, applied: bool, contributed: bool) -> None:
        """The round's result, under the pool's commit rule. The simulation keeps one
        `theta_g` for the stage, so an applied round is on its only lineage (`sole`); a
        replica whose contribution is not in it rebased onto it (adopted), and its round's
        windows go back to be trained again. The commits go to the grant queue."""
        if self._mark is None:  # a replica that joined after the round began
            return
        facts = RoundFacts(
            mark=self._mark, applied=applied, contributed=contributed,
            adopted=not contributed, sole=True,
        )  # fmt: skip
        self._mark = None
        for c in self.pool.round_result(facts).commits:
            self.grants.commit(c.lease.lease_id, c.start, c.end)
            self.pool.accept(c)

    def release(self) -> None:
        """The replica was killed: its leases go back at their committed offsets."""
        for lease in self.pool.release_all():
            self.grants.release(lease.lease_id)
