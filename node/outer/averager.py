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

from node.diloco import (
    Contribution,
    DilocoConfig,
    aggregate,
    aggregate_part,
    part_bounds,
    part_share,
    staleness_weight,
)
from node.outer.parts import (
    MAX_REASON,
    NO_METADATA,
    Entry,
    Header,
    audit_choice,
    checked_gathered,
    decode_header,
    digest,
    group_ref_norm,
    own_entry_finding,
)
from node.outer.settings import AVERAGINGS
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


class _Round:
    """One group's reduce-scatter round, inside the averager process: what arrived so far."""

    def __init__(
        self,
        peer_ids: Sequence[PeerID],
        me: int,
        bounds: list[tuple[int, int]],
        audit: tuple[int, int] | None,
    ) -> None:
        self.peer_ids = list(peer_ids)
        self.me = me
        self.bounds = bounds
        self.audit = audit  # (auditor, part) or None
        # contributions to our part, and to the audited part when we audit it:
        # peer -> (compressed message, its decoded tensor)
        self.contribs: dict[PeerID, tuple[runtime_pb2.Tensor, torch.Tensor]] = {}
        self.audits: dict[PeerID, tuple[runtime_pb2.Tensor, torch.Tensor]] = {}
        # reduced parts: index -> (message or None for "no update", decoded or None, manifest)
        self.reduced: dict[
            int, tuple[runtime_pb2.Tensor | None, torch.Tensor | None, list[Entry]]
        ] = {}
        self.reducing = False  # whether our part's reduction began (contributions closed)
        self.changed = asyncio.Event()  # set whenever something arrives
        self.bytes_in = 0  # tensor bytes received (wire)
        self.bytes_out = 0  # tensor bytes sent and acknowledged (wire)

    def owed(self, kind: str) -> int:
        """How many pushes of `kind` this member waits for."""
        members, parts = len(self.peer_ids), len(self.bounds)
        if kind == "contrib":
            return members - 1 if self.me < parts else 0
        if kind == "audit":
            return members - 1 if self.audit is not None and self.audit[0] == self.me else 0
        return parts - 1 if self.me < parts else parts

    def have(self, kind: str) -> int:
        if kind == "contrib":
            return len([p for p in self.contribs if p != self.peer_ids[self.me]])
        if kind == "audit":
            return len([p for p in self.audits if p != self.peer_ids[self.me]])
        return len([j for j in self.reduced if j != self.me])

    async def wait(self, kinds: tuple[str, ...], deadline: float) -> bool:
        """Until every push of `kinds` arrived (True) or `deadline` (monotonic s) passed."""
        while any(self.have(k) < self.owed(k) for k in kinds):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                return False
        return True


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
        scheme: str = "reduce_scatter",
        **kwargs: Any,
    ) -> None:
        if scheme not in AVERAGINGS:
            raise ValueError(f"scheme must be one of {AVERAGINGS}, got {scheme!r}")
        self._scheme = scheme
        self._rounds: dict[bytes, _Round] = {}
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
            try:
                _bandwidth, _mode, user = self.serializer.loads(raw)
                gathered[pid] = checked_gathered(self.serializer.loads(user))
            except Exception:  # a member's metadata that does not even decode
                gathered[pid] = dict(NO_METADATA)
        async with enter_asynchronously(self.get_tensors()) as tensors:
            if self._scheme == "reduce_scatter":
                return await self._reduce_scatter(group_info, gathered, tensors[0])
            return await self._all_gather(group_info, gathered, tensors[0])

    async def _all_gather(
        self, group_info: GroupInfo, gathered: dict[PeerID, dict[str, Any]], flat: torch.Tensor
    ) -> dict[str, Any]:
        """Every member sends its whole compressed contribution to every other member."""
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

    # ---- reduce-scatter + all-gather of compressed parts ---------------------------------

    async def _reduce_scatter(
        self, group_info: GroupInfo, gathered: dict[PeerID, dict[str, Any]], flat: torch.Tensor
    ) -> dict[str, Any]:
        """Member j reduces part j of every member's contribution and sends the compressed
        result to all; every member decodes the same bytes per part. A part whose reduced
        bytes never arrive gets no update this round (zeros)."""
        t0 = time.monotonic()
        reduce_by = t0 + self._exchange_timeout / 2  # contributions after this are late
        done_by = t0 + self._exchange_timeout  # reduced parts after this are missing
        peers = list(group_info.peer_ids)
        me = peers.index(self.peer_id)
        numel = flat.numel()
        bounds = part_bounds(numel, len(peers))
        audit = audit_choice(group_info.group_id, len(peers), len(bounds))
        rnd = _Round(peers, me, bounds, audit)
        ctx = self._part_context(peers, gathered)
        mine = [
            self._wire.compress(
                flat[a:b].clone(),
                CompressionInfo.from_tensor(flat[a:b], key=0),
                allow_inplace=False,
            )
            for a, b in bounds
        ]
        sent_digests = [_digest_of(m) for m in mine]
        gid = group_info.group_id
        self._rounds[gid] = rnd
        event = self._registration_event()
        event.set()
        event.clear()
        tasks: dict[str, asyncio.Task[bool]] = {}
        try:
            for j in range(len(bounds)):
                if j != me:
                    header = Header(kind="contrib", part=j).encode()
                    tasks[f"contrib{j}"] = asyncio.create_task(
                        self._push(rnd, gid, peers[j], header, mine[j])
                    )
            if audit is not None and audit[0] != me:
                header = Header(kind="audit", part=audit[1]).encode()
                tasks["audit"] = asyncio.create_task(
                    self._push(rnd, gid, peers[audit[0]], header, mine[audit[1]])
                )
            if me < len(bounds):
                rnd.contribs[self.peer_id] = (mine[me], decode_tensor(mine[me]).flatten())
                if not await rnd.wait(("contrib",), reduce_by):
                    log.warning(
                        "part %d: %d of %d contributions by %.1fs; reducing without the rest",
                        me, len(rnd.contribs), len(peers), self._exchange_timeout / 2,
                    )  # fmt: skip
                rnd.reducing = True  # later contributions are refused, not acknowledged
                loop = asyncio.get_running_loop()
                msg, manifest = await loop.run_in_executor(
                    None, self._reduce, dict(rnd.contribs), peers, bounds[me], numel, ctx
                )
                decoded = decode_tensor(msg).flatten() if msg is not None else None
                rnd.reduced[me] = (msg, decoded, manifest)
                header = Header(kind="reduced", part=me, manifest=manifest).encode()
                for i, peer in enumerate(peers):
                    if i != me:
                        tasks[f"reduced{i}"] = asyncio.create_task(
                            self._push(rnd, gid, peer, header, msg)
                        )
            if audit is not None and audit[0] == me:
                if audit[1] < len(mine):
                    own = mine[audit[1]]
                    rnd.audits[self.peer_id] = (own, decode_tensor(own).flatten())
            if not await rnd.wait(("reduced", "audit"), done_by):
                log.warning(
                    "reduced parts: %d of %d by %.1fs; the missing ones get no update",
                    len(rnd.reduced), len(bounds), self._exchange_timeout,
                )  # fmt: skip
            for a_b, j in zip(bounds, range(len(bounds)), strict=True):
                got = rnd.reduced.get(j)
                if got is not None and got[1] is not None:
                    flat[a_b[0] : a_b[1]].copy_(got[1])
                else:
                    flat[a_b[0] : a_b[1]].zero_()
            if tasks:  # let the last pushes finish, never past the round's deadline
                await asyncio.wait(tasks.values(), timeout=max(0.0, done_by - time.monotonic()))
            acked = {k: t.done() and not t.cancelled() and t.result() for k, t in tasks.items()}
            findings = self._check_reducers(rnd, ctx, mine, sent_digests, acked)
            return self._part_summary(rnd, gathered, ctx, findings, numel, flat)
        finally:
            for task in tasks.values():
                task.cancel()
            self._rounds.pop(gid, None)

    def _part_context(
        self, peers: list[PeerID], gathered: dict[PeerID, dict[str, Any]]
    ) -> dict[str, Any]:
        """What every member derives alike from the gathered metadata: each peer's owed
        weight (tokens x staleness weight), tokens, staleness, and the group's reference
        norm."""
        head = max(int(g["round"]) for g in gathered.values())
        staleness = {p: max(0, head - int(gathered[p]["base_round"])) for p in peers}
        tokens = {p: int(gathered[p]["tokens"]) for p in peers}
        cfg = self._diloco
        owed = {
            p: tokens[p] * staleness_weight(staleness[p], cfg.staleness_decay, cfg.max_staleness)
            for p in peers
        }
        ref = group_ref_norm([gathered[p] for p in peers])
        return {"staleness": staleness, "tokens": tokens, "owed": owed, "ref_norm": ref}

    def _reduce(
        self,
        contribs: dict[PeerID, tuple[runtime_pb2.Tensor, torch.Tensor]],
        peers: list[PeerID],
        bounds: tuple[int, int],
        numel: int,
        ctx: dict[str, Any],
    ) -> tuple[runtime_pb2.Tensor | None, list[Entry]]:
        """One part's aggregate, compressed once, and its manifest (in the group's order).
        Also the auditor's re-computation: the same inputs give the same bytes."""
        order = [p for p in peers if p in contribs]
        agg = aggregate_part(
            [
                Contribution(
                    delta=contribs[p][1], tokens=ctx["tokens"][p], staleness=ctx["staleness"][p]
                )
                for p in order
            ],
            ctx["ref_norm"],
            part_share(bounds, numel),
            self._diloco,
        )
        manifest = [
            Entry(
                peer=p.to_base58(),
                weight=float(agg.weights[i]),
                reason=agg.rejected.get(i, "")[:MAX_REASON],
                digest=_digest_of(contribs[p][0]),
            )
            for i, p in enumerate(order)
        ]
        if agg.delta is None:
            return None, manifest
        d = agg.delta.contiguous()
        return self._wire.compress(d, CompressionInfo.from_tensor(d, key=0)), manifest

    def _check_reducers(
        self,
        rnd: _Round,
        ctx: dict[str, Any],
        mine: list[runtime_pb2.Tensor],
        sent_digests: list[str],
        acked: dict[str, bool],
    ) -> dict[str, str]:
        """Reducer (base58) -> what this member caught it at: a manifest that misreports
        this member's own acknowledged contribution, and, for the auditor, a part whose
        bytes differ from the aggregate of the contributions its manifest lists."""
        me = self.peer_id
        numel = sum(b - a for a, b in rnd.bounds)
        findings: dict[str, str] = {}
        for j, (_msg, _t, manifest) in sorted(rnd.reduced.items()):
            if j == rnd.me or not acked.get(f"contrib{j}", False):
                continue
            own = Contribution(
                delta=decode_tensor(mine[j]).flatten(),
                tokens=ctx["tokens"][me],
                staleness=ctx["staleness"][me],
            )
            alone = aggregate_part(
                [own], ctx["ref_norm"], part_share(rnd.bounds[j], numel), self._diloco
            )
            finding = own_entry_finding(
                manifest, me.to_base58(), sent_digests[j], ctx["owed"][me], alone.rejected.get(0)
            )
            if finding is not None:
                findings[rnd.peer_ids[j].to_base58()] = f"reducer of part {j}: {finding}"
        if rnd.audit is not None and rnd.audit[0] == rnd.me and rnd.audit[1] in rnd.reduced:
            k = rnd.audit[1]
            finding = self._audit(rnd, k, ctx, numel)
            if finding is not None:
                findings[rnd.peer_ids[k].to_base58()] = f"reducer of part {k}: {finding}"
        for reducer, text in findings.items():
            log.warning("caught %s: %s", reducer, text)
        return findings

    def _audit(self, rnd: _Round, k: int, ctx: dict[str, Any], numel: int) -> str | None:
        """Re-aggregate part `k` from the contributions its manifest lists, as this member
        received them, and compare the bytes with the reducer's."""
        msg, _t, manifest = rnd.reduced[k]
        by_name = {p.to_base58(): p for p in rnd.peer_ids}
        listed: dict[PeerID, tuple[runtime_pb2.Tensor, torch.Tensor]] = {}
        for e in manifest:
            peer = by_name.get(e.peer)
            if peer is None:
                return f"its manifest lists {e.peer[:64]!r}, no member of the group"
            if e.weight not in (0.0, ctx["owed"][peer]) or (e.weight == 0.0) != bool(e.reason):
                return f"weighted {e.peer} {e.weight!r}, owed {ctx['owed'][peer]!r}"
            if peer not in rnd.audits:
                log.info("audit of part %d skipped: no copy of %s's contribution", k, e.peer)
                return None
            if _digest_of(rnd.audits[peer][0]) != e.digest:
                return f"lists other bytes for {e.peer} than {e.peer} sent the auditor"
            listed[peer] = rnd.audits[peer]
        if [e.peer for e in manifest] != [p.to_base58() for p in rnd.peer_ids if p in listed]:
            return "its manifest is not in the group's order"
        again, _ = self._reduce(listed, rnd.peer_ids, rnd.bounds[k], numel, ctx)
        if (again is None) != (msg is None):
            return "sent an update where the audit finds none, or none where it finds one"
        if again is not None and msg is not None and _digest_of(again) != _digest_of(msg):
            return "its reduced bytes differ from the aggregate of the contributions it lists"
        return None

    def _part_summary(
        self,
        rnd: _Round,
        gathered: dict[PeerID, dict[str, Any]],
        ctx: dict[str, Any],
        findings: dict[str, str],
        numel: int,
        flat: torch.Tensor,
    ) -> dict[str, Any]:
        """The round's result in the all-gather's shape, from the reduced parts' manifests
        (alike on every member that received the same parts): a peer's weight and the
        round's tokens are their part-length-weighted means over the parts."""
        weight: dict[str, float] = {}
        token_sum = 0  # sum over parts of part length x tokens weighted there
        rejected: dict[str, list[str]] = {}
        for j, (a, b) in enumerate(rnd.bounds):
            got = rnd.reduced.get(j)
            if got is None:
                continue
            for e in got[2]:
                weight[e.peer] = weight.get(e.peer, 0.0) + (b - a) * e.weight / numel
                if e.weight > 0.0:
                    token_sum += (b - a) * ctx["tokens"].get(_peer(rnd, e.peer), 0)
                elif e.reason:
                    rejected.setdefault(e.peer, []).append(f"part {j}: {e.reason}")
        order = [p.to_base58() for p in rnd.peer_ids]
        contributors = [p for p in order if p in weight]
        out_rejected = {p: "; ".join(r)[:MAX_REASON] for p, r in rejected.items()}
        out_rejected.update(findings)
        missing = [j for j in range(len(rnd.bounds)) if j not in rnd.reduced]
        for j in missing:
            out_rejected.setdefault(
                order[j], f"part {j}: its reduced bytes did not arrive (no update there)"
            )
        return {
            "gathered": {p.to_base58(): g for p, g in gathered.items()},
            "order": order,
            "contributors": contributors,
            "weights": [weight[p] for p in contributors],
            "rejected": out_rejected,
            "tokens": token_sum // numel,
            "has_delta": any(got[0] is not None for got in rnd.reduced.values()),
            "bytes_out": rnd.bytes_out,
            "bytes_in": rnd.bytes_in,
            "raw_bytes": flat.numel() * flat.element_size(),
            "missing_parts": missing,
            "audit": list(rnd.audit) if rnd.audit is not None else None,
        }

    async def _push(
        self, rnd: _Round, gid: bytes, peer: PeerID, header: bytes, msg: runtime_pb2.Tensor | None
    ) -> bool:
        """Send one header and compressed part to `peer`; True once it acknowledged it."""

        async def requests() -> AsyncIterator[averaging_pb2.AveragingData]:
            yield averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING, group_id=gid, peer_id=header
            )
            for chunk in split_for_streaming(msg) if msg is not None else ():
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING, tensor_part=chunk
                )

        try:
            stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
            reply = await stub.rpc_push_part(requests(), timeout=self._exchange_timeout)
            if reply.code != averaging_pb2.ACCEPTED:
                raise RuntimeError(f"answered {averaging_pb2.MessageCode.Name(reply.code)}")
            rnd.bytes_out += len(msg.buffer) if msg is not None else 0
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("push to %s failed: %r", peer, exc)
            return False

    async def rpc_push_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> averaging_pb2.AveragingData:
        """A groupmate pushes a contribution to our part, one to the part we audit, or its
        reduced part with its manifest. The first message carries the group id and the
        header (`node.outer.parts.Header`, in the `peer_id` field); tensor chunks follow."""
        timeout = self._exchange_timeout
        sender = context.remote_id
        try:
            first = await asyncio.wait_for(stream.__anext__(), timeout)
            deadline = time.monotonic() + timeout
            rnd = self._rounds.get(first.group_id)
            while rnd is None and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(
                        self._registration_event().wait(), deadline - time.monotonic()
                    )
                except TimeoutError:
                    break
                rnd = self._rounds.get(first.group_id)
            if rnd is None:
                return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            if sender not in rnd.peer_ids or sender == self.peer_id:
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            header = decode_header(first.peer_id, len(rnd.bounds))
            j, i = header.part, rnd.peer_ids.index(sender)
            a, b = rnd.bounds[j]
            if header.kind == "contrib":
                ok, store = j == rnd.me, rnd.contribs
            elif header.kind == "audit":
                ok, store = rnd.audit == (rnd.me, j), rnd.audits
            else:
                ok, store = j == i and j != rnd.me, None
            if (
                not ok
                or (store is not None and sender in store)
                or j in rnd.reduced
                and store is None
            ):
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            limit = 4 * (b - a) + 4096  # bytes: fp32 with no codec, plus a codebook
            chunks: list[runtime_pb2.Tensor] = []
            size = 0
            async for msg in aiter_with_timeout(stream, timeout):
                size += len(msg.tensor_part.buffer)
                if size > limit:
                    raise ValueError(f"{sender} sent more than {limit} bytes for part {j}")
                chunks.append(msg.tensor_part)
            tensor, whole = None, None
            if chunks:
                whole = combine_from_streaming(chunks)
                tensor = decode_tensor(whole).flatten()
                if tensor.dtype != torch.float32 or tensor.numel() != b - a:
                    raise ValueError(
                        f"{sender} sent {tensor.numel()} {tensor.dtype} for part {j} of {b - a}"
                    )
                if not bool(torch.isfinite(tensor).all()) and store is None:
                    raise ValueError(f"{sender} sent a reduced part with non-finite values")
            if store is not None:
                if header.kind == "contrib" and rnd.reducing:  # too late: never acknowledged
                    return averaging_pb2.AveragingData(code=averaging_pb2.CANCELLED)
                if whole is None or tensor is None:
                    raise ValueError(f"{sender} sent no tensor for part {j}")
                store[sender] = (whole, tensor)
            else:
                assert header.manifest is not None
                rnd.reduced[j] = (whole, tensor, header.manifest)
            rnd.bytes_in += size
            rnd.changed.set()
            return averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)
        except Exception as exc:
            log.warning("push from %s refused: %r", sender, exc)
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)

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


def _digest_of(msg: runtime_pb2.Tensor) -> str:
    return digest(msg.compression, msg.dtype, list(msg.size), msg.buffer)


def _peer(rnd: _Round, name: str) -> PeerID | None:
    for p in rnd.peer_ids:
        if p.to_base58() == name:
            return p
    return None
