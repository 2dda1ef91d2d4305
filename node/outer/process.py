"""The outer-loop process: owns a stage replica's global state (theta_g, m, round), its
hivemind DHT and `StageAverager`, and serves `node.outer_link.OuterLink` over a socket.

Commands (`node.outer.contract`) arrive one at a time as msgpack frames and each gets one
reply; tensors travel through the three shared /dev/shm buffers the link created.

A round: compute `delta = theta_g - snapshot`; rebase first when the stage's attested
state (coordinator.attest: the newest state a majority of the stage's replicas reported,
passed in `Begin`) is newer than ours, downloading exactly that state; average with
whoever forms a group before `matchmaking_s` (alone otherwise); apply elastic Nesterov
when this replica holds the group's canonical state (the state most members hold; among
equally held ones the attested state more than half the members name, then the newest
round: `node.outer.parts.group_canonical`), or adopt the stepped state from a groupmate
that held it when it does not. A replica that stepped alone since it last held a group's
state carries those steps: when its group steps that earlier state, its contribution is
its whole progress from it (`node.outer.parts.carried_view`), so the lone work is
averaged in rather than dropped. A group with nothing to average (no contribution had
tokens) still settles the canonical state: its holders keep it, the others download it
from them. State is downloaded from the group's holders only, never from whoever
declares the highest DHT priority. Replicas stay bitwise identical because each decodes
the same compressed bytes in the same order.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from node.diloco import Contribution, OuterState, nesterov_step, outer_step, participation_lr
from node.outer.averager import StageAverager
from node.outer.contract import (
    MAX_CONTROL_FRAME,
    Begin,
    Command,
    Fetch,
    Init,
    Peek,
    Peeked,
    Ready,
    Reply,
    RoundFailed,
    RoundResult,
    SetState,
    StateFetched,
    StateSet,
    Stop,
    decode_command,
    encode,
)
from node.outer.contract_fields import caught
from node.outer.dht_records import MemberRecords, admit_members, keep_valid_entries
from node.outer.lifecycle import identity_file, node_key, port_retried, vanish
from node.outer.parts import MAX_ADDRS, group_canonical, group_target, named_attested
from node.outer.settings import MAX_COUNT
from node.outer.sparse import SPARSE, ErrorFeedback
from node.outer.state_download import state_digest
from node.outer.wire import compression
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder
from protocol.lineage import Link, check_lineage, extend, to_plain

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 60.0  # the link sends Init right after starting this process (s)
# a rebase that cannot get the attested state (its holders moved on) in this long gives
# up until the next round, which carries a newer attested state (s)
REBASE_TIMEOUT_S = 10.0


def digest(state: OuterState) -> str:
    return state_digest(state.round, state.theta_g, state.m)


def source_lineage(meta: dict[str, Any]) -> list[Link]:
    """The chain another replica shared with its state; a malformed one (hostile or
    older) is dropped: the adopted state's chain then starts with that state."""
    try:
        return check_lineage(meta.get("lineage", []), "shared state: lineage")
    except ProtocolError as exc:
        log.warning("%s; the adopted state's history is not known", exc)
        return []


class OuterProcess:
    def __init__(
        self, sock: socket.socket, averager_cls: type[StageAverager] = StageAverager
    ) -> None:
        self.sock = sock
        self.averager_cls = averager_cls  # a rogue subclass only in chaos tools and tests
        self.decoder = FrameDecoder(max_frame=MAX_CONTROL_FRAME)
        self.inbox: list[Command] = []
        self.lock = threading.Lock()  # guards `state` against the state-sharing thread
        self.state: OuterState | None = None
        self.digest = ""
        self.listen_addrs: list[str] = []  # where this DHT listens (multiaddrs, no /p2p/)
        self.lineage: list[Link] = []  # the chain of `state`, ending with it
        # fp32 state bytes downloaded from / served to other replicas since the last
        # round result (served ones counted under `lock`, by the state-sharing thread)
        self.state_in = 0
        self.state_out = 0
        # The lone steps since this replica last held a group's state: that state, the
        # steps' summed updates (`carry`, a shared buffer the averager reads) and their
        # tokens. A group that steps that state takes them in this replica's
        # contribution instead of dropping them (`node.outer.parts.carried_view`).
        self.carry_base: Link | None = None
        self.carry_tokens = 0

    # ---- socket ----------------------------------------------------------------------

    def send(self, reply: Reply) -> None:
        self.sock.sendall(encode(reply))

    def recv(self, timeout: float | None = None) -> Command | None:
        """The next command, or None once the stage process closed the link. Between
        rounds it waits without a deadline (`timeout` None): the stage process decides when
        this process stops, and its exit closes the link."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.inbox:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no command from the stage process within {timeout}s")
                self.sock.settimeout(left)
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.inbox.extend(decode_command(p) for p in self.decoder.feed(data))
        self.sock.settimeout(None)
        return self.inbox.pop(0)

    def _recv_or_vanish(self, paths: Iterable[str]) -> Command:
        """The next command; a link closed without a `Stop` (the stage process died) ends
        this process (`vanish`)."""
        try:
            if (cmd := self.recv()) is not None:
                return cmd
        except ConnectionError:
            pass
        vanish(paths)

    # ---- lifecycle -------------------------------------------------------------------

    def serve(self) -> int:
        init = self.recv(INIT_TIMEOUT_S)
        if not isinstance(init, Init):
            raise ProtocolError(f"expected an init command first, got {init!r:.200}")
        self.cfg = init.config
        self.snap, self.result, self.momentum = (
            torch.from_file(path, shared=True, size=init.numel, dtype=torch.float32)
            for path in (init.snap, init.result, init.momentum)
        )
        self.prefix = f"agora-{init.run_id}-stage{init.stage}"
        key = node_key(init.identity)
        # built before the DHT process forks from this one: that process's copy is the
        # one `admit_members` updates (and its DHT drops refused records one by one)
        keep_valid_entries()
        self.records = MemberRecords(key, guarded=[
            DHTID.generate(source=f"{self.prefix}{k}").to_bytes()
            for k in (".0b", ".all_averagers", ".addrs")  # matchmaking, sharing, addresses
        ])  # fmt: skip
        self.refused = 0  # records its validator refused, not yet reported in a round
        with identity_file(key.libp2p_private_key()) as identity_path:
            self.dht = port_retried(
                lambda: DHT(
                    initial_peers=list(init.initial_peers),
                    host_maddrs=[f"/ip4/{self.cfg.host}/tcp/{self.cfg.port}"],
                    announce_maddrs=list(self.cfg.announce) or None,
                    identity_path=identity_path,
                    # no second daemon to ask whether the key is in use: it is the node's
                    check_if_identity_free=False,
                    record_validators=[self.records],
                    start=True,
                    await_ready=True,
                ),
                os_chosen=self.cfg.port == 0,
            )
        addrs = [str(a) for a in self.dht.get_visible_maddrs()]
        self.listen_addrs = [a.split("/p2p/")[0] for a in addrs][:MAX_ADDRS]
        self.contribution = torch.zeros(init.numel, dtype=torch.float32)
        # what a sparse codec has not sent yet (with a dense one, everything is sent)
        self.feedback = ErrorFeedback(SPARSE.get(self.cfg.compression))
        carry = torch.zeros(init.numel, dtype=torch.float32)
        self.carry = carry.share_memory_()  # type: ignore[no-untyped-call]  # forked: shared
        # the round's limit, plus the exchange's bytes at the slowest rate waited for
        exchange_s = self.cfg.round_timeout_s + self.cfg.exchange_s(init.numel)
        self.averager = self.averager_cls(
            self.contribution,
            self.dht,
            prefix=self.prefix,
            wire_compression=compression(self.cfg.compression),
            diloco=self.cfg.diloco,
            exchange_timeout=exchange_s,
            state_provider=self.current_state,
            carry=self.carry,
            state_min_rate=self.cfg.min_rate_mb_s * 1e6,
            credit_scope=(init.run_id, init.stage),
            scheme=self.cfg.averaging,
            target_group_size=self.cfg.target_group_size,
            min_group_size=2,
            min_matchmaking_time=self.cfg.matchmaking_s,
            request_timeout=self.cfg.request_timeout_s,
            allreduce_timeout=exchange_s + 5.0,
            next_chunk_timeout=self.cfg.round_timeout_s,
            allow_state_sharing=False,  # until this replica holds a state
            declare_state_period=5.0,
            shutdown_timeout=3.0,
            announce=self.listen_addrs,
        )
        self.averager.run_in_background(await_ready=True, timeout=self.cfg.startup_timeout_s)
        log.info("outer process for %s up: %s", self.prefix, addrs)
        self.send(Ready(addrs=addrs, peer_id=self.dht.peer_id.to_base58()))
        paths = (init.snap, init.result, init.momentum)
        try:
            while not isinstance(cmd := self._recv_or_vanish(paths), Stop):
                reply = self.handle(cmd)
                try:
                    self.send(reply)
                except ConnectionError:  # the stage process died while this command ran
                    vanish(paths)
        finally:
            # the link unlinks these too; doing it here covers a command that failed
            for path in paths:
                Path(path).unlink(missing_ok=True)
            self.averager.shutdown()
            self.dht.shutdown()
        return 0

    def handle(self, cmd: Command) -> Reply:
        """One command after `Init`, and its reply."""
        if isinstance(cmd, (SetState, Fetch)):  # a state set or fetched: no residual yet
            self.feedback.reset()
            if cmd.members is not None:  # None: as before
                self.admit(cmd.members)
        if isinstance(cmd, SetState):  # round 0, or a checkpoint's round and momentum
            state = OuterState.fresh(self.snap)
            state.round = cmd.round
            if cmd.momentum:
                state.m = self.momentum.clone()
            self.adopt(state, cmd.lineage)
            return StateSet(round=state.round, digest=self.digest, lineage=list(self.lineage))
        if isinstance(cmd, Fetch):
            ok = self.holds(cmd.attested) or self.download(
                cmd.timeout_s, min_round=-1, want=cmd.attested
            )
            rnd = self.state.round if self.state else -1
            return StateFetched(ok=ok, round=rnd, digest=self.digest, lineage=list(self.lineage))
        if isinstance(cmd, Begin):
            if cmd.target_tokens is not None:  # the participation rule's target (tokens)
                self.cfg.diloco.target_tokens = cmd.target_tokens
            return self.run_round(cmd.tokens, cmd.attested, cmd.members, cmd.credit)
        if isinstance(cmd, Peek):
            return Peeked(waiting=self.peers_looking_for_group())
        raise ProtocolError(f"unexpected command {cmd!r:.200}")

    # ---- state -----------------------------------------------------------------------

    def current_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Served to joiners by hivemind's state sharing (host-process thread)."""
        with self.lock:
            if self.state is None:
                return {"round": -1, "digest": "", "lineage": []}, []
            st = self.state
            meta = {"round": st.round, "digest": self.digest, "lineage": to_plain(self.lineage)}
            self.state_out += 4 * (st.theta_g.numel() + st.m.numel())
            return meta, [st.theta_g.clone(), st.m.clone()]

    def adopt(self, state: OuterState, lineage: list[Link], lone: bool = False) -> None:
        """Hold `state`, whose ancestors are `lineage` (the chain then ends with it);
        unless this replica stepped to it alone (`lone`), it carries no lone steps."""
        if not lone:
            self.carry_base, self.carry_tokens = None, 0
        with self.lock:
            self.state = state
            self.digest = digest(state)
            self.lineage = extend(lineage, state.round, self.digest)
        self.result.copy_(state.theta_g)
        self.momentum.copy_(state.m)
        self.averager.allow_state_sharing = True
        self.averager.state_sharing_priority = float(state.round)

    def holds(self, want: Link | None) -> bool:
        """This replica already holds the state `want` names (the seeded round 0 that
        every replica of a stage starts from, say): nothing to download."""
        with self.lock:
            return (
                want is not None
                and self.state is not None
                and (self.state.round, self.digest) == (want[0], want[1])
            )

    def download(
        self,
        timeout: float,
        min_round: int,
        want: Link | None = None,
        sources: list[str] | None = None,
    ) -> bool:
        """Adopt the state of the most advanced replica that shares it (by DHT priority),
        of a round above `min_round`; with `want`, only the state of that (round, digest);
        with `sources` (base58 peer ids), only from those replicas. `timeout` bounds the
        search for a source; a transfer that started gets `OuterConfig.transfer_s` more
        (a large stage on a slow link), so only a source that starts late runs past it."""
        deadline = time.monotonic() + timeout
        transfer = self.cfg.transfer_s(self.result.numel())
        while time.monotonic() < deadline:
            try:
                left = max(0.5, deadline - time.monotonic())
                got = self.averager.load_state(left + transfer, want, sources)
            except TimeoutError:  # the averager is still at it; its sources are bounded
                got = None
            if got is not None:  # checked by the averager (node.outer.state_download)
                meta, tensors = got
                rnd = meta.get("round", -1) if isinstance(meta, dict) else -1
                shapes = [tuple(t.shape) for t in tensors]
                if type(rnd) is int and rnd > min_round and shapes == [self.result.shape] * 2:
                    theta_g, m = (t.detach().to(torch.float32).contiguous() for t in tensors)
                    if bool(torch.isfinite(theta_g).all() and torch.isfinite(m).all()):
                        state = OuterState(theta_g=theta_g.clone(), m=m.clone(), round=rnd)
                        self.state_in += 4 * (theta_g.numel() + m.numel())
                        self.adopt(state, source_lineage(meta))
                        log.info("adopted state of round %d", rnd)
                        return True
            time.sleep(0.2)
        return False

    def admit(self, members: list[str] | None) -> None:
        """Groups, state sources, the stage's DHT records: of `members` only (None: anyone)."""
        self.averager.prepare(members)
        if members is not None:
            self.refused += admit_members(self.dht, members) or 0

    def peers_looking_for_group(self) -> int:
        """Other replicas of this stage whose matchmaking declaration (hivemind's group key,
        one subkey per averager, True while it looks for a group) has not expired."""
        found = self.dht.get(f"{self.prefix}.0b", latest=True)
        if found is None or not isinstance(found.value, dict):
            return 0
        me, now = self.dht.peer_id.to_bytes(), get_dht_time()
        return sum(
            1
            for key, v in found.value.items()
            if key != me
            and getattr(v, "value", None) is True
            and float(getattr(v, "expiration_time", 0.0)) > now
        )

    # ---- a round ---------------------------------------------------------------------

    def run_round(
        self,
        tokens: int,
        attested: Link | None = None,
        members: list[str] | None = None,
        credit: bytes = b"",
    ) -> RoundResult | RoundFailed:
        t0 = time.monotonic()
        if self.state is None:
            return RoundFailed(error="no state: call set_state or fetch_state first")
        self.admit(members)
        base = self.state
        delta = base.theta_g - self.snap
        ref_norm = float(torch.linalg.vector_norm(base.theta_g))
        rebased = False
        if attested is not None and attested[0] > base.round:  # we missed rounds: rebase
            wait = min(self.cfg.state_timeout_s, REBASE_TIMEOUT_S)
            rebased = self.download(wait, base.round, want=attested)
            if not rebased:
                log.warning("could not download the attested state of round %d", attested[0])
        st = self.state
        assert st is not None
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(self.feedback.select(delta))
        gather = {
            "round": st.round,
            "digest": self.digest,
            "base_round": base.round,
            "tokens": tokens,
            "target": max(0, int(self.cfg.diloco.target_tokens)),
            "ref_norm": ref_norm,
            "addrs": self.listen_addrs,  # groupmates dial these (the daemon may not route)
            "carry_round": self.carry_base[0] if self.carry_base else -1,
            "carry_digest": self.carry_base[1] if self.carry_base else "",
            "carry_tokens": self.carry_tokens if self.carry_base else 0,
            # the group breaks a tie on the state its members hold by the attested state
            # most of them name (node.outer.parts.group_canonical)
            "attested_round": attested[0] if attested is not None else -1,
            "attested_digest": attested[1] if attested is not None else "",
            # the coordinator's signed word that groupmates bound our tokens by (node.outer.credit)
            "credit": credit,
        }
        info: Any = None
        if members is not None and not set(members) - {self.dht.peer_id.to_base58()}:
            # no other replica is listed on the stage, and groups admit members only: no
            # group can form, so the window is not waited out (a drain's last round)
            log.info("no other member on the stage; stepping alone")
        else:
            try:
                info = self.averager.step(
                    gather=gather,
                    weight=1.0,
                    timeout=self.cfg.matchmaking_s * 2 + 1.0,
                    allow_retries=False,
                )
            except Exception as exc:  # no group formed in time: this replica steps alone
                log.info("no group this round (%r); stepping alone", exc)
        bytes_out, bytes_in, rejected, carried = 0, 0, {}, False
        agreed = self.agreed(info) if isinstance(info, dict) else None
        accused = caught(info) if isinstance(info, dict) else {}
        if isinstance(info, dict) and not info.get("has_delta") and len(info["gathered"]) > 1:
            # A group formed but had nothing to average (no tokens anywhere, e.g. replicas
            # out of data whose trained work waits for a group round): it still settles
            # which state is the stage's.
            rejected = {str(k): str(v) for k, v in info["rejected"].items()}
            applied, rnd, size, rebased_now = self.settle_group_round(info)
            rebased = rebased or rebased_now
            eta_r, used, contributed = 0.0, 0, False
        elif not isinstance(info, dict) or not info.get("has_delta"):
            applied, rnd, eta_r, used, size = self.step_alone(delta, tokens, base.round, ref_norm)
            contributed = applied
        else:
            bytes_out, bytes_in = int(info["bytes_out"]), int(info["bytes_in"])
            rejected = {str(k): str(v) for k, v in info["rejected"].items()}
            with self.averager.get_tensors() as tensors:
                d = tensors[0].clone()
            carried = bool(info.get("carried"))
            if carried:  # the lone steps rode in this round, whatever became of it
                self.carry_base, self.carry_tokens = None, 0
            applied, rnd, eta_r, used, size, adopted = self.finish_group_round(info, d)
            rebased = rebased or adopted
            contributed = applied and self.own_weight(info) > 0.0
        self.feedback.settle(used=contributed and size > 1)  # a lone step applied it all
        with self.lock:
            state_in, state_out, self.state_in, self.state_out = self.state_in, self.state_out, 0, 0
        refused, self.refused = self.refused, 0  # since the last round's report
        return RoundResult(
            round=rnd,
            applied=applied,
            contributed=contributed,
            rebased=rebased,
            group_size=size,
            tokens=used,
            eta_r=eta_r,
            bytes_out=bytes_out,
            bytes_in=bytes_in,
            raw_bytes=int(delta.numel() * 4),
            state_bytes_in=state_in,
            state_bytes_out=state_out,
            seconds=time.monotonic() - t0,
            rejected=rejected,
            clipped=int(info.get("clipped", 0)) if isinstance(info, dict) else 0,
            digest=self.digest,
            lineage=list(self.lineage),
            agreed=agreed,
            accused=accused,
            carried=carried and contributed,
            records_refused=refused,
        )

    def step_alone(
        self, delta: torch.Tensor, tokens: int, base_round: int, ref_norm: float
    ) -> tuple[bool, int, float, int, int]:
        st = self.state
        assert st is not None
        new = OuterState(theta_g=st.theta_g.clone(), m=st.m.clone(), round=st.round)
        contrib = Contribution(delta=delta, tokens=tokens, staleness=max(0, st.round - base_round))
        rep = outer_step(new, [contrib], self.cfg.diloco)
        if rep.applied:
            if self.carry_base is None:
                self.carry_base = (st.round, self.digest)
                self.carry.zero_()
            self.carry.add_(st.theta_g - new.theta_g)
            self.carry_tokens = min(MAX_COUNT, self.carry_tokens + rep.tokens)
            self.adopt(new, self.lineage, lone=True)
        return rep.applied, new.round, rep.eta_r, rep.tokens, 1

    def own_weight(self, info: dict[str, Any]) -> float:
        """This replica's weight in a group round's aggregate (0 when left out)."""
        me = self.dht.peer_id.to_base58()
        contributors: list[str] = info["contributors"]
        return float(info["weights"][contributors.index(me)]) if me in contributors else 0.0

    @staticmethod
    def canonical(info: dict[str, Any]) -> tuple[Link, list[str]]:
        """The group's canonical (round, digest) and the members holding it
        (`node.outer.parts.group_canonical`, as the averager found it)."""
        gathered: dict[str, dict[str, Any]] = info["gathered"]
        held = {p: (int(g["round"]), str(g["digest"])) for p, g in gathered.items()}
        return group_canonical(held, [named_attested(g) for g in gathered.values()])

    @classmethod
    def agreed(cls, info: dict[str, Any]) -> Link | None:
        """The group's canonical state when at least two members held it as the round
        began, else None. Two holders of one state make it the stage's (the commit rule,
        node/lease_pool.py): a state only one replica held may still lose to another of
        the same round at the next group, whatever this round made of it."""
        if len(info.get("gathered", ())) < 2:
            return None
        head, holders = cls.canonical(info)
        return head if len(holders) >= 2 else None

    def settle_group_round(self, info: dict[str, Any]) -> tuple[bool, int, int, bool]:
        """A group with nothing to average: the holders of its canonical state keep it
        (the group settled on it: `applied`, though the state is unchanged), the others
        download exactly that state from them. Returns (applied, round, size, adopted)."""
        head, holders = self.canonical(info)
        st = self.state
        assert st is not None
        size = len(info["gathered"])
        if (st.round, self.digest) == head:  # the group's state now: no lone steps
            self.carry_base, self.carry_tokens = None, 0
            return True, st.round, size, False
        ok = self.download(self.cfg.state_timeout_s, head[0] - 1, want=head, sources=holders)
        return ok, self.state.round if self.state else -1, size, ok

    def finish_group_round(
        self, info: dict[str, Any], d: torch.Tensor
    ) -> tuple[bool, int, float, int, int, bool]:
        """Step when holding the group's canonical (round, digest); otherwise adopt the
        state a holder stepped to."""
        head, holders = self.canonical(info)
        st = self.state
        assert st is not None
        tokens = int(info["tokens"])
        size = len(info["contributors"])
        target = group_target(list(info["gathered"].values()), self.cfg.diloco.target_tokens)
        eta_r = participation_lr(
            self.cfg.diloco.eta, tokens, target, self.cfg.diloco.participation_power
        )
        if (st.round, self.digest) == head:
            new = OuterState(theta_g=st.theta_g.clone(), m=st.m.clone(), round=st.round + 1)
            nesterov_step(new, d, eta_r, self.cfg.diloco.mu)
            self.adopt(new, self.lineage)
            return True, new.round, eta_r, tokens, size, False
        log.info(
            "state (round %d) is not the group's canonical one (round %d); adopting it",
            st.round,
            head[0],
        )
        ok = self.download(self.cfg.state_timeout_s, head[0], sources=holders)
        return ok, self.state.round if self.state else -1, eta_r, tokens, size, ok
