"""The asyncio control-plane server: connections, group commit, sweeps, restart.

- The listener speaks TLS only (`coordinator.tls`: the certificate clients pin by
  fingerprint); a connection has `tls_handshake_s` to finish its handshake.
- The edge, before a signature is checked: at most `max_connections` connections, and
  `max_connections_per_host` from one source (`coordinator.edge.host_key`); the bytes
  of partial frames across all connections within `max_buffered_bytes`; a frame whole
  within `frame_deadline_s` of its first byte (`idle_timeout_s` between frames); each
  request through its source's token bucket (`rate_per_host`). Over any of them the
  request is refused or the connection closed (`agora_coordinator_edge_refusals_total`).
- Each connection reads frames, answers them in order through the service, then, unless
  every answer of the read is soft (`Answer.durable` false: a heartbeat that only renewed
  liveness), waits until every change made so far is durable (group commit), then writes
  the replies. Requests on one connection may be pipelined. The ed25519 checks of
  everything one read brought in run as one job on a small verify thread pool
  (`verify_threads`; the libsodium and OpenSSL calls release the GIL), so a many-core
  host checks signatures in parallel while the event loop applies the verified requests.
- A key proves itself on a connection with a request signed for this coordinator's
  certificate (`SignedRequest.bound`) whose signature verifies and whose nonce is fresh;
  later requests of that key on that connection skip the signature check (up to
  `session_keys` keys a connection; replay guard, rate limits and everything else still
  apply). TLS makes the connection an authenticated channel to whoever proved the key,
  and the bound signature names this certificate, so a party in the middle that relays
  a client's requests to us proves nothing: its own connection's requests stay checked.
- `GroupCommit` writes the journal in one SQLite transaction per cycle on a dedicated
  writer thread; everything changed while a write is in flight goes in the next one.
  A failed write stops the server (fail-stop: memory and disk must never disagree).
- The sweeper expires lapsed peers and leases, rebalances stages, refreshes gauges and
  the Prometheus file-SD, and kicks the group commit.
- `AuditMonitor` replays the durable audit events incrementally (seeded from the log
  at start) for the `agora_coordinator_audit_problem_ranges` gauge.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordinator.audit import AuditMonitor
from coordinator.config import CoordinatorConfig
from coordinator.edge import ByteBudget, HostConnections, host_key
from coordinator.journal import Batch, Journal
from coordinator.leases import LeaseBook, Shard, restore_book
from coordinator.membership import Membership, Peer
from coordinator.metrics import CoordinatorMetrics, write_file_sd
from coordinator.service import BadFrame, Service
from coordinator.store import Store, read_epoch_events
from coordinator.verify import signatures_ok
from protocol.control import ErrorReply, HeartbeatRequest
from protocol.corpus import Manifest
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.signing import SignedRequest

log = logging.getLogger(__name__)


class StoreFailed(RuntimeError):
    pass


class GroupCommit:
    def __init__(
        self,
        journal: Journal,
        store: Store,
        metrics: CoordinatorMetrics,
        on_durable: Callable[[Batch], None] | None = None,
    ) -> None:
        self.journal = journal
        self.store = store
        self.metrics = metrics
        self.on_durable = on_durable  # called on the event loop after each durable write
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sqlite")
        self._open: asyncio.Future[None] | None = None
        self._inflight: asyncio.Future[None] | None = None
        self._wake = asyncio.Event()
        self.failed: BaseException | None = None

    def kick(self) -> None:
        if self.journal:
            self._wake.set()

    async def durable(self) -> None:
        """Return once every change made so far is on disk."""
        if self.failed is not None:
            raise StoreFailed(str(self.failed))
        if self.journal:
            if self._open is None:
                self._open = asyncio.get_running_loop().create_future()
            self._wake.set()
            await asyncio.shield(self._open)
        elif self._inflight is not None:
            await asyncio.shield(self._inflight)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.journal:
                continue
            fut = self._open or loop.create_future()
            self._open = None
            self._inflight = fut
            batch = self.journal.take()
            t0 = time.perf_counter()
            try:
                await loop.run_in_executor(self._executor, self.store.write, batch)
            except BaseException as exc:
                self.failed = exc
                fut.set_exception(StoreFailed(f"durable write failed: {exc}"))
                fut.exception()  # mark retrieved
                raise
            self.metrics.group_commits.inc()
            self.metrics.group_commit_seconds.observe(time.perf_counter() - t0)
            fut.set_result(None)
            if self.on_durable is not None:
                self.on_durable(batch)
            if self._inflight is fut:
                self._inflight = None

    async def flush(self) -> None:
        """Write whatever is left (shutdown)."""
        if self.journal and self.failed is None:
            batch = self.journal.take()
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self.store.write, batch
            )
        self._executor.shutdown(wait=True)


def build_state(
    cfg: CoordinatorConfig, store: Store, manifest: Manifest, now: float
) -> tuple[Journal, Membership, LeaseBook, bool]:
    """Load state from the store, or initialise a fresh run from the manifest. Renewals
    were never stored, so every stored live peer and active lease gets one TTL from
    `now` (the grace period) before it can lapse."""
    grace_until = now + cfg.lease_ttl_s
    journal = Journal()
    snap = store.load()
    if snap.shards:
        stored = snap.meta.get("dataset_hash")
        if stored != manifest.content_hash:
            raise ValueError(
                f"database {cfg.db} belongs to dataset {stored}, but the configured dataset"
                f" hashes to {manifest.content_hash}; use another --db"
            )
        cut = {(s.shard_id, s.tokens) for s in manifest.train}
        if {(r[0], r[1]) for r in snap.shards} != cut:
            raise ValueError(
                f"database {cfg.db} cut the dataset into other shards than shard_tokens ="
                f" {cfg.shard_tokens} and heldout_every = {cfg.heldout_every} do; set the"
                " values the run began with, or use another --db"
            )
        book = restore_book(
            snap.shards,
            snap.leases,
            snap.meta,
            journal=journal,
            ttl_s=cfg.lease_ttl_s,
            grace_until=grace_until,
            order_seed=cfg.seed,
        )
    else:
        shards = [Shard(shard_id=s.shard_id, tokens=s.tokens) for s in manifest.train]
        book = LeaseBook(
            shards,
            journal=journal,
            ttl_s=cfg.lease_ttl_s,
            order_seed=cfg.seed,
        )
        for s in book.shards.values():
            journal.shards[s.shard_id] = s
        journal.meta.update(
            {"dataset_hash": manifest.content_hash, "run_id": cfg.run_id, "data_epoch": "0"}
        )
    if "train_shards" not in snap.meta:  # the manifest `agora audit` checks the table against
        shards_ = [[s.shard_id, s.tokens] for s in manifest.train]
        journal.meta["train_shards"] = json.dumps(shards_, separators=(",", ":"))
    membership = Membership(
        n_stages=cfg.n_stages,
        stage_costs=cfg.costs(),
        ttl_s=cfg.lease_ttl_s,
        journal=journal,
        version=int(snap.meta.get("membership_version", "0")),
        peers=[Peer.from_row(r) for r in snap.peers],
        mlog=snap.mlog,
        grace_until=grace_until,
        max_source_share=cfg.max_source_share,
    )
    for p in list(membership.live.values()):
        if p.stage >= cfg.n_stages:  # n_stages shrank between runs
            membership.move(p, membership.place())
    paused = snap.meta.get("paused") == "1"
    return journal, membership, book, paused


class CoordinatorServer:
    def __init__(
        self,
        cfg: CoordinatorConfig,
        *,
        store: Store,
        manifest: Manifest,
        corpus: bytes,
        metrics: CoordinatorMetrics | None = None,
        tokenizer_json: bytes = b"",  # the run's tokenizer.json (b"": the byte tokenizer)
        tls: ssl.SSLContext,  # the listener's server context (coordinator.tls.server_context)
        fingerprint: str,  # `sha256:<hex>` of its certificate: what bound requests name
        credit_key: NodeKey | None = None,  # signs members' credits; None: a fresh key
    ) -> None:
        self.cfg = cfg
        self.tls = tls
        self.fingerprint = fingerprint
        self.metrics = metrics or CoordinatorMetrics()
        journal, membership, book, paused = build_state(cfg, store, manifest, time.time())
        self.service = Service(
            cfg,
            manifest=manifest,
            corpus=corpus,
            tokenizer_json=tokenizer_json,
            journal=journal,
            membership=membership,
            book=book,
            metrics=self.metrics,
            paused=paused,
            credit_key=credit_key,
        )
        self.audit = AuditMonitor(
            {s.shard_id: s.tokens for s in book.shards.values()}, book.data_epoch
        )
        self.commits = GroupCommit(
            journal, store, self.metrics, on_durable=lambda b: self.audit.feed(b.audit)
        )
        self.store = store
        self.connections = 0
        self.host_connections = HostConnections(cfg.max_connections_per_host)
        self.buffered = ByteBudget(cfg.max_buffered_bytes)  # partial frames, all connections
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()
        self._sd_version = -1
        self._rpc_latency: dict[str, Any] = {}  # method -> its rpc_latency histogram
        self._verify_pool = (
            concurrent.futures.ThreadPoolExecutor(cfg.verify_threads, thread_name_prefix="verify")
            if cfg.verify_threads > 0
            else None
        )

    async def start(self) -> int:
        path = getattr(self.store, "path", None)
        if isinstance(path, Path) and path.exists():  # seed the live audit from the log
            events = await asyncio.to_thread(
                read_epoch_events, path, self.service.book.data_epoch - 1
            )
            self.audit.feed(events)
        self.service.expire(time.time())  # leases and peers that lapsed while we were down
        self._server = await asyncio.start_server(
            self._client,
            self.cfg.host,
            self.cfg.port,
            limit=1 << 16,  # bytes the stream reader holds ahead (frames are in `_Conn`)
            backlog=4096,
            ssl=self.tls,
            ssl_handshake_timeout=self.cfg.tls_handshake_s,
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        for coro in (self.commits.run(), self._sweeper()):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._task_done)
        await self.commits.durable()
        return self.port

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.critical("coordinator task failed, stopping: %r", task.exception())
            self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.commits.flush()
        finally:
            self.store.close()
            if self._verify_pool is not None:
                self._verify_pool.shutdown(wait=False, cancel_futures=True)

    # -- background ---------------------------------------------------------------------

    async def _sweeper(self) -> None:
        last_rebalance = time.monotonic()
        while True:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            now = time.time()
            svc = self.service
            svc.expire(now)
            if time.monotonic() - last_rebalance >= self.cfg.rebalance_interval_s:
                last_rebalance = time.monotonic()
                svc.rebalance(now)
            svc.sample_progress(now)
            svc.limiter.prune(now)
            svc.host_limiter.prune(now)
            self._refresh_gauges()
            if self.cfg.prometheus_sd and svc.membership.version != self._sd_version:
                self._sd_version = svc.membership.version
                self._write_sd()
            self.commits.kick()

    def _refresh_gauges(self) -> None:
        m, svc = self.metrics, self.service
        counts = svc.membership.stage_counts()
        rates = svc.membership.stage_rates()
        for s in range(self.cfg.n_stages):
            m.peers.labels(str(s)).set(counts[s])
            m.stage_throughput.labels(str(s)).set(rates[s] * svc.membership.stage_costs[s])
            attested = svc.attested(s)
            m.attested_round.labels(str(s)).set(attested.round if attested else -1)
        m.disagreeing_states.set(svc.attest.disagreeing)
        m.contradicted_commits.set(svc.attest.contradicted)
        if svc.witness is not None:
            m.witnessed.set(svc.witness.tokens_total)
        for state, n in svc.book.counts().items():
            m.leases.labels(state).set(n)
        m.active_leases.set(len(svc.book.active))
        m.data_epoch.set(svc.book.data_epoch)
        m.membership_version.set(svc.membership.version)
        m.connections.set(self.connections)
        lost, dup = self.audit.problems()
        m.audit_problems.labels("lost").set(lost)
        m.audit_problems.labels("duplicated").set(dup)

    def _write_sd(self) -> None:
        by_stage: dict[int, list[str]] = {}
        for p in self.service.membership.live.values():
            if p.metrics_port and p.metrics_host:
                host = f"[{p.metrics_host}]" if ":" in p.metrics_host else p.metrics_host
                by_stage.setdefault(p.stage, []).append(f"{host}:{p.metrics_port}")
        try:
            write_file_sd(Path(str(self.cfg.prometheus_sd)), self.cfg.run_id, by_stage)
        except OSError as exc:
            log.warning("cannot write Prometheus file-SD %s: %s", self.cfg.prometheus_sd, exc)

    # -- connections --------------------------------------------------------------------

    @staticmethod
    def _refuse(writer: asyncio.StreamWriter, detail: str) -> None:
        try:
            writer.write(frame_message(ErrorReply(code="too_busy", detail=detail)))
            writer.close()
        except (OSError, RuntimeError):
            pass

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        source = host_key(host)
        if self.connections >= self.cfg.max_connections:
            self.metrics.rejected_connections.inc()
            self._refuse(writer, "connection limit")
            return
        if not self.host_connections.enter(source):
            self.metrics.rejected_connections.inc()
            self.metrics.edge_refusals.labels("host_connections").inc()
            self._refuse(writer, "connection limit for this source address")
            return
        self.connections += 1
        conn = _Conn(FrameDecoder(max_frame=self.cfg.max_request_bytes))
        try:
            await self._serve(reader, writer, host, source, conn)
        except (OSError, asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except StoreFailed:
            pass
        finally:
            self.connections -= 1
            self.host_connections.leave(source)
            self.buffered.resize(conn.charged, 0)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader, conn: _Conn) -> bytes | None:
        """The next bytes, b"" at end of stream, or None once the frame in progress
        passed `frame_deadline_s`. Between frames a read waits up to `idle_timeout_s`
        (TimeoutError past it)."""
        if not conn.decoder.partial:
            return await asyncio.wait_for(reader.read(1 << 16), self.cfg.idle_timeout_s)
        left = conn.frame_started + self.cfg.frame_deadline_s - time.monotonic()
        try:
            return await asyncio.wait_for(reader.read(1 << 16), max(0.0, left))
        except TimeoutError:
            return None

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        host: str,
        source: str,
        conn: _Conn,
    ) -> None:
        decoder = conn.decoder
        svc, m = self.service, self.metrics
        while True:
            data = await self._read(reader, conn)
            if data is None:
                m.edge_refusals.labels("frame_deadline").inc()
                detail = f"frame not complete within frame_deadline_s={self.cfg.frame_deadline_s}"
                writer.write(frame_message(ErrorReply(code="bad_frame", detail=detail)))
                await asyncio.wait_for(writer.drain(), self.cfg.frame_deadline_s)
                return
            if not data:
                return
            tail: ErrorReply | None = None  # sent after the replies; then the connection closes
            was_partial = decoder.partial
            try:
                payloads = decoder.feed(data)
            except ProtocolError as exc:
                m.bad_frames.inc()
                payloads = []
                tail = ErrorReply(code="bad_frame", detail=str(exc)[:512])
            if decoder.partial and (payloads or not was_partial):
                conn.frame_started = time.monotonic()  # a frame began in this read
            if not self.buffered.resize(conn.charged, decoder.buffered):
                m.edge_refusals.labels("buffer_budget").inc()
                tail = ErrorReply(code="too_busy", detail="request buffer budget exhausted")
            else:
                conn.charged = decoder.buffered
            t0 = time.perf_counter()
            now = time.time()
            # each request passes the source's bucket before its signature is checked
            entries: list[SignedRequest | ErrorReply] = []
            for payload in payloads:
                try:
                    req = svc.open(payload)
                except BadFrame as exc:  # answer what came before it, then close
                    m.bad_frames.inc()
                    tail = ErrorReply(code="bad_frame", detail=str(exc)[:512])
                    break
                if svc.host_limiter.allow(source, now):
                    entries.append(req)
                else:
                    m.edge_refusals.labels("host_rate").inc()
                    entries.append(
                        ErrorReply(
                            code="rate_limited", detail="too many requests from this address"
                        )
                    )
            reqs = [e for e in entries if isinstance(e, SignedRequest)]
            proven = conn.proven
            trusted = [r.key in proven for r in reqs]
            check = [r for r, t in zip(reqs, trusted, strict=True) if not t]
            if len(check) < len(reqs):
                m.session_requests.inc(len(reqs) - len(check))
            if self._verify_pool is not None and check:
                oks = await asyncio.get_running_loop().run_in_executor(
                    self._verify_pool, signatures_ok, check, self.cfg.run_id, self.fingerprint
                )
            else:
                oks = signatures_ok(check, self.cfg.run_id, self.fingerprint)
            checked = iter(oks)
            verdicts = iter([True if t else next(checked) for t in trusted])
            replies: list[bytes] = []
            methods: list[str] = []
            durable = tail is not None
            for entry in entries:
                reply: Message
                if isinstance(entry, ErrorReply):
                    method, reply, durable = "unknown", entry, True
                else:
                    method, reply, must, fresh = svc.apply(entry, next(verdicts), host, time.time())
                    durable = durable or must
                    if fresh and entry.bound and len(proven) < self.cfg.session_keys:
                        proven.add(entry.key)
                if isinstance(reply, ErrorReply):
                    m.errors.labels(reply.code).inc()
                try:
                    replies.append(frame_message(reply, max_frame=self.cfg.max_frame_bytes))
                except ProtocolError as exc:
                    err = ErrorReply(code="internal", detail=f"reply too large: {exc}")
                    replies.append(frame_message(err))
                methods.append(method)
            if tail is not None:
                replies.append(frame_message(tail))
            if durable:
                await self.commits.durable()
            elif self.commits.failed is not None:
                raise StoreFailed(str(self.commits.failed))
            writer.write(b"".join(replies))
            # a peer that does not read its replies is not waited for forever
            await asyncio.wait_for(writer.drain(), self.cfg.idle_timeout_s)
            took = time.perf_counter() - t0
            for method in methods:
                if method == HeartbeatRequest.TYPE:
                    m.heartbeat_latency.observe(took)
                child = self._rpc_latency.get(method)
                if child is None:  # method names are the request types: a bounded set
                    child = self._rpc_latency[method] = m.rpc_latency.labels(method)
                child.observe(took)
            if tail is not None:
                return


class _Conn:
    """One connection's frame decoder and what it holds of the buffer budget."""

    __slots__ = ("charged", "decoder", "frame_started", "proven")

    def __init__(self, decoder: FrameDecoder) -> None:
        self.decoder = decoder
        self.proven: set[bytes] = set()  # keys that proved themselves on this connection
        self.charged = 0  # bytes of `CoordinatorServer.buffered` this connection holds
        self.frame_started = 0.0  # monotonic seconds: the first byte of the partial frame
