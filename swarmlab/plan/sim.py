"""A simulated Agora swarm on `engine` time, run by the real rules where they are pure:

- placement and liveness: the coordinator's `Membership` (weakest stage first, TTL
  expiry by sweeps every `sweep_s`); peers refresh their view every heartbeat;
- routing: each peer's own `node.routing.Router` (lowest expected finish time, bans,
  down marks revived by the membership), fed with simulated round trips;
- data: the coordinator's `LeaseBook` (grants of `grant_tokens`, renewals by heartbeat,
  expiry, fencing); stage 0 keeps `lease_pool` leases open (at most `MAX_LEASES` active,
  then it asks for an early round) and commits a lease's trained prefix when the outer
  round that covers it is applied (at once without an outer loop);
- the pipeline as the node runs it: stage 0 keeps `in_flight` micro-batches in the
  pipeline; each stage's forward, then the last stage's loss and backward, then each
  backward on the way back, on the node's one torch worker in the `WorkerGate`'s order;
  an inner step every `inner_batch_tokens`; a failed request is retried at once through
  another replica;
- outer rounds: every `outer_every_steps` inner steps (or after a quarter of them, to join
  a replica already forming a group), begun at the node's next outer tick with a
  snapshot that steps what the worker trained meanwhile (the next round's first step, as
  in the node), a group of the stage's replicas gathers for `outer_matchmaking_s`
  (closing early once it holds every replica the stage lists, or `outer_group_size`),
  exchanges a reduce-scatter and all-gather of the compressed
  stage (2 (g-1)/g of it each way per member) and merges the result on the worker; a
  replica alone on its stage steps at once, one whose listed groupmates do not come
  when the node's averaging times out. Training goes on meanwhile;
- churn: sessions end by a clean leave, a SIGKILL (callers see a reset `kill_detect_s`
  plus one RTT later) or a vanished host (callers wait for the request timeout); each leaver is replaced by a
  new peer of its group after `startup_s` plus the download of the stage's state.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

from coordinator.journal import Journal
from coordinator.leases import LeaseBook, LeaseError, Shard
from coordinator.membership import Membership, Peer
from node.routing import Router
from protocol.corpus import DEFAULT_SHARD_TOKENS
from swarmlab.plan.engine import (
    BACKWARD,
    FRESH,
    RETRIED,
    URGENT,
    Engine,
    Host,
    Link,
    Worker,
    one_way_s,
    transfer,
)
from swarmlab.plan.entities import Group, LeaseState, MicroBatch, Req, SimPeer
from swarmlab.plan.fleet import Fleet, PeerGroup
from swarmlab.plan.profile import Profile

MAX_LEASES = 64  # active leases one peer may hold (coordinator default)
SHARD_TOKENS = DEFAULT_SHARD_TOKENS  # tokens per shard (coordinator default)
RETRY_WAIT_S = 0.5  # back-off when no replica of the next stage is usable (s)
PEEK_S = 1.0  # how often a replica looks for a group forming (s)
TICK_S = 0.2  # the node's outer-loop tick (node.outer_loop.POLL_S): a due round begins then (s)
MBIT = 1e6


class SwarmSim:
    def __init__(
        self, fleet: Fleet, profiles: dict[str, Profile], n_stages: int, *, seed: int = 0
    ) -> None:
        self.fleet, self.profiles, self.n_stages = fleet, profiles, n_stages
        self.node, self.t = fleet.node, fleet.timings
        self.rng = random.Random(seed)
        self.eng = Engine()
        self.hosts: dict[str, Host] = {}
        cost = [1.0] * n_stages
        self.members = Membership(
            n_stages=n_stages, stage_costs=cost, ttl_s=self.t.lease_ttl_s, journal=Journal()
        )
        # 2**30 tokens: a planned run's corpus, never short of shards for the pools
        shards = [Shard(shard_id=i, tokens=SHARD_TOKENS) for i in range((1 << 30) // SHARD_TOKENS)]
        self.book = LeaseBook(shards, journal=Journal(), ttl_s=self.t.lease_ttl_s)
        self.peers: dict[str, SimPeer] = {}
        self.view: dict[int, list[str]] = {s: [] for s in range(n_stages)}
        self.forming: dict[int, Group] = {}
        self.mb_tokens = self.node.micro_batch * self.node.seq_len
        self._ids = 0
        self.kill_times: list[float] = []
        self.reroutes: list[float] = []
        self.stage0_trained = 0
        self.joins = self.departures = 0

    # --- peers ---------------------------------------------------------------------------

    @staticmethod
    def _shared(g: PeerGroup) -> bool:
        """Peers of the group share a CPU host (else each has its own device)."""
        return g.device == "cpu" and bool(g.host)

    def _host(self, g: PeerGroup) -> Host:
        if not self._shared(g):
            return Host(self.eng, 1.0)  # a dedicated device
        if g.host not in self.hosts:
            self.hosts[g.host] = Host(self.eng, float(self.t.host_cores), self.t.cpu_contention)
        return self.hosts[g.host]

    def add_peer(self, g: PeerGroup, stage: int | None = None) -> SimPeer:
        self._ids += 1
        pid = f"p{self._ids:05d}"
        rtt = self.rng.uniform(*g.rtt_ms) / 1e3
        up, down = g.up_mbit * MBIT, g.down_mbit * MBIT
        if self.rng.random() < g.relayed:
            rtt += self.t.relay_rtt_ms / 1e3
            up, down = min(up, self.t.relay_mbit * MBIT), min(down, self.t.relay_mbit * MBIT)
        prof = self.profiles[g.device]
        if stage is None:
            stage = self.members.place()
        c = prof.stages[stage]
        tput = self.mb_tokens / max(c.fwd_s + c.bwd_s, 1e-9)
        peer = SimPeer(
            pid=pid,
            stage=stage,
            group=g,
            profile=prof,
            worker=Worker(self._host(g)),
            link=Link(up_bps=up, down_bps=down, rtt_s=rtt, loss=g.loss),
            router=Router(rng=random.Random(self.rng.random())),
        )
        self.peers[pid] = peer
        if self._shared(g):  # the node's other processes take their share
            peer.worker.host.add_background(self.t.node_bg_threads)
        self.members.join(
            Peer(
                peer_id=pid, public_key=b"", stage=stage, addrs=(), dht_addrs=(), device=g.device,
                throughput=tput, deadline=None, metrics_host=None, metrics_port=None,
                fixed_stage=False, joined_at=self.eng.now,
                expires_at=self.eng.now + self.t.lease_ttl_s,
            )
        )  # fmt: skip
        self.joins += 1
        if stage not in self.view or pid not in self.view[stage]:
            self.view[stage] = [*self.view[stage], pid]
        churn = self.fleet.churn
        if churn.mean_session_min > 0:
            self.eng.after(
                self.rng.expovariate(1 / (churn.mean_session_min * 60)), lambda: self._depart(peer)
            )
        if stage == 0:
            for _ in range(self.node.in_flight):
                self._start_mb(peer)
        return peer

    def _depart(self, peer: SimPeer, kind: str | None = None) -> None:
        """`peer` leaves (`kind`: leave, kill, vanish; None draws one by the churn shares);
        a drawn departure is replaced by a new peer of the same group."""
        if not peer.alive:
            return
        churn = self.fleet.churn
        scripted = kind is not None
        if kind is None:
            x = self.rng.random()
            kind = (
                "kill"
                if x < churn.kill_share
                else "vanish"
                if x < churn.kill_share + churn.vanish_share
                else "leave"
            )
        self.departures += 1
        peer.alive = False
        peer.worker.stop()
        if self._shared(peer.group):
            peer.worker.host.add_background(-self.t.node_bg_threads)
        now = self.eng.now
        if kind == "leave":
            self.members.remove(peer.pid, "left")
            self.book.release_holder(peer.pid, now, expired=False)
            self.view[peer.stage] = [p for p in self.view[peer.stage] if p != peer.pid]
        for req in list(peer.serving):
            if kind == "vanish":
                wait = max(0.0, req.sent_at + self.t.request_timeout_s - now)
            else:
                wait = self.t.kill_detect_s + 2 * one_way_s(req.caller.link, peer.link)
            self.eng.after(wait, partial(self._failed, req, kind != "vanish"))
        if scripted:
            return
        g = peer.group
        c = self.profiles[g.device].stages[peer.stage]
        state_bytes = 8 * c.params  # theta_g and m in fp32, from a replica
        delay = churn.startup_s + state_bytes * 8 / (g.down_mbit * MBIT)
        self.eng.after(delay, lambda: self.add_peer(g))

    def kill_one(self, stage: int) -> None:
        """A scripted SIGKILL of the stage's newest live replica."""
        live = [p for p in self.peers.values() if p.alive and p.stage == stage]
        if live:
            self.kill_times.append(self.eng.now)
            self._depart(live[-1], "kill")

    # --- coordinator ticks ---------------------------------------------------------------

    def _heartbeat(self) -> None:
        now = self.eng.now
        for p in self.peers.values():
            if p.alive:
                self.members.renew(p.pid, now, None)
                self.book.renew(p.pid, now)
        view: dict[int, list[str]] = {s: [] for s in range(self.n_stages)}
        for pid, m in self.members.live.items():
            view[m.stage].append(pid)
        self.view = view
        failed_before = now - (self.t.lease_ttl_s + self.t.sweep_s + self.t.heartbeat_s)
        for p in self.peers.values():
            if p.alive and p.stage + 1 < self.n_stages:
                p.router.listed(view[p.stage + 1], failed_before)
        self.peers = {k: p for k, p in self.peers.items() if p.alive}
        self.eng.after(self.t.heartbeat_s, self._heartbeat)

    def _sweep(self) -> None:
        now = self.eng.now
        self.members.expire_due(now)
        self.book.expire_due(now)
        self.members.journal.take()
        self.book.journal.take()
        self.eng.after(self.t.sweep_s, self._sweep)

    # --- stage 0: leases and micro-batches -----------------------------------------------

    def _lease_with_room(self, p: SimPeer) -> LeaseState | None:
        open_ = [ls for ls in p.leases.values() if ls.next < ls.limit]
        if not open_ and len(p.leases) >= MAX_LEASES and not p.in_round:
            # out of leases while trained work waits for a round: the node asks for one
            # at its next tick (node.stage0_driver, request_early_round)
            self._begin_at_tick(p)
        # A micro-batch is cut from one simulated lease, where the node draws its windows
        # across the leases it holds (node.lease_pool): a grant of at least a micro-batch
        # stands in for that, or a micro-batch larger than a grant would carry a fraction
        # of its tokens at the full cost.
        grant = max(self.t.grant_tokens, self.mb_tokens)
        while len(open_) < self.node.lease_pool and len(p.leases) < MAX_LEASES:
            lease, _ = self.book.acquire(p.pid, self.eng.now, max_tokens=grant)
            if lease is None:
                break
            ls = LeaseState(
                lease_id=lease.lease_id, epoch=lease.epoch,
                limit=lease.limit, next=lease.committed, prefix=lease.committed,
                mark=lease.committed, committed=lease.committed,
            )  # fmt: skip
            p.leases[ls.lease_id] = ls
            open_.append(ls)
        return self.rng.choice(open_) if open_ else None

    def _start_mb(self, p: SimPeer) -> None:
        if not p.alive:
            return
        ls = self._lease_with_room(p)
        if ls is None:
            self.eng.after(2.0, lambda: self._start_mb(p))
            return
        end = min(ls.limit, ls.next + self.mb_tokens)
        mb = MicroBatch(origin=p, lease=ls, span=(ls.next, end))
        ls.next = end
        c = p.profile.stages[0]
        p.worker.submit(c.fwd_s, lambda: self._forwarded(p, mb, None))

    def _mb_done(self, p: SimPeer, mb: MicroBatch) -> None:
        n = mb.span[1] - mb.span[0]
        self.stage0_trained += n
        ls = mb.lease
        ls.done.add(mb.span)
        while True:
            nxt = next((r for r in ls.done if r[0] == ls.prefix), None)
            if nxt is None:
                break
            ls.done.discard(nxt)
            ls.prefix = nxt[1]
        if self.node.outer_every_steps == 0:
            ls.mark = ls.prefix
            self._commit(p)
        self._start_mb(p)

    def _commit(self, p: SimPeer) -> None:
        for ls in list(p.leases.values()):
            if ls.mark > ls.committed:
                try:
                    self.book.commit(
                        p.pid, ls.lease_id, ls.epoch, ls.committed, ls.mark, self.eng.now
                    )
                    ls.committed = ls.mark
                except LeaseError:
                    del p.leases[ls.lease_id]
                    continue
            if ls.committed >= ls.limit:
                del p.leases[ls.lease_id]

    # --- the pipeline --------------------------------------------------------------------

    def _forwarded(self, p: SimPeer, mb: MicroBatch, req: Req | None) -> None:
        """`p` finished its forward of `mb` (the last stage: and its backward)."""
        if p.stage == self.n_stages - 1:
            self._trained_tokens(p)
            self._reply(req)
        else:  # a retried micro-batch stays retried downstream (Forward.retry)
            self._send(p, mb, req, retry=req is not None and req.retry)

    def _send(
        self,
        p: SimPeer,
        mb: MicroBatch,
        parent: Req | None,
        exclude: frozenset[str] = frozenset(),
        retry: bool = False,
    ) -> None:
        if not p.alive:
            return
        now = self.eng.now
        cands = [x for x in self.view.get(p.stage + 1, []) if x in self.peers]
        q_id = p.router.choose(cands, now, exclude)
        if q_id is None:
            self.eng.after(RETRY_WAIT_S, lambda: self._send(p, mb, parent, retry=retry))
            return
        q = self.peers[q_id]
        p.router.started(q_id)
        req = Req(caller=p, callee=q, mb=mb, parent=parent, sent_at=now, retry=retry)
        nbytes = p.profile.stages[p.stage].fwd_bytes
        transfer(self.eng, p.link, q.link, nbytes, lambda: self._arrive(req, nbytes))

    def _arrive(self, req: Req, nbytes: float) -> None:
        q = req.callee
        if req.closed:
            return
        if not q.alive:  # it died before the request arrived: the dial or stream fails
            self.eng.after(2 * one_way_s(req.caller.link, q.link), lambda: self._failed(req, True))
            return
        q.serving[req] = None
        c = q.profile.stages[q.stage]
        q.worker.submit(
            c.fwd_s + self._msg_cpu(nbytes),
            lambda: self._forwarded(q, req.mb, req),
            RETRIED if req.retry else FRESH,
        )

    def _msg_cpu(self, nbytes: float) -> float:
        """The receiver's CPU for one pipeline message of `nbytes` (both ends' per-byte
        work, charged to the receiver)."""
        return self.t.msg_cpu_s + self.t.msg_cpu_s_per_mb * nbytes / 1e6

    def _reply(self, req: Req | None) -> None:
        """`req.callee` is done with the micro-batch: the gradient goes back to the caller."""
        if req is None or req.closed or not req.callee.alive:
            return
        q, p = req.callee, req.caller
        nbytes = q.profile.stages[q.stage].bwd_bytes
        transfer(self.eng, q.link, p.link, nbytes, lambda: self._replied(req, nbytes))

    def _replied(self, req: Req, nbytes: float) -> None:
        if req.closed:
            return
        req.closed = True
        p, q = req.caller, req.callee
        q.serving.pop(req, None)
        if not p.alive:
            return
        p.router.succeeded(q.pid, self.eng.now - req.sent_at, self.eng.now)
        c = p.profile.stages[p.stage]

        def backward_done() -> None:
            self._trained_tokens(p)
            if p.stage == 0:
                if req.retry and self.kill_times:  # the node's forward_rerouted event
                    self.reroutes.append(self.eng.now - self.kill_times[-1])
                self._mb_done(p, req.mb)
            else:
                self._reply(req.parent)

        p.worker.submit(
            c.bwd_s + self._msg_cpu(nbytes),
            backward_done,
            RETRIED if req.retry else BACKWARD,
        )

    def _failed(self, req: Req, unreachable: bool) -> None:
        if req.closed:
            return
        req.closed = True
        req.callee.serving.pop(req, None)
        p = req.caller
        if not p.alive:
            return
        p.router.failed(req.callee.pid, self.eng.now, unreachable=unreachable)
        self._send(p, req.mb, req.parent, frozenset({req.callee.pid}), retry=True)

    # --- inner steps and outer rounds ----------------------------------------------------

    def _trained_tokens(self, p: SimPeer) -> None:
        p.pending_tokens += self.mb_tokens
        if p.pending_tokens < self.node.inner_batch_tokens:
            return
        p.pending_tokens = 0
        p.worker.submit(p.profile.stages[p.stage].step_s, lambda: None, URGENT)
        p.steps += 1
        h = self.node.outer_every_steps
        if h and p.steps >= h:
            self._begin_at_tick(p)

    def _begin_at_tick(self, p: SimPeer) -> None:
        """A due round begins at the node's next outer tick, not with the inner step that
        made it due: by then the worker has taken up its next job, so the snapshot below
        waits for it (node.outer_rounds, `_tick`)."""
        if p.in_round or p.begin_due:
            return
        p.begin_due = True
        self.eng.after(self.rng.uniform(0.0, TICK_S), partial(self._begin_round, p))

    def _begin_round(self, p: SimPeer) -> None:
        """The snapshot: an inner step over the gradients accumulated so far, queued behind
        the worker's running job; as in node.outer_rounds, it counts towards the next
        round's steps when it steps anything (usually the micro-batch that job trained,
        so a round every `outer_every_steps` comes after that many steps less one, plus a
        micro-batch)."""
        p.begin_due = False
        if not p.alive or p.in_round:
            return
        p.in_round = True
        c = p.profile.stages[p.stage]

        def snapshot() -> None:
            p.steps = 1 if p.pending_tokens else 0
            p.pending_tokens = 0
            if p.stage == 0:
                for ls in p.leases.values():
                    ls.mark = ls.prefix
            self._look_for_group(p)

        p.worker.submit(c.step_s, snapshot, URGENT)

    def _look_for_group(self, p: SimPeer) -> None:
        if not p.alive:
            return
        now = self.eng.now
        others = [x for x in self.view.get(p.stage, []) if x != p.pid and x in self.peers]
        if not others:  # the node steps alone at once when no other replica is listed
            self.eng.after(0.0, lambda: self._apply_round(p))
            return
        g = self.forming.get(p.stage)
        if g is None or g.closed:
            g = Group(stage=p.stage, members=[], closes_at=now + self.node.outer_matchmaking_s)
            self.forming[p.stage] = g
            self.eng.at(g.closes_at, lambda: self._close(g))
            for oid in others:  # they notice within a peek and join early
                o = self.peers[oid]
                self.eng.after(self.rng.uniform(0, PEEK_S), partial(self._peek, o, g))
        g.members.append(p)
        # full, and closed at once, when it holds every replica the stage lists (as the
        # node's averager: node.outer.averager, `_prepare`)
        if len(g.members) >= min(self.node.outer_group_size, len(others) + 1):
            self._close(g)

    def _lone_s(self) -> float:
        """How long a replica that gathers no group waits before it steps alone: the
        node's averaging timeout (node.outer.process)."""
        return 2 * self.node.outer_matchmaking_s + 1.0

    def _peek(self, o: SimPeer, g: Group) -> None:
        """`o` looks, once a peek, whether it may join the group forming on its stage."""
        if not o.alive or o.in_round or g.closed:
            return
        if o.steps >= max(1, self.node.outer_every_steps // 4):
            self._begin_round(o)
        else:
            self.eng.after(PEEK_S, partial(self._peek, o, g))

    def _close(self, g: Group) -> None:
        if g.closed:
            return
        g.closed = True
        members = [m for m in g.members if m.alive]
        n = len(members)
        if n <= 1:  # gathered at closes_at; the averaging times out later
            for m in members:
                self.eng.after(
                    self._lone_s() - self.node.outer_matchmaking_s, partial(self._apply_round, m)
                )
            return
        params = members[0].profile.stages[g.stage].params
        each_way = int(2 * params * self.node.outer_bytes_per_param * (n - 1) / n)
        rate = min(min(m.link.up_bps, m.link.down_bps) for m in members)
        lat = max(m.link.rtt_s for m in members)
        for m in members:
            m.link.sent += each_way
            m.link.received += each_way
        duration = each_way * 8 / rate + 2 * lat

        def applied() -> None:
            for m in members:
                self._apply_round(m)

        self.eng.after(duration, applied)

    def _apply_round(self, p: SimPeer) -> None:
        if not p.alive:
            return
        c = p.profile.stages[p.stage]

        def merged() -> None:
            p.in_round = False
            p.round_times.append(self.eng.now)
            if p.stage == 0:
                self._commit(p)
            if p.steps >= self.node.outer_every_steps:
                self._begin_at_tick(p)

        p.worker.submit(c.step_s, merged, URGENT)

    # --- running -------------------------------------------------------------------------

    def start(self, assignment: list[tuple[PeerGroup, int | None]]) -> None:
        for g, stage in assignment:
            self.add_peer(g, stage)
        self.eng.after(self.t.heartbeat_s, self._heartbeat)
        self.eng.after(self.t.sweep_s, self._sweep)
        for t, stage in self.fleet.churn.kills:
            self.eng.at(t, partial(self.kill_one, stage))

    def measure(self, warmup_s: float, window_s: float) -> dict[str, Any]:
        self.eng.run(warmup_s)
        tok0, com0 = self.stage0_trained, self.book.committed_tokens()
        bytes0 = {p.pid: p.link.sent + p.link.received for p in self.peers.values()}
        self.eng.run(warmup_s + window_s)
        every = list(self.peers.values())
        gaps = [
            b - a
            for p in every
            for a, b in zip(p.round_times, p.round_times[1:], strict=False)
            if a >= warmup_s
        ]
        moved = sum(p.link.sent + p.link.received - bytes0.get(p.pid, 0) for p in every)
        return {
            "tokens_per_s": (self.stage0_trained - tok0) / window_s,
            "committed_tokens_per_s": (self.book.committed_tokens() - com0) / window_s,
            "round_s": sum(gaps) / len(gaps) if gaps else None,
            "reroute_s": min(self.reroutes) if self.reroutes else None,
            "bytes_per_peer_per_day": moved / max(1, len(every)) / window_s * 86400,
            "peers_live": sum(1 for p in every if p.alive),
            "joins": self.joins,
            "departures": self.departures,
            "events": self.eng.events,
        }
