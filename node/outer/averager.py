"""`StageAverager`: hivemind's DecentralizedAverager with an all-gather aggregation step.

hivemind forms the group (DHT matchmaking, gathered metadata) and serves state to joiners.
The aggregation itself is ours: every member streams its compressed pseudo-gradient to
every other member, and each member decompresses the same bytes and averages them in the
group's order with `node.diloco.aggregate`. Reasons, checked against hivemind 1.1.12:
- its butterfly all-reduce returns each peer `local + compress(avg - local)`
  (averaging/allreduce.py, `_accumulate_parts_streaming`), so replicas end up with
  different bits; with all-gather, members that received the same contributions hold
  bitwise-identical averages;
- a robust aggregator (rejection by norm, centered clipping) needs each contribution on
  its own, which a reduce-scatter never exposes.
The price is O(group) bytes per member instead of O(1): fine for the few replicas a stage
has. Runs inside hivemind's averager process (forked from the outer-loop process).

State downloads are ours too: hivemind's `_load_state_from_peers` reads a source's whole
stream and returns the first one that answers, whatever its shape or size. Ours reads
each source through `node.outer.state_download.StateDownload` (a byte cap of the
stage's size plus slack, headers checked before decoding, two finite fp32 tensors of the
stage's size and a round) and goes on to the next source, by priority, when one fails.
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
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, enter_asynchronously
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from node.diloco import Contribution, DilocoConfig, aggregate
from node.outer.state_download import StateDownload
from node.outer.wire import decode_tensor

log = logging.getLogger(__name__)

StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class _Exchange:
    """One group's all-gather, inside the averager process."""

    def __init__(self, peer_ids: Sequence[PeerID], mine: list[runtime_pb2.Tensor]) -> None:
        self.peer_ids = list(peer_ids)
        self.mine = mine
        self.received: dict[PeerID, torch.Tensor] = {}
        self.bytes_in = 0
        self.complete = asyncio.Event()

    def add(self, peer: PeerID, tensor: torch.Tensor, nbytes: int) -> None:
        self.received[peer] = tensor
        self.bytes_in += nbytes
        if len(self.received) >= len(self.peer_ids) - 1:
            self.complete.set()


class StageAverager(DecentralizedAverager):  # type: ignore[misc]
    """Averager of one stage's flat pseudo-gradient (see the module docstring).

    `contribution` is the shared flat fp32 buffer: the host writes its delta there before
    `step`, and finds the group's aggregate `D` there after a step that reports `has_delta`.
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
        **kwargs: Any,
    ) -> None:
        self._wire = wire_compression
        self._diloco = diloco
        self._exchange_timeout = exchange_timeout
        self._state_provider = state_provider
        self._exchanges: dict[bytes, _Exchange] = {}
        self._registered: asyncio.Event | None = None
        super().__init__([contribution], dht, prefix=prefix, start=False, **kwargs)

    # ---- state for joiners (runs in the host process) ----------------------------------

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo]]:
        meta, tensors = self._state_provider()
        infos = [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
        return meta, tensors, infos

    # ---- state downloads (run in the averager process) ----------------------------------

    async def _load_state_from_peers(self, future: MPFuture, timeout: float | None = None) -> None:
        """The valid state of the first source, by sharing priority, that sends one."""
        try:
            wait = self.next_chunk_timeout or self.request_timeout  # s between two messages
            found = self.dht.get(f"{self._matchmaking.group_key_manager.prefix}.all_averagers",
                                 latest=True)  # fmt: skip
            entries = found.value if found is not None else {}
            priority: dict[PeerID, tuple[float, float]] = {}
            for key, info in entries.items() if isinstance(entries, dict) else ():
                if isinstance(info, ValueWithExpiration) and type(info.value) in (int, float):
                    try:
                        priority[PeerID(key)] = (float(info.value), random.random())
                    except Exception:  # a key that is no peer id: that entry is skipped
                        continue
            for peer in sorted(priority, key=priority.__getitem__, reverse=True):
                if peer == self.peer_id:
                    continue
                try:  # one source may take the whole download's time, never more
                    got = await asyncio.wait_for(self._download_state(peer, wait), timeout)
                except Exception as exc:
                    log.warning("state from %s refused: %r", peer, exc)
                    continue
                if got is not None:
                    future.set_result(got)
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_state(
        self, peer: PeerID, wait: float
    ) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        reader = StateDownload(self._averaged_tensors[0].numel())
        stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        try:
            async for msg in aiter_with_timeout(stream, wait):
                reader.feed(msg)
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()
        return reader.result()

    # ---- aggregation (runs in the averager process) ------------------------------------

    def _registration_event(self) -> asyncio.Event:
        if self._registered is None:
            self._registered = asyncio.Event()
        return self._registered

    async def _aggregate_with_group(
        self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any
    ) -> dict[str, Any]:
        gathered: dict[PeerID, dict[str, Any]] = {}
        for pid, raw in zip(group_info.peer_ids, group_info.gathered, strict=True):
            _bandwidth, _mode, user = self.serializer.loads(raw)
            gathered[pid] = self.serializer.loads(user)
        async with enter_asynchronously(self.get_tensors()) as tensors:
            flat = tensors[0]
            info = CompressionInfo.from_tensor(flat, key=0)
            serialized = self._wire.compress(flat, info, allow_inplace=False)
            mine = list(split_for_streaming(serialized))
            bytes_out_each = sum(len(p.buffer) for p in mine)
            ex = _Exchange(group_info.peer_ids, mine)
            self._exchanges[group_info.group_id] = ex
            event = self._registration_event()
            event.set()
            event.clear()
            try:
                me = group_info.peer_ids.index(self.peer_id)
                callees = [p for p in group_info.peer_ids[me + 1 :]]
                tasks = [
                    asyncio.create_task(self._call(peer, group_info.group_id, ex))
                    for peer in callees
                ]
                if len(group_info.peer_ids) > 1:
                    try:
                        await asyncio.wait_for(ex.complete.wait(), self._exchange_timeout)
                    except TimeoutError:
                        log.warning(
                            "exchange timed out after %.1fs with %d of %d contributions",
                            self._exchange_timeout,
                            len(ex.received) + 1,
                            len(group_info.peer_ids),
                        )
                for task in tasks:
                    task.cancel()
                own = decode_tensor(serialized)  # what the others decoded
                received = dict(ex.received)
                received[self.peer_id] = own
                head = max(int(g["round"]) for g in gathered.values())
                order = [p for p in group_info.peer_ids if p in received]
                contribs = [
                    Contribution(
                        delta=received[p],
                        tokens=int(gathered[p]["tokens"]),
                        staleness=max(0, head - int(gathered[p]["base_round"])),
                    )
                    for p in order
                ]
                ref_norm = float(gathered[self.peer_id]["ref_norm"])
                agg = aggregate(contribs, ref_norm, self._diloco)
                if agg.delta is not None:
                    flat.copy_(agg.delta)
                return {
                    "gathered": {p.to_base58(): g for p, g in gathered.items()},
                    "order": [p.to_base58() for p in group_info.peer_ids],
                    "contributors": [p.to_base58() for p in order],
                    "weights": agg.weights,
                    "rejected": {order[i].to_base58(): r for i, r in agg.rejected.items()},
                    "tokens": agg.tokens,
                    "has_delta": agg.delta is not None,
                    "bytes_out": bytes_out_each * (len(group_info.peer_ids) - 1),
                    "bytes_in": ex.bytes_in,
                    "raw_bytes": flat.numel() * flat.element_size(),
                }
            finally:
                self._exchanges.pop(group_info.group_id, None)

    async def _call(self, peer: PeerID, group_id: bytes, ex: _Exchange) -> None:
        """Send our contribution to a later groupmate; it answers with its own."""

        async def requests() -> AsyncIterator[averaging_pb2.AveragingData]:
            for i, part in enumerate(ex.mine):
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING,
                    group_id=group_id if i == 0 else b"",
                    tensor_part=part,
                )

        try:
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            stream = await stub.rpc_exchange_contribution(requests())
            parts = []
            async for msg in aiter_with_timeout(stream, self._exchange_timeout):
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise RuntimeError(
                        f"{peer} answered {averaging_pb2.MessageCode.Name(msg.code)}"
                    )
                parts.append(msg.tensor_part)
            self._accept(ex, peer, parts)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("exchange with %s failed: %r", peer, exc)

    def _accept(self, ex: _Exchange, peer: PeerID, parts: list[runtime_pb2.Tensor]) -> None:
        if not parts:
            raise ValueError(f"{peer} sent no tensor parts")
        tensor = decode_tensor(combine_from_streaming(parts))
        mine = self._averaged_tensors[0]
        if tensor.shape != mine.shape or tensor.dtype != mine.dtype:
            raise ValueError(
                f"{peer} sent shape {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(mine.shape)}"
            )
        ex.add(peer, tensor, sum(len(p.buffer) for p in parts))

    async def rpc_exchange_contribution(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """An earlier groupmate sends its contribution; we answer with ours."""
        timeout = self._exchange_timeout
        try:
            first = await asyncio.wait_for(stream.__anext__(), timeout)
            deadline = time.monotonic() + timeout
            ex = self._exchanges.get(first.group_id)
            while ex is None and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(
                        self._registration_event().wait(), deadline - time.monotonic()
                    )
                except TimeoutError:
                    break
                ex = self._exchanges.get(first.group_id)
            if ex is None:
                yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
                return
            if context.remote_id not in ex.peer_ids:
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            parts = [first.tensor_part]
            limit = 4 * len(ex.mine) + 16  # parts; the 8-bit and fp32 forms differ in count
            async for msg in aiter_with_timeout(stream, timeout):
                parts.append(msg.tensor_part)
                if len(parts) > limit:
                    raise ValueError(f"{context.remote_id} sent more than {limit} parts")
            self._accept(ex, context.remote_id, parts)
            async for part in as_aiter(*ex.mine):
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.AVERAGED_PART, tensor_part=part
                )
        except Exception as exc:
            log.warning("incoming exchange from %s failed: %r", context.remote_id, exc)
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
