"""Trio client of the coordinator's control plane (see `protocol.control` for the calls).

One TLS connection (`node.control_tls`: the coordinator's certificate checked against
`pin` before a byte is sent; `PinMismatch` is raised at once, never retried; unpinned,
the first fingerprint seen is kept and a later different one refused, and no request
carrying a token is sent), one request in flight at a time, every request signed with the
node key for the coordinator's run: before its first other request the client asks the
status (signed for no run, the one request a coordinator takes so) and signs everything
after for `StatusReply.run_id`. Every call has a deadline. While the coordinator is away (connection refused
or cut, `too_busy`, `rate_limited`, `internal`) calls retry with jittered exponential
back-off until `retry_deadline_s`, then raise `CoordinatorUnavailable`. Refusals raise
`CoordinatorError` (`FencedError` for a fenced lease, `NotMemberError` when the
membership lapsed). A `replay` refusal is retried too: each attempt is signed
afresh, so it only means a clock behind the coordinator's or a request signed before
a coordinator restart. `heartbeat_loop` keeps the membership and all leases alive, re-joins
after a lapse and rides out outages; `wait_freed` wakes when a heartbeat reply says that
ranges of expired or released leases wait for a holder. Imports only `protocol`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from node.control_tls import open_trio_stream, require_pin_for_secrets
from protocol import control as c
from protocol.addrs import cap
from protocol.corpus import Manifest
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.pinning import CoordinatorAddress
from protocol.signing import sign_request

log = logging.getLogger(__name__)

RETRY_CODES = ("too_busy", "rate_limited", "internal", "replay")


class CoordinatorError(Exception):
    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"coordinator refused: {code}: {detail}")
        self.code, self.detail = code, detail


class FencedError(CoordinatorError):
    """The lease is fenced: a newer holder owns the shard. Drop its uncommitted work."""


class NotMemberError(CoordinatorError):
    """The membership lapsed (or was never made): join again."""


class JoinRefused(CoordinatorError):
    """The coordinator refused the join (auth, ban, no stage fits the device's memory):
    the node cannot take part in the run."""


class CoordinatorUnavailable(Exception):
    """The coordinator could not be reached before the call's deadline."""


def _error(reply: c.ErrorReply) -> CoordinatorError:
    kind = {"fenced": FencedError, "not_member": NotMemberError}.get(reply.code, CoordinatorError)
    return kind(reply.code, reply.detail)


@dataclasses.dataclass(kw_only=True, slots=True)
class ClientConfig:
    call_timeout_s: float = 10.0  # seconds for one attempt (connect + request + reply)
    retry_deadline_s: float = 300.0  # seconds a call keeps retrying while the coordinator is away
    backoff_initial_s: float = 0.1  # seconds before the first retry
    backoff_max_s: float = 5.0  # seconds, cap of the exponential back-off
    max_frame_bytes: int = 8 << 20  # bytes
    max_membership_pages: int = 1000  # pages one membership refresh may take
    witness_report_s: float = 15.0  # seconds between reports of work peers did with us


class MembershipView:
    """The node's copy of the membership view, kept current with deltas (one page at a
    time; `CoordinatorClient.membership` assembles the pages of a full view)."""

    def __init__(self) -> None:
        self.version = 0
        self.peers: dict[str, c.PeerInfo] = {}
        self.dht_root = ""  # the coordinator's DHT bootstrap assignment (a peer id)

    def apply(self, reply: c.MembershipReply) -> None:
        """Adopt one delta page, or a full view that came in one page."""
        if reply.full:
            if reply.more:
                raise ValueError("one page of a full view cannot be applied alone")
            self.peers = {}
        for p in reply.peers:
            self.peers[p.peer_id] = p
        for pid in reply.left:
            self.peers.pop(pid, None)
        self.version = reply.version
        self.dht_root = reply.dht_root

    def stage(self, stage: int) -> list[c.PeerInfo]:
        return [p for p in self.peers.values() if p.stage == stage]


class CoordinatorClient:
    def __init__(
        self,
        host: str,
        port: int,
        key: NodeKey,
        *,
        config: ClientConfig | None = None,
        pin: str | None = None,  # `sha256:<hex>` of the coordinator's certificate
    ) -> None:
        self.host, self.port, self.key = host, port, key
        self.cfg = config or ClientConfig()
        self.pin = pin  # the operator's pin: the channel is authenticated
        self.seen_fingerprint: str | None = None  # the certificate of the first connection
        self._stream: trio.SSLStream | None = None
        self._decoder = FrameDecoder(max_frame=self.cfg.max_frame_bytes)
        self._lock = trio.Lock()
        self.join_request: c.JoinRequest | None = None
        self.joined: c.JoinReply | None = None
        self.view = MembershipView()
        self.run_id: str | None = None  # the run requests are signed for (learned once)
        self._announce: list[str] | None = None  # DHT addresses for the next heartbeat
        self.freed = 0  # freed ranges waiting for a holder, as the last heartbeat reply said
        self._freed_seen = trio.Event()  # set by a reply that reported some
        self.state: c.StateRef | None = None  # the global state this replica holds
        self.attested: c.StateRef | None = None  # its stage's, as the last reply said
        self.credit = b""  # its signed credit (protocol.credit), as the last reply said
        self._report_now = trio.Event()  # set by a new state: heartbeat at once
        self._accused: list[c.Accusation] = []  # for the next heartbeat (at most MAX_ACCUSED)
        self._witnessed: dict[str, int] = {}  # peer -> tokens worked on, not yet reported
        self._witnessed_at = 0.0  # trio time of the last heartbeat that reported some

    @classmethod
    def to(
        cls, address: CoordinatorAddress, key: NodeKey, *, config: ClientConfig | None = None
    ) -> CoordinatorClient:
        """A client of the coordinator at `address` (pinned when it carries a pin)."""
        return cls(address.host, address.port, key, config=config, pin=address.pin)

    @property
    def peer_id(self) -> str:
        return self.key.peer_id

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            with trio.move_on_after(1):
                await stream.aclose()

    def _drop_stream(self) -> None:
        if self._stream is not None:
            transport = self._stream.transport_stream
            if isinstance(transport, trio.SocketStream):
                transport.socket.close()
            self._stream = None

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- transport ----------------------------------------------------------------------

    async def _once(self, body: Message) -> Message:
        if self._stream is None:
            pin = self.pin or self.seen_fingerprint
            self._stream, self.seen_fingerprint = await open_trio_stream(self.host, self.port, pin)
            self._decoder = FrameDecoder(max_frame=self.cfg.max_frame_bytes)
        if self.run_id is None and not isinstance(body, c.StatusRequest):
            status = await self._exchange(c.StatusRequest(), None)
            if not isinstance(status, c.StatusReply):
                return status  # an error reply: `call` retries or raises
            self.run_id = status.run_id
        return await self._exchange(
            body, None if isinstance(body, c.StatusRequest) else self.run_id
        )

    async def _exchange(self, body: Message, run: str | None) -> Message:
        assert self._stream is not None
        # bound to the certificate this stream verified: the key then needs no signature
        # check for the rest of the connection (`coordinator.server`)
        cert = None if run is None else self.seen_fingerprint
        req = sign_request(self.key, body, now=time.time(), run=run, cert=cert)
        await self._stream.send_all(frame_message(req, max_frame=self.cfg.max_frame_bytes))
        while True:
            data = await self._stream.receive_some(1 << 16)
            if not data:
                raise ConnectionResetError("coordinator closed the connection")
            msgs = self._decoder.feed_messages(data)
            if msgs:
                if len(msgs) > 1:
                    raise ProtocolError("coordinator sent more replies than requests")
                return msgs[0]

    async def call(self, body: Message, *, retry: bool = True) -> Message:
        """Send one request; return the reply or raise (see the module docstring)."""
        require_pin_for_secrets(body, self.pin is not None, f"{self.host}:{self.port}")
        give_up = trio.current_time() + (
            self.cfg.retry_deadline_s if retry else self.cfg.call_timeout_s
        )
        delay = self.cfg.backoff_initial_s
        attempt = 0
        while True:
            attempt += 1
            why: str
            try:
                async with self._lock:
                    with trio.fail_after(
                        min(self.cfg.call_timeout_s, max(0.01, give_up - trio.current_time()))
                    ):
                        try:
                            reply = await self._once(body)
                        except BaseException:
                            # A reply may still be on its way (timeout, cancellation):
                            # never let it be read as the answer to the next request.
                            self._drop_stream()
                            raise
                if not isinstance(reply, c.ErrorReply):
                    return reply
                if reply.code not in RETRY_CODES:
                    raise _error(reply)
                why = f"{reply.code}: {reply.detail}"
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                await self.aclose()
            except trio.TooSlowError:
                why = f"no reply within call_timeout_s={self.cfg.call_timeout_s}"
                await self.aclose()
            except ProtocolError as exc:
                why = f"bad reply: {exc}"
                await self.aclose()
            if not retry or trio.current_time() + delay >= give_up:
                raise CoordinatorUnavailable(
                    f"{body.TYPE} to {self.host}:{self.port} failed after {attempt} attempts"
                    f" (retry_deadline_s={self.cfg.retry_deadline_s}): {why}"
                )
            log.debug("%s failed (%s); retrying in %.2fs", body.TYPE, why, delay)
            await trio.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, self.cfg.backoff_max_s)

    async def _typed(self, body: Message, kind: type[Message], *, retry: bool = True) -> Message:
        reply = await self.call(body, retry=retry)
        if not isinstance(reply, kind):
            raise CoordinatorError("bad_reply", f"expected {kind.TYPE}, got {reply.TYPE}")
        return reply

    # -- membership ---------------------------------------------------------------------

    async def join(self, request: c.JoinRequest | None = None) -> c.JoinReply:
        """Join (or re-join with the last request). The reply holds the run and stage."""
        request = request or self.join_request or c.JoinRequest()
        # announce at most MAX_ADDRS addresses of at most MAX_CHARS characters
        request = dataclasses.replace(
            request, addrs=cap(list(request.addrs)), dht_addrs=cap(list(request.dht_addrs))
        )
        reply = await self._typed(request, c.JoinReply)
        assert isinstance(reply, c.JoinReply)
        self.join_request, self.joined = request, reply
        return reply

    async def heartbeat(
        self, leases: list[c.LeaseRef] | None = None, throughput: float | None = None
    ) -> c.HeartbeatReply:
        announce, accused = self._announce, list(self._accused)
        witnessed = self._witnessed_due()
        try:
            reply = await self._typed(
                c.HeartbeatRequest(
                    leases=leases or [],
                    throughput=throughput,
                    dht_addrs=announce,
                    state=self.state,
                    accused=accused,
                    witnessed=witnessed,
                ),  # fmt: skip
                c.HeartbeatReply,
            )
        except BaseException:
            for w in witnessed:  # not reported: the next heartbeat carries it
                self.witness(w.peer, w.tokens)
            raise
        assert isinstance(reply, c.HeartbeatReply)
        del self._accused[: len(accused)]  # those added meanwhile go in the next one
        self.attested = reply.attested
        self.credit = reply.credit
        if announce is self._announce:
            self._announce = None
        self.freed = reply.freed
        if reply.freed:
            self._freed_seen.set()
        return reply

    async def wait_freed(self) -> int:
        """Until a heartbeat reply reports freed ranges (one waiter); how many it said."""
        await self._freed_seen.wait()
        self._freed_seen = trio.Event()
        return self.freed

    def report_state(self, round_: int, digest: str) -> None:
        """Report the global state this replica holds now, in a heartbeat sent at once
        and in every later one (the coordinator attests its stage's state from them)."""
        state = c.StateRef(round=round_, digest=digest)
        if state != self.state:
            self.state = state
            self._report_now.set()

    def accuse(self, peer_id: str, round_: int, reason: str) -> None:
        """Report a groupmate this replica caught in its outer round `round_`, in a
        heartbeat sent at once (coordinator.accuse decides). Past `MAX_ACCUSED` waiting,
        or for an id no peer has, nothing is added."""
        if not 0 < len(peer_id) <= c.PEER_ID_LEN or len(self._accused) >= c.MAX_ACCUSED:
            return
        a = c.Accusation(peer=peer_id, round=max(0, round_), reason=reason[: c.MAX_ACCUSATION_TEXT])
        if all((x.peer, x.round) != (a.peer, a.round) for x in self._accused):
            self._accused.append(a)
            self._report_now.set()

    def witness(self, peer_id: str, tokens: int) -> None:
        """Count `tokens` of micro-batches `peer_id` (an adjacent member) worked on with
        this node, for the next report (coordinator/witness.py)."""
        if 0 < len(peer_id) <= c.PEER_ID_LEN and tokens > 0:
            self._witnessed[peer_id] = min(
                self._witnessed.get(peer_id, 0) + tokens, c.MAX_WITNESSED_TOKENS
            )

    def _witnessed_due(self) -> list[c.Witnessed]:
        """What to report in this heartbeat: nothing until `witness_report_s` passed
        since the last report (a heartbeat without it is byte-identical to the last one,
        which the coordinator decodes once), then the `MAX_WITNESSED` largest counts."""
        now = trio.current_time()
        if not self._witnessed or now - self._witnessed_at < self.cfg.witness_report_s:
            return []
        self._witnessed_at = now
        top = sorted(self._witnessed.items(), key=lambda kv: -kv[1])[: c.MAX_WITNESSED]
        for peer, _ in top:
            del self._witnessed[peer]
        return [c.Witnessed(peer=peer, tokens=tokens) for peer, tokens in top]

    def announce_dht(self, addrs: list[str]) -> None:
        """Publish new DHT addresses with the next heartbeat (and in any re-join)."""
        addrs = cap(list(addrs))
        self._announce = addrs
        if self.join_request is not None:
            self.join_request = dataclasses.replace(self.join_request, dht_addrs=list(addrs))

    async def heartbeat_loop(
        self,
        leases: Callable[[], list[c.LeaseRef]],
        on_reply: Callable[[c.HeartbeatReply], Awaitable[None]] | None = None,
        on_rejoin: Callable[[c.JoinReply], Awaitable[None]] | None = None,
        *,
        throughput: Callable[[], float | None] | None = None,  # tokens/s to report
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Heartbeat every `heartbeat_interval_s` until cancelled. Re-joins after a lapse
        (`on_rejoin`); keeps trying through outages. Raises `JoinRefused` once the
        coordinator refuses this node for good (a ban, or a re-join it refuses)."""
        if self.joined is None:
            raise RuntimeError("join before starting the heartbeat loop")
        task_status.started()
        while True:
            interval = self.joined.run.heartbeat_interval_s
            try:
                reply = await self.heartbeat(leases(), throughput and throughput())
                if on_reply is not None:
                    await on_reply(reply)
            except NotMemberError:
                log.warning("membership lapsed; re-joining")
                joined = await self._rejoin()
                if joined is not None and on_rejoin is not None:
                    await on_rejoin(joined)
            except CoordinatorUnavailable as exc:
                log.warning("coordinator unavailable: %s", exc)
            except CoordinatorError as exc:
                if exc.code == "banned":  # nothing this node can do will change that
                    raise JoinRefused(exc.code, exc.detail) from None
                raise
            with trio.move_on_after(interval):  # or sooner, to report a new state
                await self._report_now.wait()
            self._report_now = trio.Event()

    async def _rejoin(self) -> c.JoinReply | None:
        """Join again after a lapse; None when the coordinator is busy or unreachable (the
        next heartbeat tries again). A refusal (a ban, closed auth) raises `JoinRefused`."""
        try:
            return await self.join()
        except CoordinatorUnavailable as exc:
            log.warning("coordinator unavailable for the re-join: %s", exc)
        except CoordinatorError as exc:
            if exc.code not in RETRY_CODES:
                raise JoinRefused(exc.code, exc.detail) from None
            log.warning("re-join deferred: %s", exc)
        return None

    async def _membership_page(
        self, since: int, stage: int | None, after: str = ""
    ) -> c.MembershipReply:
        body = c.MembershipRequest(since=since, stage=stage, after=after)
        reply = await self._typed(body, c.MembershipReply)
        assert isinstance(reply, c.MembershipReply)
        return reply

    async def membership(self, stage: int | None = None) -> MembershipView:
        """Bring `self.view` up to date, page by page (see `MembershipRequest`): delta
        pages from its version; or the pages of a full view, adopted whole once the last
        arrived, then the changes made while they were read. At most
        `max_membership_pages` pages, else `CoordinatorError("bad_reply")`."""
        view, pages = self.view, 0

        async def page(since: int, after: str = "") -> c.MembershipReply:
            nonlocal pages
            pages += 1
            if pages > self.cfg.max_membership_pages:
                raise CoordinatorError(
                    "bad_reply", f"membership took over {self.cfg.max_membership_pages} pages"
                )
            return await self._membership_page(since, stage, after)

        reply = await page(view.version)
        while True:
            if reply.full:
                base, fresh = reply.version, {p.peer_id: p for p in reply.peers}
                while reply.more:
                    if not reply.cursor:
                        raise CoordinatorError("bad_reply", "a full-view page without a cursor")
                    reply = await page(0, reply.cursor)
                    if not reply.full:
                        raise CoordinatorError("bad_reply", "a delta inside a full view")
                    fresh.update((p.peer_id, p) for p in reply.peers)
                view.peers, view.version, view.dht_root = fresh, base, reply.dht_root
                if reply.version == base:
                    return view  # nothing changed while the pages were read
            else:
                view.apply(reply)
                if not reply.more:
                    return view
            reply = await page(view.version)

    async def leave(self) -> None:
        await self._typed(c.LeaveRequest(), c.OkReply, retry=False)

    async def status(self) -> c.StatusReply:
        reply = await self._typed(c.StatusRequest(), c.StatusReply)
        assert isinstance(reply, c.StatusReply)
        return reply

    # -- data ---------------------------------------------------------------------------

    async def manifest(self) -> Manifest:
        reply = await self._typed(c.ManifestRequest(), Manifest)
        assert isinstance(reply, Manifest)
        return reply

    async def fetch_shard(self, shard_id: int) -> bytes:
        """The shard's bytes, checked against the sha256 the coordinator sent."""
        reply = await self._typed(c.ShardFetch(shard_id=shard_id), c.ShardData)
        assert isinstance(reply, c.ShardData)
        if hashlib.sha256(reply.data).hexdigest() != reply.sha256:
            raise ProtocolError(f"shard {shard_id} failed its sha256 check")
        return reply.data

    async def fetch_tokenizer(self, expect_sha256: str) -> bytes:
        """The run's tokenizer.json, checked against `expect_sha256` (RunInfo.tokenizer_hash)."""
        reply = await self._typed(c.TokenizerFetch(), c.TokenizerData)
        assert isinstance(reply, c.TokenizerData)
        got = hashlib.sha256(reply.data).hexdigest()
        if got != expect_sha256 or reply.sha256 != expect_sha256:
            raise ProtocolError(
                f"the tokenizer the coordinator sent hashes to {got}, the run's is {expect_sha256}"
            )
        return reply.data

    async def acquire(self, max_tokens: int | None = None) -> c.LeaseInfo | None:
        """A new lease, or None (see `LeaseGrant.reason` via `acquire_grant`)."""
        return (await self.acquire_grant(max_tokens)).lease

    async def acquire_grant(
        self, max_tokens: int | None = None, *, freed_only: bool = False
    ) -> c.LeaseGrant:
        """A lease or the reason for none; `freed_only`: only a range an expired or
        released lease left (`reason="no_freed"` when there is none)."""
        body = c.LeaseAcquire(max_tokens=max_tokens, freed_only=freed_only)
        reply = await self._typed(body, c.LeaseGrant)
        assert isinstance(reply, c.LeaseGrant)
        return reply

    async def commit(
        self,
        lease: c.LeaseInfo,
        start: int,
        end: int,
        *,
        stage: int | None = None,
        round_: int | None = None,
        digest: str = "",
    ) -> c.LeaseReply:
        """Commit `[start, end)` of the lease's shard (start = committed offset), with the
        lineage it rode in when known (stage, outer round, state digest). Raises
        `FencedError` if the lease was fenced."""
        body = c.LeaseCommit(
            lease_id=lease.lease_id, epoch=lease.epoch, start=start, end=end,
            stage=stage, round=round_, digest=digest,
        )  # fmt: skip
        reply = await self._typed(body, c.LeaseReply)
        assert isinstance(reply, c.LeaseReply)
        return reply

    async def complete(self, lease: c.LeaseInfo) -> c.LeaseReply:
        reply = await self._typed(
            c.LeaseComplete(lease_id=lease.lease_id, epoch=lease.epoch), c.LeaseReply
        )
        assert isinstance(reply, c.LeaseReply)
        return reply

    async def release(self, lease: c.LeaseInfo) -> c.LeaseReply:
        reply = await self._typed(
            c.LeaseRelease(lease_id=lease.lease_id, epoch=lease.epoch), c.LeaseReply
        )
        assert isinstance(reply, c.LeaseReply)
        return reply


def lease_ref(lease: c.LeaseInfo) -> c.LeaseRef:
    return c.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch)
