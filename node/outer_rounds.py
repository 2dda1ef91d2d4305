"""DiLoCo outer rounds of one outer process, driven from the node's trio loop.

`OuterRounds` owns one `OuterLink` (the hivemind process) and decides when a round
starts: every `every_steps` inner steps, once the previous round has finished, so a
round always overlaps with training and communication never stalls compute; or
earlier, after a quarter of them, when another replica of the stage is looking for a
group (`join_early`): replicas whose rounds fall out of phase by more than the
matchmaking window would otherwise step alone for good, each rebasing on the other's
lone result. Every call
that touches the parameters runs on the torch worker thread, which serialises it with
forward and backward. A round's snapshot first takes an inner step over the gradients
accumulated so far, so the snapshot holds every window finished before the round began.
When a round's result arrives it is merged into the working copy (theta_g plus the
progress made since the snapshot), and `on_round` gets the global state as a value and
the round's `RoundFacts`: whether it was applied, with this replica's contribution, by a
group, on a state adopted from another replica, and whether this replica is alone on its
stage. Stage 0's lease pool turns those facts into commits (`node.lease_pool`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import trio

from node import metrics
from node.checkpoint import GlobalState
from node.diloco import merge_local_progress
from node.events import EventLog
from node.lease_pool import RoundFacts, RoundMark
from node.outer_link import OuterConfig, OuterLink, OuterLinkError, RoundResult
from node.stage_compute import StageCompute
from node.worker import TorchWorker

log = logging.getLogger(__name__)

POLL_S = 0.2  # seconds between checks for a finished round
PEEK_S = 1.0  # seconds between looks for a replica forming a group (between rounds)
FETCH_TRY_S = 5.0  # seconds one fetch of the attested state may take before asking again
ATTEST_POLL_S = 0.5  # seconds between looks for the stage's attested state (a joiner)
OnRound = Callable[[GlobalState, RoundFacts], Awaitable[None]]
Attested = tuple[int, str] | None  # a stage's attested (round, digest)


class OuterRounds:
    def __init__(
        self,
        worker: TorchWorker,
        compute: StageCompute,
        link: OuterLink,
        *,
        every_steps: int,
        snapshot: Callable[[], RoundMark],
        on_round: OnRound,
        sole_replica: Callable[[], bool],  # no other replica trains this stage now
        target_tokens: Callable[[], int] | None = None,
        events: EventLog | None = None,
        attested: Callable[[], Attested] | None = None,
        # this replica's signed credit as the coordinator last sent it (protocol.credit):
        # its groupmates bound its token claim by it (b"": none)
        credit: Callable[[], bytes] | None = None,
        # contributions wait for the stage to agree on the state that holds them (the
        # lease pool's held rounds): a drain runs one more round for them
        waiting: Callable[[], bool] | None = None,
        # the stage's replicas as the coordinator lists them (peer ids): groups admit no
        # other peer (None: anyone)
        members: Callable[[], list[str]] | None = None,
        # report a groupmate caught in a round: (peer id, round, what), to the coordinator
        accuse: Callable[[str, int, str], None] | None = None,
        # compute.tokens_trained when the rounds this one continues (a DHT move's) last
        # began a round: the progress since is kept, and the tokens since are claimed once
        tokens_mark: int = 0,
    ) -> None:
        self.worker = worker
        self._accuse = accuse
        self._members_fn: Callable[[], list[str] | None] = members or (lambda: None)
        self._waiting_fn = waiting or (lambda: False)
        # the stage's attested (round, digest) now, as the coordinator last said: a state
        # is fetched, and a round rebases, onto that one only (None: none known)
        self._attested_fn = attested or (lambda: None)
        self._credit_fn = credit or (lambda: b"")
        self._target_fn = target_tokens  # a full round's tokens now (participation rule)
        self.compute = compute
        self.link = link
        self.every_steps = every_steps  # inner steps between round starts
        self._snapshot_fn = snapshot
        self._on_round = on_round
        self._sole_fn = sole_replica
        self._in_flight: RoundMark | None = None  # the round running now
        self._round_started = 0.0  # monotonic seconds
        self._steps_at_last = 0  # compute.inner_steps when the last round began
        self._tokens_at_last = tokens_mark  # compute.tokens_trained when the last round began
        self.rounds = 0  # rounds applied by this replica
        # results in a row that found no other replica: no groupmate, no newer state
        self.lone_rounds = 0
        # whether `load_state` took another replica's state (so this replica's own
        # lineage, and what it held, was replaced)
        self.loaded_from_replica = False
        # One tick at a time: the outer loop and a drain both tick, and a round must not
        # begin while the last one's merge and `on_round` (commits, checkpoint) run.
        self._tick_lock = trio.Lock()
        self._early = False  # start the next round as soon as any inner step was taken
        # start a round after a quarter of `every_steps` when a groupmate is waiting
        self.join_early = True
        self._peeked_at = 0.0  # monotonic seconds of the last look
        self.joined_early = 0  # rounds begun early to join a waiting replica
        self._joining = False  # the round in flight began early, to join one
        self.events = events or EventLog()

    @classmethod
    async def start(
        cls,
        worker: TorchWorker,
        compute: StageCompute,
        *,
        run_id: str,
        stage: int,
        initial_peers: list[str],
        config: OuterConfig,
        every_steps: int,
        snapshot: Callable[[], RoundMark],
        on_round: OnRound,
        sole_replica: Callable[[], bool],
        target_tokens: Callable[[], int] | None = None,
        events: EventLog | None = None,
        attested: Callable[[], Attested] | None = None,
        credit: Callable[[], bytes] | None = None,
        waiting: Callable[[], bool] | None = None,
        identity: bytes = b"",
        members: Callable[[], list[str]] | None = None,
        accuse: Callable[[str, int, str], None] | None = None,
        tokens_mark: int = 0,
    ) -> OuterRounds:
        """Start the outer process (under the node's key `identity`, so its DHT peer id is
        the node's) and the rounds that drive it."""
        numel = sum(p.numel() for p in compute.parameters())
        # Abandoned on cancel (Ctrl-C during start-up): the outer process exits by itself
        # once this process, the other end of its socket, is gone.
        link = await trio.to_thread.run_sync(
            lambda: OuterLink.start(
                run_id=run_id,
                stage=stage,
                numel=numel,
                initial_peers=initial_peers,
                config=config,
                identity=identity,
            ),
            abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-typing stubs predate it
        )
        log.info("outer: hivemind DHT up at %s (%d parameters)", link.dht_addrs(), numel)
        return cls(
            worker, compute, link, every_steps=every_steps, snapshot=snapshot,
            on_round=on_round, sole_replica=sole_replica, target_tokens=target_tokens,
            events=events, attested=attested, waiting=waiting, members=members, accuse=accuse,
            tokens_mark=tokens_mark, credit=credit,
        )  # fmt: skip

    @property
    def tokens_mark(self) -> int:
        """`compute.tokens_trained` when the last round began: what the next claims from."""
        return self._tokens_at_last

    async def load_state(
        self,
        replicas_exist: bool,
        resume: GlobalState | None = None,
        *,
        keep_progress: bool = False,
    ) -> GlobalState:
        """A joiner takes (theta_g, m, round) from a live replica; the first one seeds it
        from `resume` (its stage checkpoint, or the state of the outer loop this one
        replaces) when given, else from its initial weights. With `keep_progress` the
        working copy keeps what it trained since `resume.theta_g` (a rebase onto the
        fetched state; or `resume` seeds theta_g and the weights stay as they are).
        Returns the loaded global state; `loaded_from_replica` says whether it came from
        another replica."""
        self.loaded_from_replica = await self._load_state(replicas_exist, resume, keep_progress)
        return await self.worker.run(self.capture)

    async def _load_state(
        self, replicas_exist: bool, resume: GlobalState | None, keep_progress: bool
    ) -> bool:
        params = self.compute.parameters()
        if resume is not None:
            # Held before the stage's state is asked for: when it is the attested state (a
            # move to the run's DHT before the first round, a joiner at round 0, a replica
            # back on the state its stage still holds) the outer process answers the fetch
            # from it and nothing is downloaded.
            await self.worker.run(self._seed, resume)
        if replicas_exist:
            held = (self.link.round, self.link.digest) if resume is not None else None
            got = await self._fetch()
            if got is not None and (got, self.link.digest) != held:
                if keep_progress and resume is not None:
                    await self.worker.run(self._rebase, params, resume.theta_g)
                else:
                    await self.worker.run(self._load, params)
                log.info("outer: loaded the stage's global state at round %d", got)
                return True
            if got is None:
                log.warning(
                    "outer: no replica served the stage's attested state within %g s",
                    self.link.state_timeout_s,
                )
        if resume is None:
            log.info("outer: starting the stage's global state from the initial weights")
            await self.worker.run(
                lambda: self.link.set_initial_state(params, members=self._members_fn())
            )
            return False
        if keep_progress:  # the weights stay as they are: progress on top of theta_g
            log.info("outer: set the stage's global state at round %d; the weights keep what"
                     " was trained since", resume.round)  # fmt: skip
            return False
        await self.worker.run(self._load, params)
        log.info(
            "outer: resumed the stage's global state at round %d from %s",
            resume.round, resume.path,
        )  # fmt: skip
        return False

    def _seed(self, state: GlobalState) -> None:
        """Make `state` the outer process's global state (on the torch worker)."""
        self.link.set_initial_state(
            [state.theta_g],
            momentum=state.momentum,
            round_=state.round,
            lineage=state.lineage,
            members=self._members_fn(),
        )

    async def _fetch(self) -> int | None:
        """Fetch the stage's attested state, asking again with the newest attested state
        every `FETCH_TRY_S` until the state timeout (replicas serve the state they hold,
        which moves on each round). While the stage has nothing attested (its replicas'
        reports have not reached the coordinator yet, or a restarted coordinator has not
        heard them again) it waits for an attested state and takes no other: a state that
        one replica serves unvouched would let that replica hand every joiner a state of
        its own. None when nothing attested was served by the deadline (the node then
        starts from its initial weights or checkpoint, and rebases at its first round)."""
        deadline = trio.current_time() + self.link.state_timeout_s
        waiting = False
        while True:
            left = deadline - trio.current_time()
            want = self._attested_fn()
            if want is None:
                if left <= ATTEST_POLL_S:
                    return None
                if not waiting:
                    log.info("outer: waiting for the stage's attested state")
                    waiting = True
                await trio.sleep(ATTEST_POLL_S)
                continue
            try_s = min(left, FETCH_TRY_S)
            got = await self.worker.run(self.link.fetch_state, try_s, want, self._members_fn())
            if got is not None or trio.current_time() + 1.0 >= deadline:
                return got
            log.info("outer: the attested state %s was not served; asking again", want)

    def capture(self) -> GlobalState:
        """This loop's global state as a value: copies of the link's buffers (call on the
        torch worker while no round runs, so the outer process is not writing them)."""
        return GlobalState(
            theta_g=self.link.theta_g().detach().to("cpu", torch.float32).clone(),
            momentum=self.link.momentum().detach().to("cpu", torch.float32).clone(),
            round=int(self.link.round),
            digest=self.link.digest,
            lineage=tuple(self.link.lineage),
        )

    def _rebase(self, params: list[Any], base: torch.Tensor) -> None:
        """params = fetched theta_g + (params - base): keep the progress made since base."""
        merge_local_progress(params, base, self.link.theta_g())
        self.compute.weights_changed()

    def _load(self, params: list[Any]) -> None:
        self.link.load_into(params)
        self.compute.weights_changed()

    def _merge(self, params: list[Any]) -> None:
        self.link.merge_into(params)
        self.compute.weights_changed()

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    async def tick(self) -> None:
        """Start a round when one is due; apply the running one's result when it is in."""
        async with self._tick_lock:
            await self._tick()

    def request_early_round(self) -> None:
        """Start the next round before `every_steps` (e.g. stage 0 is out of leases while
        trained work waits for a round to commit it)."""
        self._early = True

    async def _tick(self) -> None:
        if self._in_flight is None:
            steps = self.compute.inner_steps - self._steps_at_last
            # An early round starts even without a new inner step: a replica out of data
            # whose trained work waits for a group round is then a groupmate to settle on.
            if steps >= self.every_steps or self._early:
                self._early = False
                await self.begin()
            elif await self._groupmate_waiting(steps):
                self.joined_early += 1
                log.info("outer: a replica is forming a group; joining after %d steps", steps)
                await self.begin(joining=True)
            return
        try:
            result = await self.worker.run(self.link.poll_result)
        except (OuterLinkError, OSError) as exc:
            self._in_flight = None
            metrics.OUTER_ROUNDS.labels("failed").inc()
            log.warning("outer: round failed (%s); training goes on, next round retries", exc)
            return
        if result is not None:
            await self._apply(result)

    async def _groupmate_waiting(self, steps: int) -> bool:
        if not self.join_early or steps < max(1, self.every_steps // 4):
            return False
        now = time.monotonic()
        if now - self._peeked_at < PEEK_S:
            return False
        self._peeked_at = now
        try:
            return await self.worker.run(self.link.peers_waiting) > 0
        except (OuterLinkError, OSError, TimeoutError) as exc:
            log.warning("outer: could not look for a forming group (%s)", exc)
            return False

    async def begin(self, *, joining: bool = False) -> None:
        """Snapshot the working copy and hand it to the outer process (`joining`: early, to
        meet a replica that is forming a group)."""
        self._joining = joining
        tokens = self.compute.tokens_trained - self._tokens_at_last
        self._in_flight = self._snapshot_fn()
        self._steps_at_last = self.compute.inner_steps
        self._tokens_at_last = self.compute.tokens_trained
        self._round_started = time.monotonic()
        target = self._target_fn() if self._target_fn is not None else None
        await self.worker.run(self._begin_round, tokens, target)
        self.events.emit("round_begun", tokens=tokens, joining=joining)

    def _begin_round(self, tokens: int, target: int | None) -> None:
        # Gradients of finished micro-batches that no inner step has applied yet would
        # otherwise reach theta_g one round later than the round that commits them.
        self.compute.step()
        self.link.begin_round(
            self.compute.parameters(), tokens, target, self._attested_fn(), self._members_fn(),
            self._credit_fn(),
        )  # fmt: skip

    async def _apply(self, result: RoundResult) -> None:
        mark, self._in_flight = self._in_flight, None
        assert mark is not None
        await self.worker.run(self._merge, self.compute.parameters())
        metrics.OUTER_ROUNDS.labels("ok").inc()
        metrics.OUTER_ROUND_SECONDS.observe(time.monotonic() - self._round_started)
        metrics.OUTER_GROUP_SIZE.set(result.group_size)
        metrics.OUTER_BYTES.inc(result.bytes_out)
        metrics.OUTER_STATE_BYTES.labels("in").inc(result.state_bytes_in)
        metrics.OUTER_STATE_BYTES.labels("out").inc(result.state_bytes_out)
        metrics.OUTER_RECORDS_REFUSED.inc(result.records_refused)
        if result.records_refused:
            self.events.emit(
                "dht_records_refused", count=result.records_refused, round=result.round
            )
        # A lone round that rebased found a newer replica on its DHT: not on its own there.
        lone = result.group_size <= 1 and not result.rebased
        self.lone_rounds = self.lone_rounds + 1 if lone else 0
        if result.applied:
            self.rounds += 1
            metrics.OUTER_STEPS.inc()
            log.info(
                "outer: round %d applied (group %d, %d tokens, eta_r %.3f, %.1fs, %d B out%s%s%s)",
                result.round, result.group_size, result.tokens, result.eta_r, result.seconds,
                result.bytes_out, ", rebased" if result.rebased else "",
                "" if result.contributed else ", without our contribution",
                ", with our lone rounds" if result.carried else "",
            )  # fmt: skip
            self.events.emit(
                "round_applied", round=result.round, group_size=result.group_size,
                tokens=result.tokens, seconds=result.seconds, rebased=result.rebased,
                contributed=result.contributed, carried=result.carried,
                joined_early=self._joining,
                digest=result.digest, agreed=list(result.agreed) if result.agreed else None,
                rejected=dict(result.rejected), clipped=result.clipped,
            )  # fmt: skip
        else:
            log.warning(
                "outer: round not applied (state stays at round %d, group %d, %.1fs)",
                result.round, result.group_size, result.seconds,
            )  # fmt: skip
            self.events.emit(
                "round_not_applied", round=result.round, group_size=result.group_size,
                seconds=result.seconds,
            )  # fmt: skip
        for peer, why in result.accused.items():
            log.warning("outer: caught %s in round %d: %s", peer, result.round, why)
            self.events.emit("accused", peer=peer, round=result.round, reason=why)
            if self._accuse is not None:
                self._accuse(peer, result.round, why)
        facts = RoundFacts(
            mark=mark,
            applied=result.applied,
            contributed=result.applied and result.contributed,
            adopted=result.rebased,
            sole=self._sole_fn(),
            round=result.round,
            digest=result.digest,
            lineage=tuple(result.lineage),
            agreed=result.agreed,
            carried=result.carried,
        )
        await self._on_round(await self.worker.run(self.capture), facts)

    async def finish(self, timeout_s: float) -> None:
        """Drain: wait for the round in flight, run one more to cover the rest, and one
        more, once, while a contribution waits for the stage to agree on its state."""
        confirming = False
        with trio.move_on_after(timeout_s) as scope:
            for _ in range(3):
                async with self._tick_lock:
                    if self._in_flight is None:
                        if self.compute.tokens_trained == self._tokens_at_last:
                            if confirming or not self._waiting_fn() or self._sole_fn():
                                return
                            confirming = True
                        await self.begin()
                while self._in_flight is not None:
                    await trio.sleep(POLL_S)
                    await self.tick()
        if scope.cancelled_caught:
            log.warning("outer: final round did not finish within %.0fs", timeout_s)

    def close(self) -> None:
        self.link.close()
