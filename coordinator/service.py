"""Request handling: verify a signed frame, check auth and rate, and apply it to the
membership and the lease book. Synchronous and clock-free (the caller passes `now`), so
the asyncio server stays a thin shell. Every durable state change lands in the shared
journal; the server writes it before sending the reply this returns.

Liveness is soft state (`coordinator.leases`, `coordinator.membership`): a heartbeat
that only renews its peer and its leases changes nothing durable, and its answer is
soft (`Answer.durable` false): the server sends it without waiting for a write. A
heartbeat reply that reports a move or a fence, or follows an announced DHT address
change, waits like every other reply: it must not reveal state a crash could undo.
"""

from __future__ import annotations

import collections
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from coordinator.accuse import Accusations
from coordinator.attest import Attestations, LiveOn
from coordinator.config import CoordinatorConfig
from coordinator.edge import RateLimiter
from coordinator.facilities import FacilityBook, PlacementPolicy
from coordinator.fastpath import BodyCache, soft
from coordinator.journal import Journal
from coordinator.leases import LeaseBook, LeaseError
from coordinator.membership import DEAD, LEFT, Membership, Peer
from coordinator.metrics import CoordinatorMetrics
from coordinator.moderation import Moderation
from coordinator.placement import MemoryFit
from coordinator.verify import PeerIds, signature_ok
from coordinator.witness import WitnessBook
from protocol import control as c
from protocol.addrs import owner_problem
from protocol.codec import schema_limits
from protocol.corpus import Manifest, ShardInfo, shard_slice
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.launch import FacilityReport
from protocol.message import Message
from protocol.model_config import run_model_config
from protocol.signing import ReplayGuard, SignedRequest, open_envelope

log = logging.getLogger(__name__)


class BadFrame(Exception):
    """The frame is not a decodable signed request; the connection gets closed."""


class Answer(NamedTuple):
    """What the service made of one request."""

    method: str  # the request type ("unknown" before the body was read)
    reply: Message
    # the reply waits until every change made so far is durable (false: soft, sent at once)
    durable: bool = True
    # the signature verified and the nonce was fresh: the key sent this very request
    fresh: bool = False


def _err(code: str, detail: str) -> c.ErrorReply:
    return c.ErrorReply(code=code, detail=detail[:1024])


class Service(Moderation):
    def __init__(
        self,
        cfg: CoordinatorConfig,
        *,
        manifest: Manifest,
        corpus: bytes,
        journal: Journal,
        membership: Membership,
        book: LeaseBook,
        metrics: CoordinatorMetrics,
        paused: bool = False,
        tokenizer_json: bytes = b"",
        credit_key: NodeKey | None = None,  # signs members' credits (coordinator.tls)
    ) -> None:
        self.cfg = cfg
        self.manifest = manifest
        self.corpus = corpus
        self.tokenizer_json = tokenizer_json  # the run's tokenizer.json (b"": bytes)
        self.journal = journal
        self.membership = membership
        self.book = book
        self.metrics = metrics
        self.paused = paused
        self.started = time.time()
        # signatures made before this process started are refused: the nonces an
        # earlier process saw are not kept (see docs/reliability.md, Hostile input)
        self.guard = ReplayGuard(skew_s=cfg.clock_skew_s, not_before=self.started)
        self.limiter = RateLimiter(cfg.rate_per_peer, cfg.rate_burst)  # per key
        # per source host (`edge.host_key`), applied by the server before signatures
        self.host_limiter = RateLimiter(cfg.rate_per_host, cfg.host_burst)
        self.peer_ids = PeerIds()
        self.allowlist = set(cfg.allowlist)
        # only training shards are served: a member that held the held-out shards could
        # train on the evaluation data (evaluation reads them locally, by the manifest)
        self.shards: dict[int, ShardInfo] = {s.shard_id: s for s in manifest.train}
        self.heldout_ids = {s.shard_id for s in manifest.heldout}
        self.progress: collections.deque[tuple[float, int]] = collections.deque(maxlen=120)
        self.committed_total = 0  # tokens committed since start (for the rate estimate)
        # queue-aware placement across HPC facilities (coordinator/facilities.py)
        self.facilities = FacilityBook(PlacementPolicy.from_config(cfg), cfg)
        # memory-aware placement on stages (coordinator/placement.py), for the model the
        # nodes build (RunInfo: preset, seed, vocabulary, layers per stage)
        vocab = manifest.vocab_size if tokenizer_json else 0
        model = run_model_config(
            cfg.model_preset, seed=cfg.seed, vocab_size=vocab, split=cfg.stage_layers or ()
        )
        self.memory_fit = MemoryFit(model, cfg.n_stages)
        self.attest = Attestations()  # replicas' reported states (coordinator/attest.py)
        # what replicas caught each other at (coordinator/accuse.py, coordinator/moderation.py)
        self.accusations = Accusations(strikes=cfg.accuse_strikes, window_s=cfg.accuse_window_s)
        # claimed throughput checked against witnessed work (coordinator/witness.py)
        self.witness = WitnessBook.from_config(cfg, started=self.started, key=credit_key)
        self._handlers: dict[type[Message], Callable[..., Message]] = {
            c.HeartbeatRequest: self._heartbeat,
            c.MembershipRequest: self._membership,
            c.ManifestRequest: self._manifest,
            c.LeaseAcquire: self._acquire,
            c.LeaseCommit: self._commit,
            c.LeaseComplete: self._complete,
            c.LeaseRelease: self._release,
            c.ShardFetch: self._shard,
            c.TokenizerFetch: self._tokenizer,
            c.LeaveRequest: self._leave,
        }
        self._admin: dict[type[Message], Callable[..., Message]] = {
            c.AdminDrain: self._drain,
            c.AdminBan: self._ban,
            c.AdminPause: self._pause,
        }
        # a body is read under the bounds of the requests answered here, the whole object's
        # arrays and maps included: a signed body of a million empty arrays, each array
        # within the per-array bound, is refused after a few thousand
        requests = [c.StatusRequest, c.JoinRequest, FacilityReport, *self._handlers, *self._admin]
        self.body_limits = schema_limits(*requests, max_size=cfg.max_request_bytes)
        self.bodies = BodyCache(limits=self.body_limits, max_size=cfg.max_request_bytes)

    # -- entry point --------------------------------------------------------------------

    def handle(self, payload: bytes, host: str, now: float) -> Answer:
        """Answer one frame payload. Raises `BadFrame`."""
        req = self.open(payload)
        return self.apply(req, signature_ok(req, self.cfg.run_id, None), host, now)

    def open(self, payload: bytes) -> SignedRequest:
        """Decode a frame payload into a signed request (not yet verified); `BadFrame`."""
        try:
            return open_envelope(payload, max_size=self.cfg.max_request_bytes)
        except ProtocolError as exc:
            raise BadFrame(str(exc)) from exc

    def apply(self, req: SignedRequest, verified: bool, host: str, now: float) -> Answer:
        """Answer an opened request whose signature check gave `verified` (see
        `signature_ok`; the server may run those checks off the event loop)."""
        if not verified:
            scope = "no run" if req.any_run else f"run {self.cfg.run_id!r}"
            why = f"signature does not verify for {scope}"
            return Answer("unknown", _err("bad_signature", why))
        # the per-key bucket before the replay guard: a flood is refused before its
        # nonces could crowd live ones out of the guard's table
        if not self.limiter.allow(req.key, now):
            why = "too many requests from this key; back off"
            return Answer("unknown", _err("rate_limited", why))
        try:
            self.guard.check(req.key, req.nonce, req.ts, now)
        except ProtocolError as exc:
            return Answer("unknown", _err("replay", str(exc)))
        try:
            body = self.bodies.decode(req)
        except ProtocolError as exc:
            return Answer("unknown", _err("bad_request", str(exc)), fresh=True)
        method = body.TYPE
        if req.any_run and not isinstance(body, c.StatusRequest):
            return Answer(method, _err(
                "bad_request", f"only a status request may be signed for no run; sign for run"
                f" {self.cfg.run_id!r} (StatusReply.run_id)",
            ), fresh=True)  # fmt: skip
        try:
            reply = self._dispatch(req.key, body, host, now)
            return Answer(method, reply, not soft(body, reply), fresh=True)
        except LeaseError as exc:
            if exc.code == "fenced":
                self.metrics.fenced.inc()
                if exc.recorded:
                    self.metrics.fence_records.inc()
            return Answer(method, _err(exc.code, exc.detail), fresh=True)
        except Exception:  # a bug must not take the server down
            log.exception("internal error handling %s", method)
            return Answer(method, _err("internal", f"internal error handling {method}"), fresh=True)

    def _dispatch(self, key: bytes, body: Message, host: str, now: float) -> Message:
        if isinstance(body, c.StatusRequest):
            return self.status(now)
        peer_id = self.peer_ids(key)
        if isinstance(body, FacilityReport):  # launcher on a login node
            return self.facilities.handle(peer_id, body, now)
        if isinstance(body, c.JoinRequest):
            return self._join(key, peer_id, body, host, now)
        admin = self._admin.get(type(body))
        if admin is not None:
            token = self.cfg.admin_token
            if not token or not hmac.compare_digest(
                getattr(body, "admin_token", "").encode(), token.encode()
            ):
                log.warning("admin call %s refused: bad admin token", body.TYPE)
                return _err("forbidden", "admin calls need the run's admin token")
            return admin(body, now)
        handler = self._handlers.get(type(body))
        if handler is None:
            return _err("bad_request", f"{body.TYPE!r} is not a request")
        if peer_id in self.membership.banned:
            return _err("banned", "this peer is banned from the run")
        peer = self.membership.live.get(peer_id)
        if peer is None:
            if isinstance(body, c.LeaseCommit | c.LeaseComplete | c.LeaseRelease):
                lease = self.book.leases.get(body.lease_id)
                if lease is None or lease.holder != peer_id:
                    # not this key's lease: refused without touching the book (whose
                    # fences are audited, durable writes a stranger must not cause)
                    return _err("fenced", f"lease {body.lease_id} is not held by this peer")
                # a lapsed holder's lease calls are answered by the lease book: `fenced`
                stub = Peer(peer_id, key, 0, (), (), "", 0.0, None, None, None, False, now, now)
                return handler(stub, body, now)
            return _err("not_member", "not a live member (membership lapsed?): join first")
        return handler(peer, body, now)

    # -- membership ---------------------------------------------------------------------

    def _join(self, key: bytes, peer_id: str, req: c.JoinRequest, host: str, now: float) -> Message:
        if peer_id in self.membership.banned:
            return _err("banned", "this peer is banned from the run")
        if self.cfg.auth == "token" and not hmac.compare_digest(
            req.join_token.encode(), self.cfg.join_token.encode()
        ):
            log.info("join refused (bad join token) from %s", peer_id)
            return _err("unauthorized", "this run needs a valid join token")
        if self.cfg.auth == "allowlist" and peer_id not in self.allowlist:
            log.info("join refused (not on the allowlist) from %s", peer_id)
            return _err("unauthorized", "this peer id is not on the run's allowlist")
        if req.stage is not None and req.stage >= self.cfg.n_stages:
            return _err("bad_request", f"stage {req.stage} >= n_stages {self.cfg.n_stages}")
        if req.observer and req.stage is not None:
            return _err("bad_request", "an observer is on no stage: leave `stage` unset")
        if (why := owner_problem(req.dht_addrs, peer_id)) is not None:
            return _err("bad_request", f"dht_addrs: {why}")
        fits = None if req.observer else self.memory_fit.stages(req.memory)
        if fits is not None and req.memory is not None:
            why = self.memory_fit.refusal(req.memory, fits, req.stage)
            if why is not None:
                log.info("join refused (no stage fits its memory) from %s: %s", peer_id, why)
                return _err("no_stage_fits", why)
        live = self.membership.live.get(peer_id)
        if req.observer and live is not None and not live.observer:
            # the re-join below would evict a training node and fence its leases
            return _err(
                "bad_request", "this identity is a live training member; observe with another"
            )
        if peer_id in self.membership.live:  # a re-join replaces the old membership
            self.book.release_holder(peer_id, now, expired=True)
            self.membership.remove(peer_id, LEFT)
        if req.observer:  # listed, on no stage: never placed, routed to or given leases
            stage = self.cfg.n_stages
        else:
            open_to = self.membership.open_stages(host, fits)
            if req.stage is not None and req.stage not in open_to or not open_to:
                where = f"stage {req.stage}" if req.stage is not None else "every stage it fits"
                log.info("join refused (source %s holds its share) from %s", host, peer_id)
                return _err("source_share", f"members from {host} hold their share of {where}")
            stage = req.stage if req.stage is not None else self.membership.place(open_to)
        w = self.witness
        throughput = req.throughput if w is None else w.admit(peer_id, stage, req.throughput)
        peer = Peer(
            peer_id=peer_id,
            public_key=key,
            stage=stage,
            addrs=tuple(req.addrs),
            dht_addrs=tuple(req.dht_addrs),
            device=req.device,
            throughput=throughput,
            deadline=req.deadline,
            metrics_host=None if req.observer else host,  # the source, never a claim
            metrics_port=None if req.observer else req.metrics_port,  # not a scrape target
            fixed_stage=req.stage is not None or req.observer,
            joined_at=now,
            expires_at=now + self.cfg.lease_ttl_s,
            observer=req.observer,
            memory=req.memory,
            fits=fits,
        )
        self.membership.join(peer)
        self.metrics.joins.inc()
        if req.observer:
            log.info("join %s as an observer (%s)", peer_id, req.device)
        else:
            log.info(
                "join %s -> stage %d (%s, %.0f tok/s)", peer_id, stage, req.device, req.throughput
            )
        return c.JoinReply(
            peer_id=peer_id,
            stage=stage,
            run=self.run_info(),
            membership_version=self.membership.version,
        )

    def run_info(self) -> c.RunInfo:
        cfg = self.cfg
        return c.RunInfo(
            run_id=cfg.run_id,
            model_preset=cfg.model_preset,
            n_stages=cfg.n_stages,
            codec=cfg.codec,
            seed=cfg.seed,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            lease_ttl_s=cfg.lease_ttl_s,
            dataset_name=self.manifest.name,
            dataset_hash=self.manifest.content_hash,
            vocab_size=self.manifest.vocab_size if self.tokenizer_json else 0,
            tokenizer_hash=self.manifest.tokenizer_hash,
            shards=len(self.manifest.train),
            data_epoch=self.book.data_epoch,
            relays=list(cfg.relays),
            sweep_interval_s=cfg.sweep_interval_s,
            stage_layers=list(cfg.stage_layers or []),
        )

    def _heartbeat(self, peer: Peer, req: c.HeartbeatRequest, now: float) -> Message:
        if req.dht_addrs is not None:
            if (why := owner_problem(req.dht_addrs, peer.peer_id)) is not None:
                return _err("bad_request", f"dht_addrs: {why}")
        w = self.witness  # with it on, a heartbeat's claim is checked (coordinator/witness.py)
        claim = (
            req.throughput if w is None else w.heartbeat(peer, req, self.membership.stage_of, now)
        )
        self.membership.renew(peer.peer_id, now, claim)
        if req.state is not None and not peer.observer:
            self.attest.report(peer.peer_id, peer.stage, (req.state.round, req.state.digest))
        if req.dht_addrs is not None:
            self.membership.announce(peer.peer_id, req.dht_addrs, now)
        if req.accused:
            self.judge(peer, req.accused, now)
        held = self.book.renew(peer.peer_id, now)
        renewed = [c.LeaseRef(lease_id=x.lease_id, epoch=x.epoch) for x in held]
        live = {(x.lease_id, x.epoch) for x in held}
        fenced = [r for r in req.leases if (r.lease_id, r.epoch) not in live]
        moved, peer.moved = peer.moved, False
        # stage 0 leases the data: tell its nodes that a range waits for a holder
        takes_leases = peer.stage == 0 and not (peer.observer or peer.drain or self.paused)
        return c.HeartbeatReply(
            stage=peer.stage,
            moved=moved,
            drain=peer.drain,
            paused=self.paused,
            renewed=renewed,
            fenced=fenced,
            expires_at=peer.expires_at,
            membership_version=self.membership.version,
            data_epoch=self.book.data_epoch,
            freed=self.book.freed_waiting() if takes_leases else 0,
            attested=self.attested(peer.stage),
            credit=b"" if w is None else w.credit(peer, now),
        )

    def attested(self, stage: int) -> c.StateRef | None:
        """The stage's attested state (coordinator.attest), over its live replicas."""
        found = self.attest.attested(stage, LiveOn(self.membership.live, stage))
        return c.StateRef(round=found[0], digest=found[1]) if found is not None else None

    def _membership(self, peer: Peer, req: c.MembershipRequest, now: float) -> Message:
        return self.membership.delta(
            req.since, req.stage, after=req.after, page=self.cfg.membership_page_peers
        )

    def _manifest(self, peer: Peer, req: c.ManifestRequest, now: float) -> Message:
        return self.manifest

    def _leave(self, peer: Peer, req: c.LeaveRequest, now: float) -> Message:
        released = self.book.release_holder(peer.peer_id, now, expired=False)
        self.membership.remove(peer.peer_id, LEFT)
        self.forget_peer(peer.peer_id)
        self.metrics.leaves.labels("left").inc()
        log.info("leave %s (released %d leases)", peer.peer_id, len(released))
        return c.OkReply(detail=f"left; released {len(released)} leases")

    def expire(self, now: float) -> tuple[int, int]:
        """Drop lapsed peers (their leases expire) and lapsed leases; returns counts."""
        dead = self.membership.expire_due(now)
        n = 0
        for p in dead:
            self.forget_peer(p.peer_id)
            n += len(self.book.release_holder(p.peer_id, now, expired=True))
            log.info("peer %s lapsed (no heartbeat for %.1fs)", p.peer_id, self.cfg.lease_ttl_s)
        n += len(self.book.expire_due(now))
        if dead:
            self.metrics.leaves.labels(DEAD).inc(len(dead))
        if n:
            self.metrics.expired.inc(n)
        return len(dead), n

    def rebalance(self, now: float) -> Peer | None:
        """Count each member's throughput from its claim and the work others witnessed
        (coordinator/witness.py), then move one peer if a stage is clearly behind."""
        if self.witness is not None:
            counted = self.witness.recount(self.membership.live.values(), now)
            for pid, value in counted.items():
                self.membership.set_throughput(pid, value)
            self.metrics.capped.set(sum(v < self.witness.claims[p] for p, v in counted.items()))
        moved = self.membership.rebalance(
            self.cfg.rebalance_ratio, lambda pid: pid in self.book.by_holder
        )
        if moved is not None:
            self.metrics.moves.inc()
            log.info("rebalance: moved %s to stage %d", moved.peer_id, moved.stage)
        return moved

    # -- leases -------------------------------------------------------------------------

    def _lease_info(self, lease: Any) -> c.LeaseInfo:
        return c.LeaseInfo(
            lease_id=lease.lease_id,
            shard_id=lease.shard_id,
            epoch=lease.epoch,
            data_epoch=lease.data_epoch,
            committed=lease.committed,
            limit=lease.limit,
            shard_tokens=lease.shard_tokens,
            expires_at=lease.expires_at,
            state=lease.state,
        )

    def _acquire(self, peer: Peer, req: c.LeaseAcquire, now: float) -> Message:
        if peer.observer:
            return c.LeaseGrant(reason="observer")
        if self.paused:
            return c.LeaseGrant(reason="paused")
        if peer.drain:
            return c.LeaseGrant(reason="draining")
        if len(self.book.by_holder.get(peer.peer_id, {})) >= self.cfg.max_leases_per_peer:
            return c.LeaseGrant(reason="max_leases")
        if self.book.over_share(peer.peer_id, self.membership.stage_counts()[0]):
            return c.LeaseGrant(reason="fair_share")
        left_s = None if peer.deadline is None else peer.deadline - now - self.cfg.deadline_margin_s
        budget = None if left_s is None else int(max(0.0, left_s) * peer.throughput)
        cap = req.max_tokens
        if self.cfg.grant_tokens:  # 0 or None: the rest of the shard
            cap = self.cfg.grant_tokens if cap is None else min(cap, self.cfg.grant_tokens)
        lease, reason = self.book.acquire(
            peer.peer_id,
            now,
            max_tokens=cap,
            budget_tokens=budget,
            min_tokens=self.cfg.min_grant_tokens,
            freed_only=req.freed_only,
        )
        if lease is None:
            return c.LeaseGrant(reason=reason)
        return c.LeaseGrant(lease=self._lease_info(lease))

    def _commit(self, peer: Peer, req: c.LeaseCommit, now: float) -> Message:
        before = self.book.data_epoch
        lease = self.book.leases.get(req.lease_id)
        offset = lease.committed if lease is not None else None
        self.check_commit_state(peer, req, now)
        stage, rnd = (-1 if x is None else x for x in (req.stage, req.round))
        lineage = (stage, rnd, req.digest)
        lease, done = self.book.commit(
            peer.peer_id, req.lease_id, req.epoch, req.start, req.end, now, lineage
        )
        if offset is not None and lease.committed > offset:
            self.metrics.committed.inc(lease.committed - offset)
            self.committed_total += lease.committed - offset
        if self.book.data_epoch != before:
            log.info("data epoch %d complete; starting %d", before, self.book.data_epoch)
        return c.LeaseReply(lease=self._lease_info(lease), shard_done=done)

    def _complete(self, peer: Peer, req: c.LeaseComplete, now: float) -> Message:
        lease, done = self.book.complete(peer.peer_id, req.lease_id, req.epoch, now)
        return c.LeaseReply(lease=self._lease_info(lease), shard_done=done)

    def _release(self, peer: Peer, req: c.LeaseRelease, now: float) -> Message:
        lease = self.book.release(peer.peer_id, req.lease_id, req.epoch, now)
        return c.LeaseReply(lease=self._lease_info(lease))

    def _shard(self, peer: Peer, req: c.ShardFetch, now: float) -> Message:
        info = self.shards.get(req.shard_id)
        if req.shard_id in self.heldout_ids:
            return _err("not_found", f"shard {req.shard_id} is held out: it is never served")
        if info is None:
            return _err("not_found", f"no shard {req.shard_id} in the manifest")
        data = shard_slice(self.corpus, info, self.manifest.token_bytes)
        return c.ShardData(shard_id=info.shard_id, sha256=info.sha256, data=data)

    def _tokenizer(self, peer: Peer, req: c.TokenizerFetch, now: float) -> Message:
        if not self.tokenizer_json:
            return _err("not_found", "the run uses the byte tokenizer: there is none to fetch")
        return c.TokenizerData(sha256=self.manifest.tokenizer_hash, data=self.tokenizer_json)

    # -- admin --------------------------------------------------------------------------

    # -- status -------------------------------------------------------------------------

    def sample_progress(self, now: float) -> None:
        self.progress.append((now, self.committed_total))

    def status(self, now: float) -> c.StatusReply:
        rates = self.membership.stage_rates()
        counts = self.membership.stage_counts()
        costs = self.membership.stage_costs
        stages = [
            c.StageStatus(
                stage=s,
                peers=counts[s],
                throughput=rates[s] * costs[s],
                cost=costs[s],
                attested=self.attested(s),
            )  # fmt: skip
            for s in range(self.cfg.n_stages)
        ]
        rate = 0.0
        if len(self.progress) >= 2:
            (t0, a), (t1, b) = self.progress[0], self.progress[-1]
            rate = (b - a) / (t1 - t0) if t1 > t0 else 0.0
        committed = self.book.committed_tokens()
        left = self.book.epoch_tokens - committed
        return c.StatusReply(
            run_id=self.cfg.run_id,
            membership_version=self.membership.version,
            paused=self.paused,
            peers=len(self.membership.live) - self.membership.observers,
            stages=stages,
            leases={"active": len(self.book.active)},
            shards=self.book.counts(),
            data_epoch=self.book.data_epoch,
            committed_tokens=committed,
            epoch_tokens=self.book.epoch_tokens,
            tokens_per_s=max(rate, 0.0),
            eta_s=left / rate if rate > 0 else None,
            uptime_s=max(0.0, now - self.started),
            relays=list(self.cfg.relays),
            observers=self.membership.observers,
        )
