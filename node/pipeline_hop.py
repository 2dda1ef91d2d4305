"""One hop of the pipeline: pick a next-stage peer, send it a forward, serve one.

A micro-batch travels stage by stage as a `Forward` (tokens plus the compressed boundary
activations) and comes back as a `Backward` (the compressed input gradient and the loss).
Stage 0 calls `run_microbatch`, which retries a failed route on another peer; every
other stage serves `/agora/fwd/1` with `serve_forward`, which runs its forward, passes
the micro-batch on (or computes the loss on the last stage) and answers with the
gradient of its own input. A peer that fails, times out or answers with a gradient that
does not decode (malformed, NaN, Inf) is avoided for a while (`node.routing.Router`), and
the micro-batch goes another way; one whose request failed at the transport level
(`PeerUnreachable`: dial refused, stream reset or closed, what a dead peer looks like) is
not routed to again until the membership shows it alive. A failed micro-batch is retried
at once while a peer it has not tried is usable, and after a back-off (0.5 s, doubling)
once every usable peer failed it. A retry is sent with `Forward.retry`, and the pipeline's
torch jobs take the worker in priority order (`WorkerGate`): a retried micro-batch's
work first, then backwards, then fresh forwards, so a micro-batch re-routed around a dead
replica does not queue behind the survivor's backlog nor behind stage 0's new forwards. Forwards are served only to members of the previous
stage, with at most `max_rows` sequences (the run's micro-batch: a larger block is bad
input, the sender is banned by the transport), and what a sender computes here is
cached under its own peer id, so one member cannot replace another's activations. All torch work runs on the node's one
`TorchWorker` thread; the hop also moves the codecs' byte counts and trained tokens into
the metrics.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from node import metrics
from node.data import token_dtype
from node.events import EventLog
from node.p2p.transport import (
    PeerUnreachable,
    RequestRefused,
    RequestTimeout,
    Transport,
    TransportError,
)
from node.peer_view import PeerView
from node.stage_compute import StageCompute
from node.worker import TorchWorker
from protocol.errors import ProtocolError
from protocol.message import Message
from protocol.pipeline import FORWARD_PROTOCOL, Backward, Forward
from protocol.tensors import EncodedTensor, TensorFrame

log = logging.getLogger(__name__)

RETRY_WAIT_S = 0.5  # seconds before a retry once every usable peer failed (doubles, to 8 s)
RETRY_WAIT_MAX_S = 8.0  # seconds, the longest retry back-off


RETRIED, BACKWARD, FRESH = 0, 1, 2  # WorkerGate priorities, most urgent first


class StageNotBuilt(Exception):
    """A forward's deadline passed while this stage was still being built (a cold joiner):
    the sender gets `Refused(reason="internal")`, which bans this node briefly, and
    neither bans the sender nor makes this node look dead."""


class WorkerGate:
    """The pipeline's torch jobs take the worker one at a time, in priority order
    (`RETRIED` work, then `BACKWARD`s, then `FRESH` forwards), each priority in arrival
    order. The worker runs one job at a time anyway; without the gate its queue is first
    come, first served."""

    def __init__(self) -> None:
        self._busy = False
        self._waiting: list[tuple[int, int, trio.Event]] = []  # (priority, arrival, wake)
        self._arrivals = 0

    @asynccontextmanager
    async def turn(self, priority: int) -> AsyncIterator[None]:
        if self._busy:
            self._arrivals += 1
            entry = (priority, self._arrivals, trio.Event())
            heapq.heappush(self._waiting, entry)
            try:
                await entry[2].wait()
            except BaseException:
                if entry[2].is_set():  # handed the turn as it was cancelled: pass it on
                    self._release()
                else:
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                raise
        else:
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        if self._waiting:
            heapq.heappop(self._waiting)[2].set()  # the turn passes on; still busy
        else:
            self._busy = False


class PipelineHop:
    def __init__(
        self,
        transport: Transport,
        peers: PeerView,
        worker: TorchWorker,
        *,
        request_timeout_s: float,  # seconds a downstream stage has for one micro-batch
        max_rows: int,  # sequences a served forward may carry: the run's micro-batch
        events: EventLog | None = None,
        witness: Callable[[str, int], None] | None = None,  # (peer, tokens) it worked on
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, got {max_rows}")
        self.max_rows = max_rows
        self.transport = transport
        self.peers = peers
        self.worker = worker
        self.request_timeout_s = request_timeout_s
        self.router = peers.router  # the view forgets the peers that left
        self.events = events or EventLog()
        # the coordinator checks claimed throughput against the work members saw each
        # other do (coordinator/witness.py): a next-stage peer's replies; at stage 1, also
        # the forwards served for a stage-0 peer
        self.witness = witness or (lambda peer, tokens: None)
        self.compute: StageCompute | None = None  # set once the stage is built
        self.built = trio.Event()
        self.tokens_trained = 0  # tokens this stage trained on (forward + backward)
        self._bytes_seen: dict[str, int] = {}  # codec byte counts already in the metrics
        self.gate = WorkerGate()  # the order of the pipeline's torch jobs

    def stage_built(self, compute: StageCompute) -> None:
        self.compute = compute
        self.built.set()

    # --- the sending side ----------------------------------------------------------------

    def pick_next(self, tried: set[str]) -> str | None:
        """A usable next-stage peer not yet tried for this micro-batch; once none is left,
        the tried ones again (their bans still apply)."""
        candidates = self.peers.next_stage_peers()
        now = trio.current_time()
        prefer = self.peers.partners() if self.router.affinity > 0 else ()
        peer = self.router.choose(candidates, now, exclude=tried, prefer=prefer)
        if peer is None and tried:
            tried.clear()
            peer = self.router.choose(candidates, now, prefer=prefer)
        if peer is not None:
            tried.add(peer)
        return peer

    def untried_usable(self, tried: set[str]) -> bool:
        """A next-stage peer this micro-batch has not tried could take it now."""
        candidates = self.peers.next_stage_peers()
        return bool(self.router.usable(candidates, trio.current_time(), exclude=tried))

    async def send_forward(
        self,
        peer: str,
        mb_id: str,
        tokens: TensorFrame,
        hidden: EncodedTensor,
        route: list[str],
        *,
        retry: bool = False,
    ) -> Backward | None:
        """One attempt through `peer` (`retry`: an earlier one failed); None if it failed
        (the peer is then avoided)."""
        msg = Forward(
            mb_id=mb_id,
            tokens=tokens,
            hidden=hidden,
            route=route,
            deadline=time.time() + self.request_timeout_s,
            retry=retry,
        )
        self.router.started(peer)
        metrics.IN_FLIGHT.inc()
        t0 = trio.current_time()
        try:
            reply = await self.transport.request(
                peer, self.peers.addrs(peer), FORWARD_PROTOCOL, msg, timeout=self.request_timeout_s
            )
            if not isinstance(reply, Backward) or reply.mb_id != mb_id:
                raise TransportError(f"peer {peer} answered {type(reply).__name__}", peer_id=peer)
        except TransportError as exc:
            self._failed(peer, mb_id, exc, trio.current_time() - t0)
            return None
        finally:
            metrics.IN_FLIGHT.dec()
        elapsed = trio.current_time() - t0
        self.router.succeeded(peer, elapsed, trio.current_time())
        metrics.MB_SECONDS.observe(elapsed)
        return reply

    def _failed(self, peer: str, mb_id: str, exc: Exception, seconds: float = 0.0) -> None:
        kind = failure_kind(exc)
        ban = self.router.failed(peer, trio.current_time(), unreachable=kind == "unreachable")
        if kind == "unreachable":
            log.warning("node: %s failed via %s (%s); avoiding it until the membership"
                        " shows it alive", mb_id, peer, exc)  # fmt: skip
        else:
            log.warning("node: %s failed via %s (%s); avoiding it for %.0fs", mb_id, peer, exc, ban)
        self.events.emit(
            "forward_failed", mb_id=mb_id, peer=peer, error=str(exc)[:200], kind=kind,
            seconds=round(seconds, 4),
        )  # fmt: skip

    async def _backward(
        self,
        peer: str,
        key: str,
        rows: np.ndarray,
        hidden: EncodedTensor | None,
        reply: Backward,
        *,
        retried: bool,
    ) -> tuple[bool, EncodedTensor | None]:
        """Backward with the gradient `peer` answered; (False, None) when it does not
        decode (the peer is then avoided, like one that failed)."""
        assert self.compute is not None
        try:
            async with self.gate.turn(RETRIED if retried else BACKWARD):
                grad_in = await self.worker.run(
                    self.compute.backward, key, rows, hidden, reply.grad
                )
        except ProtocolError as exc:
            self._failed(peer, reply.mb_id, exc)
            return False, None
        return True, grad_in

    async def run_microbatch(
        self, mb_id: str, rows: np.ndarray, give_up: Callable[[int], bool]
    ) -> float | None:
        """Stage 0: run one micro-batch through the downstream stages until it returns
        once, and train on it; its loss. None when `give_up(failures so far)` said so
        before it returned (its lease was fenced, or the node is draining). The forward
        runs once: a retry sends the same activations (the backward recomputes them at
        the current weights if an inner step ran meanwhile, as for any late reply)."""
        compute = self.compute
        assert compute is not None
        tokens = TensorFrame.from_numpy(rows)
        backoff = RETRY_WAIT_S
        tried: set[str] = set()
        failures = 0
        first_failure = 0.0  # trio time of the first failed attempt
        hidden: EncodedTensor | None = None  # the forward's output, sent on every attempt
        while not give_up(failures):
            if hidden is None:
                async with self.gate.turn(FRESH):
                    out = await self.worker.run(compute.forward, mb_id, rows, None)
                assert isinstance(out, EncodedTensor)
                hidden = out
            peer = self.pick_next(tried)  # after the forward: the newest view of the peers
            if peer is not None:
                retried = failures > 0
                sent = trio.current_time()
                reply = await self.send_forward(
                    peer, mb_id, tokens, hidden, [self.transport.peer_id], retry=retried
                )
                replied = trio.current_time()
                ok = (
                    reply is not None
                    and (await self._backward(peer, mb_id, rows, None, reply, retried=retried))[0]
                )
                if ok:
                    assert reply is not None
                    self._account(rows)
                    self.witness(peer, _tokens(rows))
                    if retried:
                        self.events.emit(
                            "forward_rerouted", mb_id=mb_id, peer=peer, failures=failures,
                            seconds=round(trio.current_time() - first_failure, 4),
                            attempt_s=round(replied - sent, 4),
                        )  # fmt: skip
                    return reply.loss
                metrics.MICROBATCHES.labels("retried").inc()
            if not failures:
                first_failure = trio.current_time()
            failures += 1
            if peer is not None and self.untried_usable(tried):
                continue  # another peer can take it now: no reason to wait
            await trio.sleep(backoff)
            backoff = min(backoff * 2, RETRY_WAIT_MAX_S)
        if hidden is not None:
            await self.worker.run(compute.drop, mb_id)
        return None

    # --- the serving side (stages > 0) ---------------------------------------------------

    async def serve_forward(self, peer_id: str, msg: Message) -> Message:
        """A forward from stage - 1, answered with its backward (or refused)."""
        timing = _ServeTiming(arrived=trio.current_time())
        reply = await self._serve_forward(peer_id, msg, timing)
        held = trio.current_time() - timing.arrived
        metrics.SERVE_SECONDS.observe(held)
        if isinstance(msg, Forward) and msg.retry and timing.began is not None:
            self.events.emit(
                "retry_served", mb_id=msg.mb_id,
                queued_s=round(timing.began - timing.arrived, 4), held_s=round(held, 4),
                job_s=round(timing.job_s, 4), job_cpu_s=round(timing.job_cpu_s, 4),
            )  # fmt: skip
        return reply

    async def _forward_job(self, timing: _ServeTiming, *args: Any) -> Any:
        """`compute.forward(*args)` on the worker, timed into `timing` (wall and the
        worker thread's CPU)."""
        assert self.compute is not None
        timing.began = trio.current_time()
        out, timing.job_cpu_s = await self.worker.run_timed(self.compute.forward, *args)
        timing.job_s = trio.current_time() - timing.began
        return out

    async def _serve_forward(self, peer_id: str, msg: Message, timing: _ServeTiming) -> Message:
        if not isinstance(msg, Forward):
            raise ProtocolError(f"expected a forward message, got {type(msg).__name__}")
        with trio.move_on_after(max(0.0, msg.deadline - time.time())):
            await self.built.wait()  # a forward that arrived while the stage was built
        compute = self.compute
        if compute is None:  # our fault, not the sender's: refused, never banned
            raise StageNotBuilt("this stage is still being built; try another replica")
        if compute.is_first:
            raise ProtocolError("this peer serves stage 0, which takes no forward input")
        sender = self.peers.members.get(peer_id)
        if sender is None or sender.observer or sender.stage != self.peers.stage - 1:
            raise ProtocolError(f"forwards come from stage {self.peers.stage - 1} members only")
        key = f"{peer_id}/{msg.mb_id}"  # the sender's own cache entry
        vocab = compute.model.config.vocab_size
        rows = msg.tokens.to_numpy(expect_dtype=token_dtype(vocab), expect_shape=(None, None))
        max_seq = compute.model.config.max_seq_len
        if not 1 <= rows.shape[0] <= self.max_rows or not 2 <= rows.shape[1] <= max_seq + 1:
            raise ProtocolError(f"token block of shape {list(rows.shape)} is out of bounds")
        if rows.size and int(rows.max()) >= vocab:  # a target past the vocabulary
            raise ProtocolError(f"token id {int(rows.max())} is outside the vocabulary of {vocab}")
        first = RETRIED if msg.retry else FRESH
        if compute.is_last:
            async with self.gate.turn(first):
                grad, loss = await self._forward_job(timing, key, rows, msg.hidden)
            assert grad is not None
            self._account(rows)
            if compute.model.stage == 1:
                self.witness(peer_id, _tokens(rows))
            return Backward(mb_id=msg.mb_id, grad=grad, loss=loss, tokens=_tokens(rows))
        async with self.gate.turn(first):
            hidden = await self._forward_job(timing, key, rows, msg.hidden)
        assert isinstance(hidden, EncodedTensor)
        route = [*msg.route, self.transport.peer_id]
        tried: set[str] = set()
        retry = msg.retry
        with trio.fail_after(max(0.0, msg.deadline - time.time())):
            while True:
                peer = self.pick_next(tried)
                if peer is not None:
                    reply = await self.send_forward(
                        peer, msg.mb_id, msg.tokens, hidden, route, retry=retry
                    )
                    if reply is not None:
                        ok, grad_in = await self._backward(
                            peer, key, rows, msg.hidden, reply, retried=retry
                        )
                        if ok:
                            break
                    retry = True
                    if self.untried_usable(tried):
                        continue  # another peer can take it now
                await trio.sleep(RETRY_WAIT_S)
        assert grad_in is not None
        self._account(rows)
        self.witness(peer, _tokens(rows))
        if compute.model.stage == 1:
            self.witness(peer_id, _tokens(rows))
        return Backward(mb_id=msg.mb_id, grad=grad_in, loss=reply.loss, tokens=reply.tokens)

    # --- accounting ----------------------------------------------------------------------

    def _account(self, rows: np.ndarray) -> None:
        """A finished micro-batch's tokens, and the codecs' byte counts, into the
        Prometheus counters: every stage counts the tokens it finished backward for."""
        n = _tokens(rows)
        self.tokens_trained += n
        metrics.TOKENS.inc(n)
        assert self.compute is not None
        counts = self.compute.bytes_counts()
        for key, value in counts.items():
            kind, direction = key.split("_")
            metrics.BYTES.labels(direction, kind).inc(value - self._bytes_seen.get(key, 0))
        self._bytes_seen = counts
        wire = counts["wire_fwd"] + counts["wire_bwd"]
        if wire:
            metrics.COMPRESSION.set((counts["raw_fwd"] + counts["raw_bwd"]) / wire)


@dataclass(slots=True)
class _ServeTiming:
    """When a served forward arrived and took the worker, and what its forward job
    cost (seconds: trio clock, wall and thread CPU)."""

    arrived: float
    began: float | None = None
    job_s: float = 0.0
    job_cpu_s: float = 0.0


def _tokens(rows: np.ndarray) -> int:
    """Tokens a block of sequences trains on: one target per position but the first."""
    return int(rows.shape[0] * (rows.shape[1] - 1))


def failure_kind(exc: Exception) -> str:
    """How an attempt failed, for the router and the `forward_failed` event: unreachable
    (transport: the peer looks dead), timeout, refused (it answered `Refused`), or
    bad_reply (a reply that is not the micro-batch's `Backward`, or does not decode)."""
    if isinstance(exc, PeerUnreachable):
        return "unreachable"
    if isinstance(exc, RequestTimeout):
        return "timeout"
    if isinstance(exc, RequestRefused):
        return "refused"
    return "bad_reply"
