"""Reduce-scatter + all-gather of compressed parts: member j reduces part j of every
member's contribution (`node.diloco.aggregate_part`), compresses the result once and sends
the same bytes to every member, so replicas that received the same parts stay bitwise
identical and bytes per member stay about 4 (R-1)/R compressed stages, flat in the group
size R. Each reduced part carries a manifest (weight and digest of every contribution);
a member re-checks its own entry, and one member drawn from the group id audits one part
by re-aggregating it from copies of its contributions. A part whose reduced bytes never
arrive gets no update this round. Details and measurements: docs/outer-averaging.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, AsyncIterator  # noqa: UP035 - hivemind reads typing.AsyncIterator hints

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import CompressionInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from node.diloco import (
    Contribution,
    aggregate_part,
    part_bounds,
    part_share,
    staleness_weight,
)
from node.outer.parts import (
    MAX_REASON,
    Entry,
    Header,
    audit_choice,
    decode_header,
    digest,
    group_ref_norm,
    own_entry_finding,
)
from node.outer.round_book import RoundBook
from node.outer.round_host import GroupRoundHost
from node.outer.wire import decode_tensor, max_wire_bytes

log = logging.getLogger(__name__)

PUSH_RETRY_S = 0.1  # first pause before a push whose transport failed is resent (s)
PUSH_SETUP_S = 1.0  # the most one push attempt may take to be answered, plus its bytes' time (s)
PUSH_FLOOR_BPS = 1e6  # the slowest transfer a push attempt allows for (bytes/s)


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
        # contributions to our part that we rejected as no honest replica sends them
        # (peer base58 -> reason): first-hand, unlike the other reducers' manifests
        self.suspects: dict[str, str] = {}
        self.clipped = 0  # contributions to our part that centered clipping scaled down
        self.changed = asyncio.Event()  # set whenever something arrives
        self.bytes_in = 0  # tensor bytes received (wire)
        self.bytes_out = 0  # tensor bytes sent and acknowledged (wire)
        # (sender, header) of every push accepted: an ended round still acknowledges a
        # resend of one of them
        self.receipts: set[tuple[PeerID, bytes]] = set()

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


class ReduceScatterRounds(GroupRoundHost):
    """The reduce-scatter scheme, mixed into `StageAverager`."""

    _rounds: RoundBook[_Round]

    async def _reduce_scatter(
        self, group_info: GroupInfo, gathered: dict[PeerID, dict[str, Any]], flat: torch.Tensor
    ) -> dict[str, Any]:
        """Member j reduces part j of every member's contribution and sends the compressed
        result to all; every member decodes the same bytes per part. A part whose reduced
        bytes never arrive gets no update this round (zeros)."""
        t0 = time.monotonic()
        reduce_by = t0 + self._exchange_timeout / 2  # contributions after this are late
        done_by = t0 + self._exchange_timeout  # reduced parts after this are missing
        await self._dial_group(gathered, self._exchange_timeout / 8)
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
        self._rounds.register(gid, rnd)
        tasks: dict[str, asyncio.Task[bool]] = {}
        try:
            for j in range(len(bounds)):
                if j != me:
                    header = Header(kind="contrib", part=j).encode()
                    tasks[f"contrib{j}"] = asyncio.create_task(
                        self._push(rnd, gid, peers[j], header, mine[j], reduce_by)
                    )
            if audit is not None and audit[0] != me:
                header = Header(kind="audit", part=audit[1]).encode()
                tasks["audit"] = asyncio.create_task(
                    self._push(rnd, gid, peers[audit[0]], header, mine[audit[1]], done_by)
                )
            if me < len(bounds):
                rnd.contribs[self.peer_id] = (mine[me], _decoded(mine[me], bounds[me]))
                if not await rnd.wait(("contrib",), reduce_by):
                    log.warning(
                        "part %d: %d of %d contributions by %.1fs; reducing without the rest",
                        me, len(rnd.contribs), len(peers), self._exchange_timeout / 2,
                    )  # fmt: skip
                rnd.reducing = True  # later contributions are refused, not acknowledged
                loop = asyncio.get_running_loop()
                msg, manifest, rnd.suspects, rnd.clipped = await loop.run_in_executor(
                    None, self._reduce, dict(rnd.contribs), peers, me, numel, ctx
                )
                decoded = _decoded(msg, bounds[me]) if msg is not None else None
                rnd.reduced[me] = (msg, decoded, manifest)
                header = Header(kind="reduced", part=me, manifest=manifest).encode()
                for i, peer in enumerate(peers):
                    if i != me:
                        tasks[f"reduced{i}"] = asyncio.create_task(
                            self._push(rnd, gid, peer, header, msg, done_by)
                        )
            if audit is not None and audit[0] == me:
                if audit[1] < len(mine):
                    own = mine[audit[1]]
                    rnd.audits[self.peer_id] = (own, _decoded(own, bounds[audit[1]]))
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
            self._rounds.end(gid, frozenset(rnd.receipts))

    def _part_context(
        self, peers: list[PeerID], gathered: dict[PeerID, dict[str, Any]]
    ) -> dict[str, Any]:
        """What every member derives alike from the gathered metadata: each peer's owed
        weight (tokens x staleness weight), counted tokens and staleness (`_group_claims`),
        and the group's reference norm."""
        cfg = self._diloco
        _head, stale, counted = self._group_claims(peers, gathered)
        staleness = dict(zip(peers, stale, strict=True))
        tokens = dict(zip(peers, counted, strict=True))
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
        j: int,
        numel: int,
        ctx: dict[str, Any],
    ) -> tuple[runtime_pb2.Tensor | None, list[Entry], dict[str, str], int]:
        """One part's aggregate, compressed once, its manifest (in the group's order), the
        contributions it rejected as suspect (peer base58 -> reason) and how many centered
        clipping scaled down (`Aggregate.clipped`). Also the
        auditor's re-computation: the same inputs give the same bytes. `j` is the part,
        reduced by member j, whose own contribution the others' are bounded against when
        there are two (`node.diloco.pair_problem`)."""
        order = [p for p in peers if p in contribs]
        bounds = part_bounds(numel, len(peers))[j]
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
            own=order.index(peers[j]) if peers[j] in order else None,
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
        suspects = {order[i].to_base58(): agg.rejected[i][:MAX_REASON] for i in sorted(agg.suspect)}
        if agg.delta is None:
            return None, manifest, suspects, agg.clipped
        d = agg.delta.contiguous()
        msg = self._wire.compress(d, CompressionInfo.from_tensor(d, key=0))
        return msg, manifest, suspects, agg.clipped

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
                delta=_decoded(mine[j], rnd.bounds[j]),
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
        again, _, _, _ = self._reduce(listed, rnd.peer_ids, k, numel, ctx)
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
            # first-hand: the contributions our own reduction rejected as suspect, and
            # the reducers this member caught (`_check_reducers`)
            "accused": {**{p: f"part {rnd.me}: {r}" for p, r in rnd.suspects.items()}, **findings},
            "clipped": rnd.clipped,  # in our own part: every member's sum is the round's
            "tokens": token_sum // numel,
            "has_delta": any(got[0] is not None for got in rnd.reduced.values()),
            "bytes_out": rnd.bytes_out,
            "bytes_in": rnd.bytes_in,
            "raw_bytes": flat.numel() * flat.element_size(),
            "missing_parts": missing,
            "audit": list(rnd.audit) if rnd.audit is not None else None,
        }

    async def _push(
        self,
        rnd: _Round,
        gid: bytes,
        peer: PeerID,
        header: bytes,
        msg: runtime_pb2.Tensor | None,
        until: float,
    ) -> bool:
        """Send one header and compressed part to `peer`; True once it acknowledged it.
        A transport failure (a dial that fails because the p2p daemon has no route to a
        groupmate yet, a stream reset before the reply, or an attempt that stalls past
        `attempt_s`) is retried with back-off until `until` (monotonic s): the receiver
        acknowledges a copy of what it already holds, so a resend never counts twice
        (also once its round has ended). A refusal (any reply but ACCEPTED) is final."""

        async def requests() -> AsyncIterator[averaging_pb2.AveragingData]:
            yield averaging_pb2.AveragingData(
                code=averaging_pb2.PART_FOR_AVERAGING, group_id=gid, peer_id=header
            )
            for chunk in split_for_streaming(msg) if msg is not None else ():
                yield averaging_pb2.AveragingData(
                    code=averaging_pb2.PART_FOR_AVERAGING, tensor_part=chunk
                )

        size = len(msg.buffer) if msg is not None else 0
        attempt_s = PUSH_SETUP_S + size / PUSH_FLOOR_BPS
        pause = PUSH_RETRY_S
        while True:
            try:
                stub = type(self).get_stub(self._p2p, peer, namespace=self.prefix)
                left = max(0.1, min(until - time.monotonic(), attempt_s))
                reply = await stub.rpc_push_part(requests(), timeout=left)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the transport failed; the receiver may hold a copy
                if time.monotonic() + pause >= until:
                    log.warning("push to %s failed: %r", peer, exc)
                    return False
                log.info("push to %s failed (%r); resending", peer, exc)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)
                continue
            if reply.code != averaging_pb2.ACCEPTED:
                code = averaging_pb2.MessageCode.Name(reply.code)
                log.warning("push to %s refused: answered %s", peer, code)
                return False
            rnd.bytes_out += size
            return True

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
            rnd = await self._rounds.find(first.group_id, timeout)
            if rnd is None:  # a resend of what an ended round accepted is acknowledged
                done = (sender, first.peer_id) in self._rounds.receipts(first.group_id)
                # read the rest first: an answer sent while the sender still writes never
                # reaches it (its write fails, and hivemind's stub raises that instead),
                # so it would resend, and be answered so, until its deadline
                limit = 4 * self._averaged_tensors[0].numel() + 4096  # the whole stage
                await _read_chunks(stream, timeout, limit, f"{sender} to an ended round", None)
                code = averaging_pb2.ACCEPTED if done else averaging_pb2.BAD_GROUP_ID
                return averaging_pb2.AveragingData(code=code)
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
            if not ok:
                return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            limit = max_wire_bytes(b - a)  # bytes: any codec's largest message of the part
            chunks: list[runtime_pb2.Tensor] = []
            size = await _read_chunks(stream, timeout, limit, f"{sender} for part {j}", chunks)
            tensor, whole = None, None
            if chunks:
                whole = combine_from_streaming(chunks)
                tensor = _decoded(whole, (a, b))
                if tensor.dtype != torch.float32 or tensor.numel() != b - a:
                    raise ValueError(
                        f"{sender} sent {tensor.numel()} {tensor.dtype} for part {j} of {b - a}"
                    )
                if not bool(torch.isfinite(tensor).all()) and store is None:
                    raise ValueError(f"{sender} sent a reduced part with non-finite values")
            # a resend (an earlier attempt may have arrived while this one streamed):
            # acknowledged when it is the copy we hold
            held = store.get(sender) if store is not None else rnd.reduced.get(j)
            if held is not None:
                was = _digest_of(held[0]) if held[0] is not None else None
                now = _digest_of(whole) if whole is not None else None
                if was != now or (store is None and held[-1] != header.manifest):
                    raise ValueError(f"{sender} sent other bytes for part {j} than before")
                return averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)
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
            rnd.receipts.add((sender, first.peer_id))
            rnd.changed.set()
            return averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)
        except Exception as exc:
            log.warning("push from %s refused: %r", sender, exc)
            return averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)


async def _read_chunks(
    stream: AsyncIterator[averaging_pb2.AveragingData],
    timeout: float,  # s, between two messages
    limit: int,  # bytes, in all
    what: str,  # names the sender and the target in the error
    into: list[runtime_pb2.Tensor] | None,  # None: read and drop
) -> int:
    """Read a push's remaining tensor chunks to its end, at most `limit` bytes; the
    bytes read."""
    size = 0
    async for msg in aiter_with_timeout(stream, timeout):
        size += len(msg.tensor_part.buffer)
        if size > limit:
            raise ValueError(f"{what}: more than {limit} bytes")
        if into is not None:
            into.append(msg.tensor_part)
    return size


def _decoded(msg: runtime_pb2.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    """A part's message decoded, flat: as many values as the part holds, or ValueError."""
    return decode_tensor(msg, bounds[1] - bounds[0]).flatten()


def _digest_of(msg: runtime_pb2.Tensor) -> str:
    return digest(msg.compression, msg.dtype, list(msg.size), msg.buffer)


def _peer(rnd: _Round, name: str) -> PeerID | None:
    for p in rnd.peer_ids:
        if p.to_base58() == name:
            return p
    return None
