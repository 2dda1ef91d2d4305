"""A training node's life: join, serve its stage, drive micro-batches, drain and leave.

Trio owns everything here; torch work goes to the one `TorchWorker` thread. Tasks:
- the heartbeat loop renews membership and leases, learns fences, moves and drains;
- the membership loop keeps the view of peers (the data plane serves only members);
- on stage 0, the driver leases data, cuts micro-batches, keeps `in_flight` of them in
  the pipeline, retries a failed route on another peer, and commits the contiguous
  prefix of finished micro-batches (a micro-batch counts once: its id is its lease and
  offset, and stage 0 finishes it once);
- the `/agora/fwd/1` handler (stages > 0) runs the forward, passes it on, and answers with
  the gradient once the downstream stages have answered;
- the `/agora/state/1` handler (node.state_server) serves the stage's global state to
  members, e.g. `agora export --coordinator` joined as an observer.

Observers (`PeerInfo.observer`) are members (their streams are admitted) but on no
stage: they are never routed to, bootstrapped from or counted as replicas.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from node import metrics
from node.checkpoint import (
    ResumeState,
    StageCheckpointer,
    resume_state,
    save_stage_state,
    stage_checkpointer,
)
from node.config import NodeConfig
from node.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorUnavailable,
    FencedError,
)
from node.diloco import DilocoConfig
from node.events import EventLog
from node.lease_progress import LeaseProgress
from node.model import preset
from node.outer_link import OuterConfig, OuterLinkError, RoundResult
from node.outer_rounds import OuterRounds, Snapshot
from node.p2p.transport import Transport, TransportError
from node.routing import Router
from node.stage_compute import InnerConfig, StageCompute, throughput_probe
from node.state_server import StateServer
from node.worker import TorchWorker
from protocol.codec import DEFAULT_MAX_FRAME
from protocol.control import HeartbeatReply, JoinReply, JoinRequest, LeaseInfo, LeaseRef, PeerInfo
from protocol.errors import ProtocolError
from protocol.message import Message
from protocol.pipeline import FORWARD_PROTOCOL, Backward, Forward
from protocol.state import STATE_PROTOCOL
from protocol.tensors import EncodedTensor, TensorFrame

log = logging.getLogger(__name__)

# Moves to the run's DHT root before the first round (each restarts the outer process);
# past this a node stays where it is (e.g. a root that is dead but not yet lapsed).
MAX_DHT_MOVES = 3

MAX_ROWS = 1024  # sequences per micro-batch a peer may send us
IDLE_WAIT_S = 0.5  # seconds between polls when there is nothing to do
OUTER_POLL_S = 0.2  # seconds between checks on the outer round


@dataclass(slots=True)
class NodeStats:
    """What the node reports about itself (its metrics and logs)."""

    losses: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    tokens_committed: int = 0  # lease tokens committed by this node
    tokens_trained: int = 0  # tokens this node's stage trained on (forward + backward)

    @property
    def loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None


@dataclass(frozen=True, slots=True)
class Window:
    """One training sequence of a leased shard: seq_len + 1 bytes from `start`."""

    lease: LeaseInfo
    shard: bytes  # the whole shard (shared by its windows)
    start: int  # token offset in the shard


class Node:
    def __init__(
        self,
        cfg: NodeConfig,
        transport: Transport,
        client: CoordinatorClient,
        *,
        device: str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.transport = transport
        self.client = client
        self.device = device
        self.worker = TorchWorker()
        self.events = EventLog(cfg.events_file)
        self.router = Router()
        self.stats = NodeStats()
        self.members: dict[str, PeerInfo] = {}
        self.membership_version = 0
        self.compute: StageCompute | None = None
        self.join: JoinReply | None = None
        self.leases: dict[int, LeaseInfo] = {}  # held leases by id
        self._fenced: set[int] = set()  # lease ids the coordinator fenced
        self._draining = trio.Event()  # stop taking new work
        self._drain_deadline = math.inf  # trio time by which in-flight work is given up
        self._shards: dict[int, bytes] = {}  # shard bytes cache (bounded below)
        self._bytes_seen: dict[str, int] = {}  # codec byte counts already in the metrics
        self._progress: dict[int, LeaseProgress] = {}  # stage 0: progress of held leases
        self._commit_lock = trio.Lock()  # commits of one node go out in order
        self._checkpoint_lock = trio.Lock()  # the round hook and the drain both write
        self.outer: OuterRounds | None = None  # None when outer_every_steps = 0
        self._dht_bootstrap = ""  # peer id whose DHT our outer process joined (or ours)
        self.throughput = 0.0  # measured tokens/s of this stage
        self.checkpoints: StageCheckpointer | None = None  # --checkpoint-dir (node.checkpoint)
        self.state_server: StateServer | None = None  # /agora/state/1 (node.state_server)
        self._built = trio.Event()  # the stage is built: forwards can be served

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def stage(self) -> int:
        assert self.join is not None
        return self.join.stage

    def drain(self) -> None:
        """Begin a graceful exit: finish in-flight work, commit, release, leave."""
        if not self._draining.is_set():
            log.info("node: draining (finishing in-flight micro-batches, then leaving)")
            self._drain_deadline = trio.current_time() + self.cfg.drain_timeout_s
            self._draining.set()

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.join = await self.client.join(
            JoinRequest(
                addrs=self.transport.listen_addrs,
                device=self.device,
                deadline=self.cfg.deadline,
                stage=self.cfg.stage,
                join_token=self.cfg.join_token,
                metrics_port=self.cfg.metrics_port or None,
            )
        )
        run = self.join.run
        log.info(
            "node: joined run %s as %s on stage %d/%d (preset %s, codec %s)",
            run.run_id, self.join.peer_id, self.stage, run.n_stages, run.model_preset, run.codec,
        )  # fmt: skip
        metrics.STAGE.set(self.stage)
        self.events.emit(
            "joined", peer_id=self.join.peer_id, stage=self.stage, n_stages=run.n_stages,
            run_id=run.run_id,
        )  # fmt: skip
        try:
            async with trio.open_nursery() as nursery:
                # Heartbeats start first: building the stage may take longer than the TTL.
                nursery.start_soon(self._heartbeat_loop)
                # Serve forwards from now on: peers see this node in the membership view
                # before its stage is built, and a forward that waits for the build is
                # better than a refused protocol (which bans this node for a while).
                self.transport.set_handler(FORWARD_PROTOCOL, self._serve_forward)
                await self._build_stage()
                try:
                    await self._refresh_membership()
                except (CoordinatorError, CoordinatorUnavailable) as exc:
                    # E.g. not_member: the membership lapsed while the stage was built
                    # (the heartbeat loop re-joins); the membership loop retries.
                    log.warning("node: first membership refresh failed: %s", exc)
                if self.cfg.outer_every_steps > 0:
                    await self._start_outer()
                    nursery.start_soon(self._outer_loop)
                nursery.start_soon(self._membership_loop)
                if self.cfg.deadline is not None:
                    nursery.start_soon(self._deadline_watch)
                task_status.started()
                if self.stage == 0:
                    await self._drive()
                else:
                    await self._draining.wait()
                if self.outer is not None:
                    # Finish the outer round so the last progress (and its commits) lands.
                    await self.outer.finish(self.cfg.drain_timeout_s)
                    await self._checkpoint(final=True)  # checkpoint hook (drain)
                nursery.cancel_scope.cancel()
        finally:
            await self._leave()
            if self.outer is not None:
                await trio.to_thread.run_sync(self.outer.close)
            self.worker.close()
            self.events.close()

    def _dht_root(self) -> PeerInfo | None:
        """The run's canonical DHT bootstrap: the member with the smallest peer id that
        announces a DHT, or None when that is this node. Nodes that start at the same
        moment each begin a DHT of their own; before their first round they all move to
        the root's, so groups can form. The smallest id never moves, so this converges."""
        me = self.transport.peer_id
        root = min(
            (
                p
                for p in self.members.values()
                if p.dht_addrs and p.peer_id != me and not p.observer
            ),
            key=lambda p: p.peer_id,
            default=None,
        )
        return root if root is not None and root.peer_id < me else None

    async def _outer_loop(self) -> None:
        moves = 0
        while True:
            await trio.sleep(OUTER_POLL_S)
            assert self.outer is not None
            root = self._dht_root()
            if (
                self.outer.rounds == 0
                and not self.outer.in_flight
                and root is not None
                and root.peer_id != self._dht_bootstrap
                and moves < MAX_DHT_MOVES
            ):
                moves += 1
                log.info(
                    "outer: moving to the run's DHT at %s before the first round", root.peer_id
                )
                old, self.outer = self.outer, None
                # Training goes on during the move: keep that progress (a rebase onto the
                # state found there), since its micro-batches will be committed.
                carry = await self.worker.run(old.carry_state)
                await trio.to_thread.run_sync(old.close)
                await self._start_outer(carry=carry)
                # Check the root again before a round: a move that fell back to a DHT of
                # our own must not be sealed by a first round taken alone.
                continue
            await self.outer.tick()

    async def _start_outer(self, carry: ResumeState | None = None) -> None:
        """Start the hivemind outer loop, load the stage's state, announce its DHT.
        `carry` is the state of the outer loop this one replaces (a DHT move)."""
        assert self.join is not None and self.compute is not None
        me = self.transport.peer_id
        root = self._dht_root()
        # The root first, then every other member's DHT: hivemind needs one to answer, so
        # a root that just died (still listed until its TTL lapses) does not strand us.
        others = sorted(
            (p for p in self.members.values() if p.dht_addrs and not p.observer),
            key=lambda p: p.peer_id,
        )
        bootstrap = [a for p in others if p.peer_id != me for a in p.dht_addrs]
        self._dht_bootstrap = root.peer_id if root is not None else me
        replicas = [
            p
            for p in self.members.values()
            if p.peer_id != me and p.stage == self.stage and not p.observer
        ]
        try:
            outer = await self._outer_rounds(bootstrap)
        except (OuterLinkError, TimeoutError, OSError) as exc:
            if not bootstrap:
                raise
            # Every announced DHT is gone: start one of our own; the next root check
            # (before the first round) moves us to the run's DHT again.
            log.warning("outer: no member's DHT answered (%s); starting our own", exc)
            self._dht_bootstrap = me
            outer = await self._outer_rounds([])
        resume = carry
        if resume is None and self.cfg.checkpoint_dir is not None:  # the stage's checkpoint
            resume = await trio.to_thread.run_sync(
                resume_state, self.cfg.checkpoint_dir, self.join.run, self.stage, self.compute.model
            )
        await outer.load_state(
            replicas_exist=any(p.dht_addrs for p in replicas),
            resume=resume,
            keep_progress=carry is not None,
        )
        if self.state_server is not None:  # serve the loaded state (round 0 or fetched)
            await self.state_server.capture(outer.link)
        # Only a loaded outer loop is visible to rounds, drains and checkpoints: the link
        # runs one operation at a time.
        self.outer = outer
        # Announce the DHT (next heartbeat), so other nodes can bootstrap from it.
        self.client.announce_dht(outer.link.dht_addrs())

    async def _outer_rounds(self, bootstrap: list[str]) -> OuterRounds:
        assert self.join is not None and self.compute is not None
        return await OuterRounds.start(
            self.worker,
            self.compute,
            run_id=self.join.run.run_id,
            stage=self.stage,
            initial_peers=bootstrap,
            config=OuterConfig(
                compression=self.cfg.outer_compression,
                matchmaking_s=self.cfg.outer_matchmaking_s,
                request_timeout_s=min(1.0, self.cfg.outer_matchmaking_s / 2),
                round_timeout_s=self.cfg.outer_timeout_s,
                state_timeout_s=self.cfg.outer_state_timeout_s,
                diloco=DilocoConfig(
                    eta=self.cfg.outer_lr,
                    mu=self.cfg.outer_momentum,
                    participation_power=self.cfg.outer_participation_power,
                ),
            ),
            every_steps=self.cfg.outer_every_steps,
            snapshot=self._commit_snapshot,
            on_applied=self._outer_applied,
            target_tokens=self._round_target,  # participation rule (docs/outer-loop.md)
        )

    def _round_target(self) -> int:
        """Tokens a full outer round gathers: every replica of this stage in the membership
        view trains `outer_every_steps` inner steps of `inner_batch_tokens` each."""
        replicas = sum(1 for p in self.members.values() if p.stage == self.stage and not p.observer)
        return max(1, replicas) * self.cfg.outer_every_steps * self.cfg.inner_batch_tokens

    def _commit_snapshot(self) -> Snapshot:
        """Commit points the round being started will cover (stage 0 only)."""
        return {lease_id: p.commit_point() for lease_id, p in self._progress.items()}

    async def _outer_applied(self, result: RoundResult, snapshot: Snapshot) -> None:
        """The round's snapshot is in the global state: commit what it covered."""
        self.events.emit(
            "round_applied", round=result.round, group_size=result.group_size,
            tokens=result.tokens, seconds=result.seconds, rebased=result.rebased,
        )  # fmt: skip
        await self._checkpoint()  # checkpoint hook: persist theta_g before committing
        if self.state_server is not None and self.outer is not None:
            # serve this round's theta_g (the link is idle until the hook returns)
            await self.state_server.capture(self.outer.link)
        for lease_id, point in snapshot.items():
            lease = self.leases.get(lease_id)
            progress = self._progress.get(lease_id)
            if lease is not None and progress is not None:
                await self._commit(lease, progress, upto=point)

    async def _checkpoint(self, *, final: bool = False) -> None:
        """--- checkpoint hook (node.checkpoint): write theta_g when a checkpoint is due ---"""
        if self.outer is None or self.cfg.checkpoint_dir is None:
            return
        async with self._checkpoint_lock:
            if self.checkpoints is None:
                assert self.join is not None and self.compute is not None
                self.checkpoints = stage_checkpointer(
                    self.cfg.checkpoint_dir, self.cfg.checkpoint_every_rounds, self.join.run,
                    self.stage, self.compute.model,
                )  # fmt: skip
            await save_stage_state(
                self.checkpoints, self.worker, self.outer.link, in_flight=self.outer.in_flight,
                final=final,
            )  # fmt: skip

    async def _build_stage(self) -> None:
        assert self.join is not None
        run = self.join.run
        model_cfg = preset(run.model_preset).replace(seed=run.seed)
        inner = InnerConfig(
            lr=self.cfg.lr,
            warmup_steps=self.cfg.warmup_steps,
            weight_decay=self.cfg.weight_decay,
            inner_batch_tokens=self.cfg.inner_batch_tokens,
            cache_size=self.cfg.activation_cache,
        )
        self.compute = await self.worker.run(
            StageCompute, model_cfg, self.stage, run.n_stages, run.codec, inner, self.device
        )
        self.throughput = await self.worker.run(
            throughput_probe, self.compute, self.cfg.micro_batch, self.cfg.seq_len
        )
        self._built.set()
        p2p = getattr(self.transport, "cfg", None)  # Libp2pTransport's P2PConfig
        self.state_server = StateServer(
            self.worker,
            run_id=run.run_id,
            stage=lambda: self.stage,
            params=self.compute.parameters,
            outer=self.cfg.outer_every_steps > 0,
            max_frame=int(getattr(p2p, "max_frame", DEFAULT_MAX_FRAME)),
        )
        self.transport.set_handler(STATE_PROTOCOL, self.state_server.handle)
        self.transport.set_membership(lambda peer: peer in self.members)  # type: ignore[attr-defined]
        log.info("node: stage %d built; %.0f tokens/s measured", self.stage, self.throughput)

    async def _leave(self) -> None:
        with trio.move_on_after(self.cfg.drain_timeout_s) as scope:
            scope.shield = True
            for lease in list(self.leases.values()):
                await self._release(lease)
            try:
                await self.client.leave()
                log.info(
                    "node: left the run (%d tokens trained, %d committed)",
                    self.stats.tokens_trained, self.stats.tokens_committed,
                )  # fmt: skip
                self.events.emit(
                    "left", tokens_trained=self.stats.tokens_trained,
                    tokens_committed=self.stats.tokens_committed,
                )  # fmt: skip
            except (CoordinatorError, CoordinatorUnavailable) as exc:
                log.warning("node: could not say goodbye to the coordinator: %s", exc)

    async def _deadline_watch(self) -> None:
        assert self.cfg.deadline is not None
        # Leave with enough time to finish in-flight work before the walltime ends.
        margin = self.cfg.drain_timeout_s + 2 * self.cfg.request_timeout_s
        await trio.sleep(max(0.0, self.cfg.deadline - margin - time.time()))
        log.info("node: deadline in %.0f s: draining", self.cfg.deadline - time.time())
        self.drain()

    # --- coordinator loops -----------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        await self.client.heartbeat_loop(
            lambda: [LeaseRef(lease_id=i, epoch=le.epoch) for i, le in self.leases.items()],
            on_reply=self._on_heartbeat,
            on_rejoin=self._on_rejoin,
            # the measured rate: the coordinator sizes deadline-bound leases with it
            throughput=lambda: self.throughput or None,
        )

    async def _on_heartbeat(self, reply: HeartbeatReply) -> None:
        for ref in reply.fenced:
            if ref.lease_id in self.leases:
                log.warning("node: lease %d was fenced; dropping its work", ref.lease_id)
                self._forget_lease(ref.lease_id, fenced=True)
        if reply.drain:
            self.drain()
        if reply.membership_version != self.membership_version:
            await self._refresh_membership()

    async def _on_rejoin(self, joined: JoinReply) -> None:
        # A lapsed membership means our leases were fenced; drop them all.
        for lease_id in list(self.leases):
            self._forget_lease(lease_id, fenced=True)
        if joined.stage != self.stage:
            log.warning("node: re-joined on stage %d, not %d; leaving", joined.stage, self.stage)
            self.drain()

    async def _membership_loop(self) -> None:
        assert self.join is not None
        while True:
            await trio.sleep(max(1.0, self.join.run.heartbeat_interval_s))
            try:
                await self._refresh_membership()
            except (CoordinatorError, CoordinatorUnavailable) as exc:
                log.debug("node: membership refresh failed: %s", exc)

    async def _refresh_membership(self) -> None:
        view = await self.client.membership()
        for peer in view.peers.values():
            if peer.addrs and peer.peer_id not in self.members:
                self.transport.add_peer_addrs(peer.peer_id, peer.addrs)
        before = set(self._next_stage_peers())
        self.members = dict(view.peers)
        self.router.forget(set(self.members))
        self.membership_version = view.version
        after = set(self._next_stage_peers())
        if after != before:  # the last stage has no next stage: always empty
            log.info(
                "node: membership v%d: %d peers on stage %d (+%d, -%d)",
                view.version,
                len(after),
                self.stage + 1,
                len(after - before),
                len(before - after),
            )

    def _next_stage_peers(self) -> list[str]:
        want = self.stage + 1
        me = self.transport.peer_id
        return [
            p
            for p, info in self.members.items()
            if info.stage == want and p != me and not info.observer
        ]

    # --- stage 0: the driver ---------------------------------------------------------------

    async def _drive(self) -> None:
        """Stage 0: keep `lease_pool` leases open and cut micro-batches from their windows,
        mixed (`shuffle_windows`) so one inner step sees many places of the corpus, with
        `in_flight` micro-batches in the pipeline. A lease commits once its windows are done
        (the contiguous prefix of finished windows, so in order it commits as it goes)."""
        pool: list[Window] = []  # windows of open leases not yet in a micro-batch
        rng = random.Random(self.transport.peer_id)
        slots = trio.Semaphore(self.cfg.in_flight)
        no_grant_until = 0.0  # trio time before which asking for a lease is pointless
        async with trio.open_nursery() as nursery:
            while True:
                pool[:] = [w for w in pool if w.lease.lease_id not in self._fenced]
                if self._draining.is_set():
                    # Finish the open leases (so their windows commit, not go to waste)
                    # within half the drain budget; what is left is released.
                    half = self._drain_deadline - self.cfg.drain_timeout_s / 2
                    if not pool or trio.current_time() > half:
                        break
                elif (
                    self.cfg.max_tokens is not None
                    and self.stats.tokens_committed >= self.cfg.max_tokens
                ):
                    log.info("node: reached max_tokens=%d; draining", self.cfg.max_tokens)
                    self.drain()
                    continue
                elif (
                    len({w.lease.lease_id for w in pool}) < self.cfg.lease_pool
                    and trio.current_time() >= no_grant_until
                ):
                    lease = await self._acquire()
                    if lease is not None:
                        pool.extend(await self._open_lease(lease))
                        continue
                    no_grant_until = trio.current_time() + IDLE_WAIT_S * 4
                    if not pool and self.outer is not None:
                        # Out of work: trained windows may be waiting for a round (and
                        # the coordinator's per-peer lease cap for their commit).
                        self.outer.request_early_round()
                if not pool:
                    with trio.move_on_after(IDLE_WAIT_S * 4):
                        await self._draining.wait()
                    continue
                await slots.acquire()
                take = min(self.cfg.micro_batch, len(pool))
                shuffle = self.cfg.shuffle_windows
                batch = [pool.pop(rng.randrange(len(pool)) if shuffle else 0) for _ in range(take)]
                nursery.start_soon(self._microbatch, batch, slots)
            # In-flight micro-batches finish (or give up); windows never trained stay
            # uncommitted, and their leases are released at the commit point.

    async def _acquire(self) -> LeaseInfo | None:
        try:
            grant = await self.client.acquire_grant()
        except (CoordinatorError, CoordinatorUnavailable) as exc:
            log.warning("node: lease request failed: %s", exc)
            return None
        if grant.lease is None:
            log.debug("node: no lease granted (%s)", grant.reason)
        return grant.lease

    async def _shard(self, shard_id: int) -> bytes:
        if shard_id not in self._shards:
            data = await self.client.fetch_shard(shard_id)  # sha256-checked
            if len(self._shards) >= max(4, 2 * self.cfg.lease_pool):
                self._shards.pop(next(iter(self._shards)))
            self._shards[shard_id] = data
        return self._shards[shard_id]

    async def _open_lease(self, lease: LeaseInfo) -> list[Window]:
        """Track a granted lease; its windows (seq_len + 1 bytes every seq_len tokens)."""
        self.leases[lease.lease_id] = lease
        shard = await self._shard(lease.shard_id)
        progress = LeaseProgress(committed=lease.committed, end=lease.limit)
        self._progress[lease.lease_id] = progress
        t = self.cfg.seq_len
        starts = [s for s in range(lease.committed, lease.limit, t) if s + t + 1 <= len(shard)]
        tail = starts[-1] + t if starts else lease.committed
        if tail < lease.limit:  # too short for a window (the shard's end): nothing to train
            progress.finish(tail, lease.limit)
        log.info(
            "node: training lease %d (shard %d, tokens %d..%d, epoch %d)",
            lease.lease_id, lease.shard_id, lease.committed, lease.limit, lease.epoch,
        )  # fmt: skip
        return [Window(lease, shard, s) for s in starts]

    async def _microbatch(self, batch: list[Window], slots: trio.Semaphore) -> None:
        try:
            t = self.cfg.seq_len
            rows = np.stack(
                [np.frombuffer(w.shard, dtype=np.uint8)[w.start : w.start + t + 1] for w in batch]
            )
            first = batch[0]
            mb_id = f"{first.lease.lease_id}.{first.lease.epoch}.{first.start}"
            leases = {w.lease.lease_id: w.lease for w in batch}
            loss = await self._through_pipeline(mb_id, rows, list(leases.values()))
            if loss is None:  # fenced or draining: not finished, not committed
                return
            self.stats.losses.append(loss)
            metrics.LOSS.set(self.stats.loss or loss)  # mean of the last 32
            metrics.MICROBATCHES.labels("done").inc()
            for w in batch:
                progress = self._progress.get(w.lease.lease_id)
                if progress is not None and w.lease.lease_id not in self._fenced:
                    progress.finish(w.start, min(w.start + t, w.lease.limit))
            # No outer loop: finished windows are committed. With one, only the round that
            # covers them commits them (also while the outer loop moves or restarts).
            if self.cfg.outer_every_steps == 0:
                for lease in leases.values():
                    progress = self._progress.get(lease.lease_id)
                    if progress is not None:
                        await self._commit(lease, progress, upto=progress.commit_point())
        finally:
            slots.release()

    async def _through_pipeline(
        self, mb_id: str, rows: np.ndarray, leases: list[LeaseInfo]
    ) -> float | None:
        """Run one micro-batch through the downstream stages until it returns once.

        None means it was given up: its lease was fenced, or the node is draining and
        the micro-batch failed `max_attempts` times or outlived the drain deadline.
        """
        assert self.compute is not None
        tokens = TensorFrame.from_numpy(rows)
        backoff = IDLE_WAIT_S
        tried: set[str] = set()
        failures = 0
        while not all(lease.lease_id in self._fenced for lease in leases):
            if self._draining.is_set() and (
                failures >= self.cfg.max_attempts or trio.current_time() > self._drain_deadline
            ):
                return None
            peer = self._pick_next(tried)
            if peer is not None:
                hidden = await self.worker.run(self.compute.forward, mb_id, rows, None)
                assert isinstance(hidden, EncodedTensor)
                reply = await self._send_forward(
                    peer, mb_id, tokens, hidden, [self.transport.peer_id]
                )
                if reply is not None:
                    await self.worker.run(self.compute.backward, mb_id, rows, None, reply.grad)
                    self._account_bytes()
                    self._count_tokens(rows)
                    return reply.loss
                await self.worker.run(self.compute.drop, mb_id)
                metrics.MICROBATCHES.labels("retried").inc()
            failures += 1
            await trio.sleep(backoff)
            backoff = min(backoff * 2, 8.0)
        return None

    def _pick_next(self, tried: set[str]) -> str | None:
        """A next-stage peer not yet tried for this micro-batch (all again once exhausted)."""
        candidates = self._next_stage_peers()
        if tried and tried.issuperset(candidates):
            tried.clear()
        peer = self.router.choose(candidates, trio.current_time(), exclude=tried)
        if peer is not None:
            tried.add(peer)
        return peer

    async def _send_forward(
        self, peer: str, mb_id: str, tokens: TensorFrame, hidden: EncodedTensor, route: list[str]
    ) -> Backward | None:
        """One attempt through `peer`; None if it failed (the peer is then avoided)."""
        info = self.members.get(peer)
        msg = Forward(
            mb_id=mb_id,
            tokens=tokens,
            hidden=hidden,
            route=route,
            deadline=time.time() + self.cfg.request_timeout_s,
        )
        self.router.started(peer)
        metrics.IN_FLIGHT.inc()
        t0 = trio.current_time()
        try:
            reply = await self.transport.request(
                peer,
                info.addrs if info else [],
                FORWARD_PROTOCOL,
                msg,
                timeout=self.cfg.request_timeout_s,
            )
            if not isinstance(reply, Backward) or reply.mb_id != mb_id:
                raise TransportError(f"peer {peer} answered {type(reply).__name__}", peer_id=peer)
        except TransportError as exc:
            ban = self.router.failed(peer, trio.current_time())
            log.warning("node: %s failed via %s (%s); avoiding it for %.0fs", mb_id, peer, exc, ban)
            self.events.emit("forward_failed", mb_id=mb_id, peer=peer, error=str(exc)[:200])
            return None
        finally:
            metrics.IN_FLIGHT.dec()
        elapsed = trio.current_time() - t0
        self.router.succeeded(peer, elapsed, trio.current_time())
        metrics.MB_SECONDS.observe(elapsed)
        return reply

    async def _commit(self, lease: LeaseInfo, progress: LeaseProgress, *, upto: int) -> None:
        """Commit the lease's range up to `upto` (monotonic; a no-op if already there)."""
        async with self._commit_lock:
            point = min(upto, progress.commit_point())
            if point <= progress.committed or lease.lease_id in self._fenced:
                return
            try:
                await self.client.commit(lease, progress.committed, point)
            except FencedError as exc:
                log.warning("node: lease %d fenced at commit: %s", lease.lease_id, exc)
                self._forget_lease(lease.lease_id, fenced=True)
                return
            metrics.COMMITTED.inc(point - progress.committed)
            self.events.emit(
                "lease_committed", lease_id=lease.lease_id, shard_id=lease.shard_id,
                start=progress.committed, end=point,
            )  # fmt: skip
            self.stats.tokens_committed += point - progress.committed
            progress.accept(point)
            if progress.complete:
                log.info("node: lease %d complete", lease.lease_id)
                self._forget_lease(lease.lease_id)

    def _forget_lease(self, lease_id: int, *, fenced: bool = False) -> None:
        if fenced:
            self._fenced.add(lease_id)
        self.leases.pop(lease_id, None)
        self._progress.pop(lease_id, None)

    async def _release(self, lease: LeaseInfo) -> None:
        try:
            await self.client.release(lease)
            log.info("node: released lease %d", lease.lease_id)
        except (CoordinatorError, CoordinatorUnavailable) as exc:
            log.warning("node: could not release lease %d: %s", lease.lease_id, exc)
        self._forget_lease(lease.lease_id)

    # --- stages > 0: serving ---------------------------------------------------------------

    async def _serve_forward(self, peer_id: str, msg: Message) -> Message:
        if not isinstance(msg, Forward):
            raise ProtocolError(f"expected a forward message, got {type(msg).__name__}")
        with trio.move_on_after(max(0.0, msg.deadline - time.time())):
            await self._built.wait()  # a forward that arrived while the stage was built
        if self.compute is None or self.stage == 0:
            raise ProtocolError("this peer serves stage 0, which takes no forward input")
        rows = msg.tokens.to_numpy(expect_dtype="uint8", expect_shape=(None, None))
        if not 1 <= rows.shape[0] <= MAX_ROWS or not 2 <= rows.shape[1] <= self._max_seq + 1:
            raise ProtocolError(f"token block of shape {list(rows.shape)} is out of bounds")
        if self.compute.is_last:
            grad, loss = await self.worker.run(self.compute.forward, msg.mb_id, rows, msg.hidden)  # type: ignore[misc]
            assert grad is not None
            self._account_bytes()
            self._count_tokens(rows)
            return Backward(mb_id=msg.mb_id, grad=grad, loss=loss, tokens=rows.size - rows.shape[0])
        hidden = await self.worker.run(self.compute.forward, msg.mb_id, rows, msg.hidden)
        assert isinstance(hidden, EncodedTensor)
        route = [*msg.route, self.transport.peer_id]
        tried: set[str] = set()
        with trio.fail_after(max(0.0, msg.deadline - time.time())):
            reply = None
            while reply is None:
                peer = self._pick_next(tried)
                if peer is not None:
                    reply = await self._send_forward(peer, msg.mb_id, msg.tokens, hidden, route)
                if reply is None:
                    await trio.sleep(IDLE_WAIT_S)
        grad_in = await self.worker.run(
            self.compute.backward, msg.mb_id, rows, msg.hidden, reply.grad
        )
        assert grad_in is not None
        self._account_bytes()
        return Backward(mb_id=msg.mb_id, grad=grad_in, loss=reply.loss, tokens=reply.tokens)

    @property
    def _max_seq(self) -> int:
        assert self.compute is not None
        return self.compute.model.config.max_seq_len

    def _count_tokens(self, rows: np.ndarray) -> None:
        n = rows.shape[0] * (rows.shape[1] - 1)
        self.stats.tokens_trained += n
        metrics.TOKENS.inc(n)

    def _account_bytes(self) -> None:
        """Move the codecs' byte counts into the Prometheus counters."""
        assert self.compute is not None
        counts = self.compute.bytes_counts()
        for key, value in counts.items():
            kind, direction = key.split("_")
            metrics.BYTES.labels(direction, kind).inc(value - self._bytes_seen.get(key, 0))
        self._bytes_seen = counts
        wire = counts["wire_fwd"] + counts["wire_bwd"]
        if wire:
            metrics.COMPRESSION.set((counts["raw_fwd"] + counts["raw_bwd"]) / wire)
