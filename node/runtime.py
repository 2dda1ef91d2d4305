"""A training node's life: join, build its stage, serve and train, drain and leave.

`Node` only wires the node's objects and owns their lifecycle; each job has its module:
- `node.peer_view.PeerView`: the run's members as the coordinator reports them;
- `node.pipeline_hop.PipelineHop`: sends and serves `/agora/fwd/1` (one micro-batch hop);
- `node.stage0_driver.Stage0Driver` over `node.lease_pool.LeasePool`: stage 0's leases,
  micro-batches and commits;
- `node.outer_loop.OuterLoop`: the DiLoCo outer process and its rounds;
- `node.state_server.StateServer` (`/agora/state/1`) and `node.checkpoint`: the global
  state each applied round hands out, served to members and written to disk.
Trio owns everything here; torch work goes to the one `TorchWorker` thread. The tasks: the
heartbeat loop (renews membership and leases, learns fences, moves and drains), the
membership loop, the outer loop, the deadline watch, and stage 0's driver.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import trio

from node import metrics
from node.checkpoint import (
    CheckpointHook,
    GlobalState,
    flat_copy,
    stage_checkpointer,
    write_tokenizer,
)
from node.config import NodeConfig
from node.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorUnavailable,
    JoinRefused,
)
from node.drain import Drain
from node.events import EventLog
from node.lease_pool import LeasePool, RoundFacts
from node.outer_loop import OuterLoop
from node.p2p.transport import Transport
from node.peer_view import PeerView
from node.pipeline_hop import PipelineHop
from node.routing import Router
from node.stage0_driver import Stage0Driver
from node.stage_compute import StageCompute, build_stage_compute, memory_report
from node.state_server import StateServer
from node.worker import TorchWorker
from protocol.control import HeartbeatReply, JoinReply, JoinRequest
from protocol.corpus import VOCAB_SIZE, token_width
from protocol.errors import ProtocolError
from protocol.lineage import Link
from protocol.pipeline import FORWARD_PROTOCOL
from protocol.state import STATE_PROTOCOL

log = logging.getLogger(__name__)


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
        self.worker = TorchWorker(on_cpu=metrics.TORCH_CPU.inc)
        self.events = EventLog(cfg.events_file)
        self.drain_state = Drain(cfg.drain_timeout_s, self.events)
        self.pool = LeasePool(
            seq_len=cfg.seq_len, max_open=cfg.lease_pool, shard_cache=max(4, 2 * cfg.lease_pool)
        )
        self.router = Router(affinity=cfg.route_affinity)
        self.join: JoinReply | None = None
        # Wired at the join, when the stage is known:
        self.peers: PeerView | None = None
        self.hop: PipelineHop | None = None
        self.driver: Stage0Driver | None = None  # stage 0 only
        self.compute: StageCompute | None = None  # once the stage is built
        self.outer: OuterLoop | None = None  # None when outer_every_steps = 0
        self.state_server: StateServer | None = None
        self.checkpoint: CheckpointHook | None = None  # with --checkpoint-dir
        self.initial: GlobalState | None = None  # the stage's weights as built, until used
        self.throughput = 0.0  # measured tokens/s of this stage

    @property
    def stage(self) -> int:
        assert self.join is not None
        return self.join.stage

    @property
    def draining(self) -> bool:
        return self.drain_state.started

    def drain(self, why: str = "") -> None:
        """Begin a graceful exit: finish in-flight work, commit, release, leave."""
        self.drain_state.start(why)

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Join and train until drained. A refused join (auth, ban, no stage that fits the
        device's memory) raises `JoinRefused`: the node cannot take part."""
        try:
            memory = await self.worker.run(memory_report, self.cfg, self.device)
            self.join = await self.client.join(
                JoinRequest(
                    addrs=self.transport.listen_addrs,
                    device=self.device,
                    deadline=self.cfg.deadline,
                    stage=self.cfg.stage,
                    join_token=self.cfg.join_token,
                    metrics_port=self.cfg.metrics_port or None,
                    memory=memory,
                )
            )
        except CoordinatorError as exc:
            self.worker.close()
            self.events.close()
            raise JoinRefused(exc.code, exc.detail) from None
        run = self.join.run
        log.info(
            "node: joined run %s as %s on stage %d/%d (preset %s, codec %s)",
            run.run_id, self.join.peer_id, self.stage, run.n_stages, run.model_preset, run.codec,
        )  # fmt: skip
        self.events.emit(
            "joined", peer_id=self.join.peer_id, stage=self.stage, n_stages=run.n_stages,
            run_id=run.run_id,
        )  # fmt: skip
        metrics.STAGE.set(self.stage)
        peers = self.peers = PeerView(self.transport, self.router, stage=self.stage)
        hop = self.hop = PipelineHop(
            self.transport, peers, self.worker, request_timeout_s=self.cfg.request_timeout_s,
            max_rows=self.cfg.micro_batch, events=self.events, witness=self.client.witness,
        )  # fmt: skip
        self.transport.set_membership(peers.is_member)  # nobody else is ever served
        try:
            async with trio.open_nursery() as nursery:
                # Heartbeats start first: building the stage may take longer than the TTL.
                nursery.start_soon(self._heartbeat_loop)
                await self._refresh_members(peers)
                # Serve forwards from now on: peers see this node in the membership view
                # before its stage is built, and a forward that waits for the build is
                # better than a refused protocol (which bans this node for a while).
                self.transport.set_handler(FORWARD_PROTOCOL, hop.serve_forward)
                await self._build_stage(hop)
                await self._refresh_members(peers)
                if self.stage == 0:
                    self.driver = Stage0Driver.for_node(
                        self.cfg, self.pool, hop, self.client, self.drain_state,
                        seed=self.transport.peer_id, events=self.events,
                        token_bytes=token_width(run.vocab_size or VOCAB_SIZE),
                    )  # fmt: skip
                    self.driver.on_out_of_work = self._request_early_round
                if self.cfg.outer_every_steps > 0:
                    assert self.compute is not None
                    self.outer = OuterLoop.for_node(
                        self.cfg, self.worker, self.compute, peers, run,
                        snapshot=self.pool.snapshot, on_state=self._on_global_state,
                        announce_dht=self.client.announce_dht, events=self.events,
                        on_replaced=self._on_state_replaced, attested=self._attested,
                        waiting=lambda: self.pool.held > 0,
                        identity=self.client.key.libp2p_private_key(),
                        accuse=self.client.accuse, credit=lambda: self.client.credit,
                    )  # fmt: skip
                    initial, self.initial = self.initial, None
                    await self.outer.start(initial=initial)
                    nursery.start_soon(self.outer.run)
                nursery.start_soon(peers.follow, self.client, max(1.0, run.heartbeat_interval_s))
                if self.cfg.deadline is not None:
                    nursery.start_soon(self._deadline_watch)
                task_status.started()
                if self.driver is not None:
                    await self.driver.run()
                else:
                    await self.drain_state.wait()
                if self.outer is not None:
                    # Finish the outer round so the last progress (and its commits) lands.
                    await self.outer.finish(self.cfg.drain_timeout_s)
                    if self.checkpoint is not None and self.outer.state is not None:
                        await self.checkpoint(self.outer.state, final=True)
                elif self.checkpoint is not None and self.compute is not None:
                    # No outer loop, so no rounds: the trained weights are the state.
                    flat = await self.worker.run(flat_copy, list(self.compute.parameters()))
                    await self.checkpoint(
                        GlobalState(theta_g=flat, momentum=None, round=0), final=True
                    )
                nursery.cancel_scope.cancel()
        finally:
            await self._leave()
            if self.outer is not None:
                await trio.to_thread.run_sync(self.outer.close)
            self.worker.close()
            self.events.close()

    # --- wiring ------------------------------------------------------------------------

    async def _build_stage(self, hop: PipelineHop) -> None:
        assert self.join is not None
        run = self.join.run
        compute, self.throughput = await self.worker.run(
            build_stage_compute, run, self.stage, self.cfg, self.device
        )
        self.compute = compute
        if self.cfg.outer_every_steps > 0:
            # The stage's round 0 is its seeded initial weights, the same bits on every
            # replica; a stage > 0 trains on forwards from the next line on, before its
            # outer loop starts.
            flat = await self.worker.run(flat_copy, list(compute.parameters()))
            self.initial = GlobalState(theta_g=flat, momentum=None, round=0)
        hop.stage_built(compute)
        self.state_server = StateServer(
            self.worker,
            run_id=run.run_id,
            stage=lambda: self.stage,
            params=compute.parameters,
            outer=self.cfg.outer_every_steps > 0,
            max_frame=self.transport.max_frame,
        )
        self.transport.set_handler(STATE_PROTOCOL, self.state_server.handle)
        if self.cfg.checkpoint_dir is not None:
            self.checkpoint = CheckpointHook(
                stage_checkpointer(self.cfg.checkpoint_dir, self.cfg.checkpoint_every_rounds,
                                   run, self.stage, compute.model),
                self.worker,
            )  # fmt: skip
            if run.tokenizer_hash:
                await self._keep_tokenizer(run.tokenizer_hash, self.cfg.checkpoint_dir)
        log.info("node: stage %d built; %.0f tokens/s measured", self.stage, self.throughput)

    async def _keep_tokenizer(self, sha256: str, directory: Path) -> None:
        """Write the run's tokenizer.json (hash-checked) beside the checkpoints, so an
        export from them carries it; a failure costs the export that file, not the run."""
        try:
            data = await self.client.fetch_tokenizer(sha256)
            await trio.to_thread.run_sync(write_tokenizer, directory, data)
        except (CoordinatorError, CoordinatorUnavailable, ProtocolError, OSError) as exc:
            log.warning("node: could not keep the run's tokenizer in %s: %s", directory, exc)

    async def _refresh_members(self, peers: PeerView) -> None:
        try:
            await peers.refresh(self.client)
        except (CoordinatorError, CoordinatorUnavailable) as exc:
            # E.g. not_member: the membership lapsed while the stage was built (the
            # heartbeat loop re-joins); the membership loop retries.
            log.warning("node: membership refresh failed: %s", exc)

    def _request_early_round(self) -> None:
        if self.outer is not None:
            self.outer.request_early_round()

    async def _on_global_state(self, state: GlobalState, facts: RoundFacts | None) -> None:
        """A state was loaded (`facts` None) or a round's result came in: persist and serve
        a new state, then let stage 0's commit rule commit what reached it."""
        changed = facts is None or facts.applied
        if state.digest:  # the coordinator attests the stage's state from these reports
            self.client.report_state(state.round, state.digest)
        if facts is not None and facts.applied and self.checkpoint is not None:
            await self.checkpoint(state)
        if changed and self.state_server is not None:
            self.state_server.hold(state)
        if facts is not None and self.driver is not None:
            await self.driver.round_result(facts)

    def _attested(self) -> tuple[int, str] | None:
        ref = self.client.attested
        return (ref.round, ref.digest) if ref is not None else None

    async def _on_state_replaced(self, lineage: tuple[Link, ...]) -> None:
        """The outer loop moved and took another replica's state (chain `lineage`): the
        ranges that this replica's held lone rounds carried, unless that state descends
        from them, are gone from it and are trained again."""
        returned = self.pool.state_replaced(lineage)
        if self.driver is not None:
            self.driver.ranges_returned(returned, "left with the replaced state")

    # --- leaving -----------------------------------------------------------------------

    async def _leave(self) -> None:
        with trio.move_on_after(self.cfg.drain_timeout_s) as scope:
            scope.shield = True
            if self.driver is not None:
                await self.driver.release_all()
            try:
                await self.client.leave()
            except (CoordinatorError, CoordinatorUnavailable) as exc:
                log.warning("node: could not say goodbye to the coordinator: %s", exc)
        trained = self.hop.tokens_trained if self.hop is not None else 0
        log.info(
            "node: left the run (%d tokens trained, %d committed)",
            trained, self.pool.tokens_committed,
        )  # fmt: skip
        self.events.emit(
            "left", tokens_trained=trained, tokens_committed=self.pool.tokens_committed
        )

    async def _deadline_watch(self) -> None:
        assert self.cfg.deadline is not None
        # Leave with enough time to finish in-flight work before the walltime ends.
        margin = self.cfg.drain_timeout_s + 2 * self.cfg.request_timeout_s
        await trio.sleep(max(0.0, self.cfg.deadline - margin - time.time()))
        self.drain_state.start(f"deadline in {self.cfg.deadline - time.time():.0f} s")

    # --- coordinator loops -------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        await self.client.heartbeat_loop(
            self.pool.refs,
            on_reply=self._on_heartbeat,
            on_rejoin=self._on_rejoin,
            # the measured rate: the coordinator sizes deadline-bound leases with it
            throughput=lambda: self.throughput or None,
        )

    async def _on_heartbeat(self, reply: HeartbeatReply) -> None:
        for ref in reply.fenced:
            if self.pool.fence(ref.lease_id):
                log.warning("node: lease %d was fenced; dropping its work", ref.lease_id)
        if reply.drain:
            self.drain_state.start("the coordinator asked us to")
        if self.peers is not None and reply.membership_version != self.peers.version:
            await self.peers.refresh(self.client)

    async def _on_rejoin(self, joined: JoinReply) -> None:
        # A lapsed membership means our leases were fenced; drop them all.
        self.pool.fence_all()
        if joined.stage != self.stage:
            log.warning("node: re-joined on stage %d, not %d; leaving", joined.stage, self.stage)
            self.drain_state.start("moved to another stage")
