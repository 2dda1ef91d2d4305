"""All-gather averaging: every member streams its whole compressed pseudo-gradient to
every other member, and each averages the same decoded bytes in the group's order with
`node.diloco.aggregate`. Bytes per member grow with the group (R-1 copies in and out);
kept selectable (`OuterConfig.averaging = "all_gather"`) as the reference scheme.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing.AsyncIterator hints

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter
from hivemind.utils.streaming import (
    STREAMING_CHUNK_SIZE_BYTES,
    combine_from_streaming,
    split_for_streaming,
)

from node.diloco import Contribution, aggregate
from node.outer.round_book import RoundBook
from node.outer.round_host import GroupRoundHost
from node.outer.wire import decode_tensor, max_wire_bytes

log = logging.getLogger(__name__)


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


class AllGatherRounds(GroupRoundHost):
    """The all-gather scheme, mixed into `StageAverager`."""

    _exchanges: RoundBook[_Exchange]

    async def _all_gather(
        self, group_info: GroupInfo, gathered: dict[PeerID, dict[str, Any]], flat: torch.Tensor
    ) -> dict[str, Any]:
        """Every member sends its whole compressed contribution to every other member."""
        await self._dial_group(gathered, self._exchange_timeout / 8)
        info = CompressionInfo.from_tensor(flat, key=0)
        serialized = self._wire.compress(flat, info, allow_inplace=False)
        mine = list(split_for_streaming(serialized))
        bytes_out_each = sum(len(p.buffer) for p in mine)
        ex = _Exchange(group_info.peer_ids, mine)
        self._exchanges.register(group_info.group_id, ex)
        try:
            me = group_info.peer_ids.index(self.peer_id)
            callees = [p for p in group_info.peer_ids[me + 1 :]]
            tasks = [
                asyncio.create_task(self._call(peer, group_info.group_id, ex)) for peer in callees
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
            own = decode_tensor(serialized, flat.numel())  # what the others decoded
            received = dict(ex.received)
            received[self.peer_id] = own
            peers = list(group_info.peer_ids)
            _head, stale, counted = self._group_claims(peers, gathered)
            order = [p for p in peers if p in received]
            contribs = [
                Contribution(
                    delta=received[p],
                    tokens=counted[peers.index(p)],
                    staleness=stale[peers.index(p)],
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
                # what this member saw itself: every member aggregates every contribution
                "accused": {order[i].to_base58(): agg.rejected[i] for i in sorted(agg.suspect)},
                "clipped": agg.clipped,  # every member computes the same aggregate
                "tokens": agg.tokens,
                "has_delta": agg.delta is not None,
                "bytes_out": bytes_out_each * (len(group_info.peer_ids) - 1),
                "bytes_in": ex.bytes_in,
                "raw_bytes": flat.numel() * flat.element_size(),
            }
        finally:
            self._exchanges.end(group_info.group_id)

    # ---- reduce-scatter + all-gather of compressed parts ---------------------------------

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
        mine = self._averaged_tensors[0]
        tensor = decode_tensor(combine_from_streaming(parts), mine.numel())
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
            ex = await self._exchanges.find(first.group_id, timeout)
            if ex is None:
                yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
                return
            if context.remote_id not in ex.peer_ids:
                yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
            parts = [first.tensor_part]
            # parts: any codec's largest message of our size (the codecs differ in bytes)
            numel = self._averaged_tensors[0].numel()
            limit = math.ceil(max_wire_bytes(numel) / STREAMING_CHUNK_SIZE_BYTES) + 1
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
