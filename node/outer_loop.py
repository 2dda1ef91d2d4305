"""The node's outer loop over its lifetime: start the outer process, find the run's DHT,
load the stage's state, tick rounds, and hand each new global state to the node.

A run's nodes may start at the same moment, each with a DHT of its own, so a node moves
to the run's canonical DHT (the member the coordinator assigns, `PeerView.dht_root`:
the first member to announce one, directly reachable first) by
restarting its outer process, joining the members' DHTs (root
first):
- before its first round, when the root is not the DHT it joined;
- later, when it finds itself on a DHT of its own while other replicas of its stage
  announce one: `LONE_ROUNDS_TO_MOVE` rounds in a row without a groupmate (nor a newer
  state downloaded from its DHT, which shows another replica there) and the root
  is not the DHT it joined, or twice that many whatever it joined (the root itself, or
  a DHT that lost its bootstrap). Its lone rounds' commits wait for a group round
  (node.lease_pool), so a replica left on a DHT of its own would train and never commit.
At most `MAX_DHT_MOVES` moves in any `MOVE_WINDOW_S`, so a root that flaps (dead but not
yet lapsed, or restarting) cannot make a node restart forever. Training goes on during a
move and its progress is kept (`capture`, then a rebase onto the state found there). A
move that took another replica's state replaced this replica's lineage: `on_replaced`
runs with the new state's chain, so stage 0's lease pool hands back the ranges of the
held lone rounds that chain does not hold (`LeasePool.state_replaced`). Every state the
loop loads reaches `on_state` as a `GlobalState` value with None, and every round's
result with its `RoundFacts` (the state may be unchanged: `facts.applied`); nothing
outside this module touches the `OuterLink`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from node.checkpoint import GlobalState, resume_state
from node.config import NodeConfig
from node.diloco import DilocoConfig
from node.events import EventLog
from node.lease_pool import RoundFacts, RoundMark
from node.outer.settings import OUTER_PROGRAM
from node.outer_link import OuterConfig, OuterLinkError
from node.outer_rounds import Attested, OuterRounds
from node.peer_view import PeerView
from node.stage_compute import StageCompute
from node.worker import TorchWorker
from protocol.control import RunInfo
from protocol.lineage import Link

log = logging.getLogger(__name__)

# Moves to the run's DHT (each restarts the outer process) allowed in any MOVE_WINDOW_S;
# past this a node stays where it is until the window slides (e.g. a root that is dead
# but not yet lapsed).
MAX_DHT_MOVES = 3
MOVE_WINDOW_S = 300.0
# Rounds in a row without a groupmate, while other replicas of the stage announce a DHT,
# that show a node on a DHT other than the root's to be on one of its own (twice that
# when it joined the root's, or is the root).
LONE_ROUNDS_TO_MOVE = 2
POLL_S = 0.2  # seconds between ticks

OnState = Callable[[GlobalState, RoundFacts | None], Awaitable[None]]
OnReplaced = Callable[[tuple[Link, ...]], Awaitable[None]]  # the new state's chain


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
        on_replaced: OnReplaced | None = None,  # a move took another replica's state
        attested: Callable[[], Attested] | None = None,  # the stage's, as last told
        credit: Callable[[], bytes] | None = None,  # its signed credit, as last told
        # contributions wait for the stage to agree on their state (the lease pool's)
        waiting: Callable[[], bool] | None = None,
        identity: bytes = b"",  # the node's key (NodeKey.libp2p_private_key)
        # report a groupmate caught in a round (peer id, round, what) to the coordinator
        accuse: Callable[[str, int, str], None] | None = None,
    ) -> None:
        self.worker = worker
        self.identity = identity
        self.accuse = accuse
        self.waiting = waiting
        self.attested = attested or (lambda: None)
        self.credit = credit
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
        self._on_replaced = on_replaced
        self._bootstrap = ""  # peer id whose DHT our outer process joined (or ours)
        self._moves: list[float] = []  # trio.current_time() of each move

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
        on_replaced: OnReplaced | None = None,
        attested: Callable[[], Attested] | None = None,
        waiting: Callable[[], bool] | None = None,
        identity: bytes = b"",
        accuse: Callable[[str, int, str], None] | None = None,
        credit: Callable[[], bytes] | None = None,
    ) -> OuterLoop:
        """The outer loop with a node's settings."""
        return cls(
            worker, compute, peers, run=run, config=outer_config(cfg),
            every_steps=cfg.outer_every_steps, tokens_per_step=cfg.inner_batch_tokens,
            snapshot=snapshot, on_state=on_state, announce_dht=announce_dht,
            checkpoint_dir=cfg.checkpoint_dir, events=events, on_replaced=on_replaced,
            attested=attested, waiting=waiting, identity=identity, accuse=accuse,
            credit=credit,
        )  # fmt: skip

    def round_target(self) -> int:
        """Tokens a full round gathers: every replica of the stage trains `every_steps`
        inner steps (the participation rule of docs/outer-loop.md)."""
        return self.peers.replicas() * self.every_steps * self.tokens_per_step

    def request_early_round(self) -> None:
        if self.rounds is not None:
            self.rounds.request_early_round()

    async def start(
        self,
        carry: GlobalState | None = None,
        *,
        initial: GlobalState | None = None,
        tokens_mark: int = 0,
    ) -> None:
        """Start the outer process, load the stage's state, announce its DHT. `carry` is
        the state of the outer process this one replaces (a DHT move), whose rounds last
        claimed tokens up to `tokens_mark` (the next round claims from there). `initial` is the
        stage's weights as built (round 0): with no carried state or checkpoint, a first
        replica starts the stage's state from it, keeping what it trained since as
        progress, so every replica's round 0 is the same state."""
        me = self.peers.me
        root = self.peers.dht_root()
        bootstrap = self.peers.dht_bootstrap()
        self._bootstrap = root.peer_id if root is not None else me
        try:
            rounds = await self._start_process(bootstrap, tokens_mark)
        except (OuterLinkError, TimeoutError, OSError) as exc:
            if not bootstrap:
                raise
            # Every announced DHT is gone: start one of our own; a later root check (before
            # the first round, or after lone rounds) moves us to the run's DHT again.
            log.warning("outer: no member's DHT answered (%s); starting our own", exc)
            self._bootstrap = me
            rounds = await self._start_process([], tokens_mark)
        resume = carry
        if resume is None and self.checkpoint_dir is not None:
            resume = await trio.to_thread.run_sync(
                resume_state, self.checkpoint_dir, self.run_info, self.peers.stage,
                self.compute.model,
            )  # fmt: skip
        keep_progress = carry is not None
        if resume is None and initial is not None:
            resume, keep_progress = initial, True
        state = await rounds.load_state(
            replicas_exist=self.peers.other_replicas_have_dht(),
            resume=resume,
            keep_progress=keep_progress,
        )
        self.state = state
        await self._on_state(state, None)
        if carry is not None and rounds.loaded_from_replica and self._on_replaced is not None:
            await self._on_replaced(state.lineage)  # the carried lineage may be gone
        # Only a loaded outer process is visible to rounds and drains: the link runs one
        # operation at a time.
        self.rounds = rounds
        self._announce_dht(rounds.link.dht_addrs())  # other nodes bootstrap from it

    async def _start_process(self, bootstrap: list[str], tokens_mark: int) -> OuterRounds:
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
            attested=self.attested,
            credit=self.credit,
            waiting=self.waiting,
            identity=self.identity,
            members=self.peers.stage_members,
            accuse=self.accuse,
            tokens_mark=tokens_mark,
        )

    async def _round_done(self, state: GlobalState, facts: RoundFacts) -> None:
        if facts.applied:
            self.state = state
        await self._on_state(state, facts)

    async def run(self) -> None:
        """Tick rounds until cancelled; move to the run's DHT when `move_reason` says so."""
        while True:
            await trio.sleep(POLL_S)
            rounds = self.rounds
            assert rounds is not None, "start() before run()"
            why = self.move_reason(rounds)
            if why is not None:
                await self._move(rounds, why)
                # Check again before a round: a move that fell back to a DHT of our own
                # must not be sealed by a round taken alone.
                continue
            await rounds.tick()

    def move_reason(self, rounds: OuterRounds) -> str | None:
        """Why this node should move to the run's DHT now (module docstring), or None."""
        if rounds.in_flight:
            return None
        now = trio.current_time()
        self._moves = [t for t in self._moves if now - t < MOVE_WINDOW_S]
        if len(self._moves) >= MAX_DHT_MOVES:
            return None
        root = self.peers.dht_root()
        elsewhere = root is not None and root.peer_id != self._bootstrap
        if elsewhere and rounds.rounds == 0:
            return "before the first round"
        if not self.peers.other_replicas_have_dht():
            return None
        lone = rounds.lone_rounds
        if elsewhere and lone >= LONE_ROUNDS_TO_MOVE or lone >= 2 * LONE_ROUNDS_TO_MOVE:
            return f"after {lone} rounds without a groupmate"
        return None

    async def _move(self, rounds: OuterRounds, why: str) -> None:
        self._moves.append(trio.current_time())
        root = self.peers.dht_root()
        target = root.peer_id if root is not None else "the other members"
        log.info("outer: moving to the run's DHT at %s (%s)", target, why)
        self.events.emit(
            "dht_move", reason=why, root=root.peer_id if root is not None else "",
            rounds=rounds.rounds, lone_rounds=rounds.lone_rounds,
        )  # fmt: skip
        self.rounds = None
        # Training goes on during the move: keep that progress (a rebase onto the state
        # found there), since its micro-batches will be committed.
        carry = await self.worker.run(rounds.capture)
        await trio.to_thread.run_sync(rounds.close)
        await self.start(carry=carry, tokens_mark=rounds.tokens_mark)

    async def finish(self, timeout_s: float) -> None:
        """Drain: finish the round in flight and one more that covers the rest."""
        if self.rounds is not None:
            await self.rounds.finish(timeout_s)

    def close(self) -> None:
        if self.rounds is not None:
            self.rounds.close()


def outer_config(cfg: NodeConfig) -> OuterConfig:
    """The outer process's settings from the node's."""
    diloco = DilocoConfig(
        eta=cfg.outer_lr, mu=cfg.outer_momentum, participation_power=cfg.outer_participation_power
    )
    if not cfg.outer_robust:  # the plain weighted mean (NodeConfig.outer_robust)
        diloco = dataclasses.replace(diloco, clip_rel=0.0, pair_max_ratio=0.0, pair_cos_sigmas=0.0)
    return OuterConfig(
        compression=cfg.outer_compression,
        matchmaking_s=cfg.outer_matchmaking_s,
        request_timeout_s=min(1.0, cfg.outer_matchmaking_s / 2),
        round_timeout_s=cfg.outer_timeout_s,
        state_timeout_s=cfg.outer_state_timeout_s,
        min_rate_mb_s=cfg.outer_min_rate_mb_s,
        port=cfg.outer_port,
        announce=list(cfg.outer_announce),
        diloco=diloco,
        program=tuple(cfg.outer_program) or OUTER_PROGRAM,
    )
