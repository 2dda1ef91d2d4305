"""The node's outer loop over its lifetime: start the outer process, find the run's DHT,
load the stage's state, tick rounds, and hand each new global state to the node.

A run's nodes may start at the same moment, each with a DHT of its own; before its first
round a node moves to the run's canonical DHT (the member with the smallest peer id that
announces one, `PeerView.dht_root`), restarting its outer process, at most
`MAX_DHT_MOVES` times. Training goes on during a move, and the progress is kept (a
rebase onto the state found there). Every state the loop loads reaches `on_state` as a
`GlobalState` value with None, and every round's result with its `RoundFacts` (the
state may be unchanged: `facts.applied`); nothing outside this module touches the
`OuterLink`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from node.checkpoint import GlobalState, resume_state
from node.config import NodeConfig
from node.diloco import DilocoConfig
from node.events import EventLog
from node.lease_pool import RoundFacts, RoundMark
from node.outer_link import OuterConfig, OuterLinkError
from node.outer_rounds import OuterRounds
from node.peer_view import PeerView
from node.stage_compute import StageCompute
from node.worker import TorchWorker
from protocol.control import RunInfo

log = logging.getLogger(__name__)

# Moves to the run's DHT root before the first round (each restarts the outer process);
# past this a node stays where it is (e.g. a root that is dead but not yet lapsed).
MAX_DHT_MOVES = 3
POLL_S = 0.2  # seconds between ticks

OnState = Callable[[GlobalState, RoundFacts | None], Awaitable[None]]


class OuterLoop:
    def __init__(
        self,
        worker: TorchWorker,
        compute: StageCompute,
        peers: PeerView,
        *,
        run: RunInfo,
        config: OuterConfig,
        every_steps: int,  # inner steps between rounds
        tokens_per_step: int,  # tokens of one inner step of one replica
        snapshot: Callable[[], RoundMark],  # marks a round's start for the lease pool
        on_state: OnState,
        announce_dht: Callable[[list[str]], None],
        checkpoint_dir: Path | None = None,  # resume from a checkpoint of the stage here
        events: EventLog | None = None,
    ) -> None:
        self.worker = worker
        self.compute = compute
        self.peers = peers
        self.run_info = run
        self.config = config
        self.every_steps = every_steps
        self.tokens_per_step = tokens_per_step
        self._snapshot = snapshot
        self._on_state = on_state
        self._announce_dht = announce_dht
        self.checkpoint_dir = checkpoint_dir
        self.events = events or EventLog()
        self.rounds: OuterRounds | None = None  # only a loaded outer process
        self.state: GlobalState | None = None  # the newest loaded or applied state
        self._bootstrap = ""  # peer id whose DHT our outer process joined (or ours)

    @classmethod
    def for_node(
        cls,
        cfg: NodeConfig,
        worker: TorchWorker,
        compute: StageCompute,
        peers: PeerView,
        run: RunInfo,
        *,
        snapshot: Callable[[], RoundMark],
        on_state: OnState,
        announce_dht: Callable[[list[str]], None],
        events: EventLog | None = None,
    ) -> OuterLoop:
        """The outer loop with a node's settings."""
        return cls(
            worker, compute, peers, run=run, config=outer_config(cfg),
            every_steps=cfg.outer_every_steps, tokens_per_step=cfg.inner_batch_tokens,
            snapshot=snapshot, on_state=on_state, announce_dht=announce_dht,
            checkpoint_dir=cfg.checkpoint_dir, events=events,
        )  # fmt: skip

    def round_target(self) -> int:
        """Tokens a full round gathers: every replica of the stage trains `every_steps`
        inner steps (the participation rule of docs/outer-loop.md)."""
        return self.peers.replicas() * self.every_steps * self.tokens_per_step

    def request_early_round(self) -> None:
        if self.rounds is not None:
            self.rounds.request_early_round()

    async def start(self, carry: GlobalState | None = None) -> None:
        """Start the outer process, load the stage's state, announce its DHT. `carry` is
        the state of the outer process this one replaces (a DHT move)."""
        me = self.peers.me
        root = self.peers.dht_root()
        bootstrap = self.peers.dht_bootstrap()
        self._bootstrap = root.peer_id if root is not None else me
        try:
            rounds = await self._start_process(bootstrap)
        except (OuterLinkError, TimeoutError, OSError) as exc:
            if not bootstrap:
                raise
            # Every announced DHT is gone: start one of our own; the next root check
            # (before the first round) moves us to the run's DHT again.
            log.warning("outer: no member's DHT answered (%s); starting our own", exc)
            self._bootstrap = me
            rounds = await self._start_process([])
        resume = carry
        if resume is None and self.checkpoint_dir is not None:
            resume = await trio.to_thread.run_sync(
                resume_state, self.checkpoint_dir, self.run_info, self.peers.stage,
                self.compute.model,
            )  # fmt: skip
        state = await rounds.load_state(
            replicas_exist=self.peers.other_replicas_have_dht(),
            resume=resume,
            keep_progress=carry is not None,
        )
        self.state = state
        await self._on_state(state, None)
        # Only a loaded outer process is visible to rounds and drains: the link runs one
        # operation at a time.
        self.rounds = rounds
        self._announce_dht(rounds.link.dht_addrs())  # other nodes bootstrap from it

    async def _start_process(self, bootstrap: list[str]) -> OuterRounds:
        return await OuterRounds.start(
            self.worker,
            self.compute,
            run_id=self.run_info.run_id,
            stage=self.peers.stage,
            initial_peers=bootstrap,
            config=self.config,
            every_steps=self.every_steps,
            snapshot=self._snapshot,
            on_round=self._round_done,
            sole_replica=lambda: self.peers.replicas() <= 1,
            target_tokens=self.round_target,
            events=self.events,
        )

    async def _round_done(self, state: GlobalState, facts: RoundFacts) -> None:
        if facts.applied:
            self.state = state
        await self._on_state(state, facts)

    async def run(self) -> None:
        """Tick rounds until cancelled; move to the run's DHT before the first round."""
        moves = 0
        while True:
            await trio.sleep(POLL_S)
            rounds = self.rounds
            assert rounds is not None, "start() before run()"
            root = self.peers.dht_root()
            if (
                rounds.rounds == 0
                and not rounds.in_flight
                and root is not None
                and root.peer_id != self._bootstrap
                and moves < MAX_DHT_MOVES
            ):
                moves += 1
                log.info(
                    "outer: moving to the run's DHT at %s before the first round", root.peer_id
                )
                self.rounds = None
                # Training goes on during the move: keep that progress (a rebase onto the
                # state found there), since its micro-batches will be committed.
                carry = await self.worker.run(rounds.capture)
                await trio.to_thread.run_sync(rounds.close)
                await self.start(carry=carry)
                # Check the root again before a round: a move that fell back to a DHT of
                # our own must not be sealed by a first round taken alone.
                continue
            await rounds.tick()

    async def finish(self, timeout_s: float) -> None:
        """Drain: finish the round in flight and one more that covers the rest."""
        if self.rounds is not None:
            await self.rounds.finish(timeout_s)

    def close(self) -> None:
        if self.rounds is not None:
            self.rounds.close()


def outer_config(cfg: NodeConfig) -> OuterConfig:
    """The outer process's settings from the node's."""
    return OuterConfig(
        compression=cfg.outer_compression,
        matchmaking_s=cfg.outer_matchmaking_s,
        request_timeout_s=min(1.0, cfg.outer_matchmaking_s / 2),
        round_timeout_s=cfg.outer_timeout_s,
        state_timeout_s=cfg.outer_state_timeout_s,
        diloco=DilocoConfig(
            eta=cfg.outer_lr,
            mu=cfg.outer_momentum,
            participation_power=cfg.outer_participation_power,
        ),
    )
