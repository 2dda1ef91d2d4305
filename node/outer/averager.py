"""`StageAverager`: hivemind's DecentralizedAverager with our own aggregation and state
downloads.

hivemind forms the group (DHT matchmaking, gathered metadata) and serves state to joiners.
The aggregation itself is ours, by one of two schemes (`OuterConfig.averaging`):
reduce-scatter + all-gather of compressed parts (`node.outer.reduce_scatter`, the default:
bytes per member flat in the group size) or all-gather of whole contributions
(`node.outer.all_gather`). Why not hivemind's butterfly all-reduce, checked against
hivemind 1.1.12:
- it returns each peer `local + compress(avg - local)` (averaging/allreduce.py,
  `_accumulate_parts_streaming`), so replicas end up with different bits; in both our
  schemes every member decodes the same compressed bytes of the aggregate, so members
  that received the same parts hold bitwise-identical averages;
- a robust aggregator (rejection by norm, centered clipping) needs each contribution on
  its own, which its streaming reduction never exposes; ours reduces whole contributions
  (all-gather) or whole parts of them (reduce-scatter).
Runs inside hivemind's averager process (forked from the outer-loop process).

State downloads are ours too: hivemind's `_load_state_from_peers` reads a source's whole
stream and returns the first one that answers, whatever its shape or size. Ours reads
each source through `node.outer.state_download.StateDownload` (a byte cap of the
stage's size plus slack, headers checked before decoding, two finite fp32 tensors of the
stage's size and a round) and goes on to the next source, by priority, when one fails.
Each replica also declares where its DHT listens (`<prefix>.addrs`, beside hivemind's
sharing priority), and a download dials the source there first: the p2p daemon finds
peers through its own DHT, which may not know a source it never met.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing.AsyncIterator hints

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from node.diloco import DilocoConfig
from node.outer.all_gather import AllGatherRounds, _Exchange
from node.outer.paced_leaders import pace
from node.outer.parts import (
    MAX_ADDRS,
    NO_METADATA,
    addrs_ok,
    carried_view,
    checked_gathered,
    group_canonical,
    named_attested,
)
from node.outer.reduce_scatter import ReduceScatterRounds, _Round
from node.outer.round_book import RoundBook
from node.outer.settings import AVERAGINGS
from node.outer.state_download import StateDownload, state_digest

log = logging.getLogger(__name__)

StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class StageAverager(ReduceScatterRounds, AllGatherRounds, DecentralizedAverager):  # type: ignore[misc]
    """Averager of one stage's flat pseudo-gradient (see the module docstring).

    `contribution` is the shared flat fp32 buffer: the host writes its delta there before
    `step`, and finds the group's aggregate `D` there after a step that reports `has_delta`.
    `carry` (shared too, same size) holds the host's lone steps' updates since it last held
    a group's state (`node.outer.parts.carried_view`): added to the contribution when the
    group steps that state.
    """

    _rpc_handlers = None  # collect this class's own rpc_* handlers, not the base class's
    _stub_type = None

    def __init__(
        self,
        contribution: torch.Tensor,
        dht: Any,
        *,
        prefix: str,
        wire_compression: CompressionBase,
        diloco: DilocoConfig,
        exchange_timeout: float,
        state_provider: StateProvider,
        carry: torch.Tensor | None = None,
        scheme: str = "reduce_scatter",
        announce: Sequence[str] = (),
        state_min_rate: float = 0.0,
        credit_scope: tuple[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        if scheme not in AVERAGINGS:
            raise ValueError(f"scheme must be one of {AVERAGINGS}, got {scheme!r}")
        self._scheme = scheme
        self._rounds: RoundBook[_Round] = RoundBook()
        self._wire = wire_compression
        self._diloco = diloco
        self._exchange_timeout = exchange_timeout
        self._state_provider = state_provider
        self._carry = carry
        # (run id, stage) that groupmates' coordinator credits must name (node.outer.credit)
        self._credit_scope = credit_scope
        # bytes/s a state source must keep on average once its first `next_chunk_timeout`
        # is over (0: no floor)
        self._state_min_rate = state_min_rate
        self._exchanges: RoundBook[_Exchange] = RoundBook()
        self._announce = list(announce)[:MAX_ADDRS]  # where our DHT listens (no /p2p/)
        # the stage's replicas as the coordinator lists them (base58 peer ids; the
        # averager process's copy, set by `prepare`): no other peer joins a group of
        # ours or serves us state; None admits anyone
        self._members: frozenset[str] | None = None
        self._refused: set[PeerID] = set()  # strangers refused (and logged) so far
        # the largest group (peers); a round's group is complete, and starts at once, when
        # every listed member of the stage is in it (`_prepare`)
        self._largest_group: int | None = kwargs.get("target_group_size")
        super().__init__([contribution], dht, prefix=prefix, start=False, **kwargs)

    # ---- who may take part ---------------------------------------------------------------

    def prepare(self, members: Sequence[str] | None) -> None:
        """Before a step: admit only these peers (base58 ids) to our groups and as state
        sources, None admits anyone. Runs in the host process: the averager process
        handles it before any step sent after it."""
        listed = None if members is None else list(members)
        self._outer_pipe.send(("_prepare", [], {"members": listed}))

    async def _prepare(self, members: list[str] | None) -> None:
        self._members = None if members is None else frozenset(members)
        # A group of every replica the coordinator lists is full: it averages as soon as
        # they are all in, and the matchmaking window only waits for a straggler. (With
        # the configured size alone a group of two waits out the whole window each round.)
        largest = self._largest_group
        if self._members is not None and largest is not None:
            self._matchmaking.target_group_size = max(2, min(largest, len(self._members)))
        if len(self._refused) > 4096:  # bounded: a peer forgotten is logged once more
            self._refused.clear()

    def _admits(self, peer: PeerID) -> bool:
        return self._members is None or peer.to_base58() in self._members

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's matchmaking, for members of the stage only: a peer the coordinator
        does not list on it is refused before it can join a group we lead (and we do not
        ask to join a group it leads: `node.outer.paced_leaders`)."""
        if not self._admits(context.remote_id):
            if context.remote_id not in self._refused:  # once per peer: it retries often
                self._refused.add(context.remote_id)
                log.warning("refused %s: not a member of this stage", context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    # ---- state for joiners (runs in the host process) ----------------------------------

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo]]:
        meta, tensors = self._state_provider()
        infos = [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
        return meta, tensors, infos

    # ---- state downloads (run in the averager process) ----------------------------------

    def load_state(
        self,
        timeout: float,
        want: tuple[int, str] | None = None,
        sources: list[str] | None = None,
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """hivemind's `load_state_from_peers`, run by our `_load_state_from_peers`: with
        `want`, only a state of that (round, digest) is taken; with `sources` (base58
        peer ids), only those replicas are asked."""
        future: MPFuture = MPFuture()
        call = {"timeout": timeout, "future": future, "want": want, "sources": sources}
        self._outer_pipe.send(("_load_state_from_peers", [], call))
        return future.result(timeout=timeout)  # type: ignore[no-any-return]

    async def _load_state_from_peers(
        self,
        future: MPFuture,
        timeout: float | None = None,
        want: tuple[int, str] | None = None,
        sources: list[str] | None = None,
    ) -> None:
        """The valid state of the first source, by sharing priority, that sends one; with
        `want`, only sources that declare its round are asked (a declaration is renewed
        every `declare_state_period`; the caller retries until its deadline), and a state
        of another round or digest is refused; with `sources`, no other replica is asked."""
        try:
            wait = self.next_chunk_timeout or self.request_timeout  # s between two messages
            found = self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers",
                                 latest=True)  # fmt: skip
            entries = found.value if found is not None else {}
            priority: dict[PeerID, tuple[float, ...]] = {}
            for key, info in entries.items() if isinstance(entries, dict) else ():
                if isinstance(info, ValueWithExpiration) and type(info.value) in (int, float):
                    try:
                        priority[PeerID(key)] = (float(info.value), random.random())
                    except Exception:  # a key that is no peer id: that entry is skipped
                        continue
            if sources is not None:
                allowed = set(sources)
                priority = {p: v for p, v in priority.items() if p.to_base58() in allowed}
            priority = {p: v for p, v in priority.items() if self._admits(p)}
            if want is not None:  # only who declares the wanted round: any other state is
                # refused after its download, and a source that moved on serves none
                priority = {p: v for p, v in priority.items() if v[0] == want[0]}
            addrs = await self._announced_addrs()
            for peer in sorted(priority, key=priority.__getitem__, reverse=True):
                if peer == self.peer_id:
                    continue
                try:  # one source may take the whole download's time, never more
                    if peer in addrs:  # the daemon may not route to a peer it never met
                        await self._dial_at(peer, addrs[peer], wait)
                    got = await asyncio.wait_for(self._download_state(peer, wait), timeout)
                    if got is not None and want is not None:
                        held = (got[0]["round"], state_digest(got[0]["round"], *got[1]))
                        if held != want:
                            raise ValueError(f"it served {held}, not the attested {want}")
                except Exception as exc:
                    log.warning("state from %s refused: %r", peer, exc)
                    continue
                if got is not None:
                    future.set_result(got)
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _announced_addrs(self) -> dict[PeerID, list[str]]:
        """The DHT addresses replicas declare beside their sharing priority (see
        `_declare_addrs_periodically`); an entry that is not a short list of short
        strings is skipped. Each is signed by its owner (`node.outer.dht_records`), and
        a dial proves the peer id (Noise) anyway: a false entry costs one failed dial."""
        key = f"{self._matchmaking.group_key_manager.prefix}.addrs"
        found = await self.dht.get(key, latest=True, return_future=True)
        entries = found.value if found is not None else {}
        out: dict[PeerID, list[str]] = {}
        for key, info in entries.items() if isinstance(entries, dict) else ():
            v = info.value if isinstance(info, ValueWithExpiration) else None
            if not v or not addrs_ok(v):
                continue
            try:
                out[PeerID(key)] = list(v)
            except Exception:  # a key that is no peer id
                continue
        return out

    async def _declare_for_download_periodically(self) -> None:
        """hivemind's declaration of this replica's sharing priority, and beside it the
        addresses its DHT listens on, for replicas that download state from it.
        hivemind starts this task right after it builds its matchmaking, before the first
        round: the matchmaking's leader search is paced here (`node.outer.paced_leaders`)."""
        pace(self._matchmaking, admits=self._admits, reach=self._reach_leader)
        addrs = asyncio.create_task(self._declare_addrs_periodically())
        try:
            await super()._declare_for_download_periodically()
        finally:
            addrs.cancel()

    async def _reach_leader(self, leader: PeerID) -> None:
        """Dial a potential leader where it says it listens before asking to join its
        group (`node.outer.paced_leaders`: the daemon may hold a dead address for it)."""
        try:
            addrs = (await asyncio.wait_for(self._announced_addrs(), self.request_timeout)).get(
                leader
            )
        except Exception as exc:  # the join request goes on as hivemind would send it
            log.debug("reading announced addresses failed: %r", exc)
            return
        if addrs:
            await self._dial_at(leader, addrs, self.request_timeout)

    async def _declare_addrs_periodically(self) -> None:
        """Store `<prefix>.addrs` (subkey: our peer id) every `declare_state_period`: a
        replica's p2p daemon finds peers through its own DHT, which may not know a
        source it never met ("routing: not found"), so downloaders dial these first."""
        key = f"{self._matchmaking.group_key_manager.prefix}.addrs"
        while self._announce:
            expiration = get_dht_time() + 2 * self.declare_state_period
            try:
                await asyncio.wait_for(
                    self.dht.store(key, subkey=self.peer_id.to_bytes(), value=self._announce,
                                   expiration_time=expiration, return_future=True),
                    timeout=self.declare_state_period,
                )  # fmt: skip
            except Exception as exc:
                log.debug("declaring our addresses failed: %r", exc)
            await asyncio.sleep(self.declare_state_period)

    async def _download_state(
        self, peer: PeerID, wait: float
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        reader = StateDownload(self._averaged_tensors[0].numel())
        stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        t0 = time.monotonic()
        try:
            async for msg in aiter_with_timeout(stream, wait):
                reader.feed(msg)
                if self._state_min_rate > 0:
                    reader.check_rate(time.monotonic() - t0, self._state_min_rate, grace_s=wait)
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        return reader.result()

    # ---- aggregation (runs in the averager process) ------------------------------------

    async def _aggregate_with_group(
        self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any
    ) -> dict[str, Any]:
        strangers = [p.to_base58() for p in group_info.peer_ids if not self._admits(p)]
        if strangers:  # a group led by a stranger (or one our view does not list yet)
            raise ValueError(f"the group holds peers not listed on this stage: {strangers[:4]}")
        gathered: dict[PeerID, dict[str, Any]] = {}
        for pid, raw in zip(group_info.peer_ids, group_info.gathered, strict=True):
            try:
                _bandwidth, _mode, user = self.serializer.loads(raw)
                gathered[pid] = checked_gathered(self.serializer.loads(user))
            except Exception:  # a member's metadata that does not even decode
                gathered[pid] = dict(NO_METADATA)
        held = {p: (int(g["round"]), str(g["digest"])) for p, g in gathered.items()}
        head, _ = group_canonical(held, [named_attested(g) for g in gathered.values()])
        view, carried = carried_view(gathered, head)
        async with enter_asynchronously(self.get_tensors()) as tensors:
            if self.peer_id in carried and self._carry is not None:
                tensors[0].add_(self._carry)
            if self._scheme == "reduce_scatter":
                out = await self._reduce_scatter(group_info, view, tensors[0])
            else:
                out = await self._all_gather(group_info, view, tensors[0])
        out["gathered"] = {p.to_base58(): g for p, g in gathered.items()}  # as declared
        out["carried"] = self.peer_id in carried
        return out
