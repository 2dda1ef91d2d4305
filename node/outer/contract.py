"""The typed contract between a node's stage process and its outer-loop process.

The stage side (`node.outer_link.OuterLink`) sends commands; the outer-loop process
(`node.outer.process`) answers each with one reply. Every command and reply is a small
frozen dataclass that travels as one msgpack map tagged with `op`, framed by
`protocol.framing` under `MAX_CONTROL_FRAME`. Tensors never travel here: they live in the
three shared-memory files that `Init` names. Both processes import this module, so it
imports neither torch nor hivemind nor libp2p (hivemind and py-libp2p cannot share a
process, and the stage process must never load hivemind).

One command is in flight at a time:

    Init     -> Ready
    SetState -> StateSet
    Fetch    -> StateFetched
    Begin    -> RoundResult | RoundFailed
    Peek     -> Peeked   (between rounds: are other replicas forming a group now?)
    Stop     -> (the outer process leaves its group and exits)

`Fatal` may arrive instead of any reply; the outer process exits after sending it.
`Init` carries the process's settings (`OuterConfig` from `node.outer.settings`, which
this module re-exports with `DilocoConfig` and `COMPRESSIONS`). Decoding
(`decode_command`, `decode_reply`, each class's `from_wire`) checks types, ranges, sizes
and unknown keys, and raises `protocol.errors.ProtocolError` for anything malformed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from node.outer.contract_fields import (
    MAX_ADDR,
    MAX_CONTROL_FRAME,
    MAX_DIGEST,
    MAX_NUMEL,
    MAX_PEERS,
    MAX_STAGE,
    MAX_TEXT,
    MAX_WAIT_S,
    bool_of,
    fields_of,
    float_of,
    int_of,
    lineage_of,
    link_of,
    path_of,
    str_of,
    strs_of,
    tagged,
    with_link,
)
from node.outer.settings import COMPRESSIONS, MAX_COUNT, DilocoConfig, OuterConfig
from protocol.codec import packb
from protocol.credit import MAX_CREDIT_BYTES
from protocol.errors import ProtocolError
from protocol.framing import frame
from protocol.identity import is_libp2p_private_key
from protocol.lineage import Link, to_plain

__all__ = [
    "COMMANDS",
    "COMPRESSIONS",
    "MAX_CONTROL_FRAME",
    "REPLIES",
    "Begin",
    "Command",
    "DilocoConfig",
    "Fatal",
    "Fetch",
    "Init",
    "OuterConfig",
    "Peek",
    "Peeked",
    "Ready",
    "Reply",
    "RoundFailed",
    "RoundResult",
    "SetState",
    "StateFetched",
    "StateSet",
    "Stop",
    "decode_command",
    "decode_reply",
    "encode",
]

# --- commands: stage process -> outer-loop process -------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Init:
    """The first command: which stage to serve, where the shared buffers are, and how."""

    OP: ClassVar[str] = "init"
    run_id: str  # the run, part of the DHT key prefix
    stage: int  # the stage whose replicas average together
    numel: int  # elements in each shared buffer (fp32 elements)
    initial_peers: list[str]  # DHT multiaddrs to bootstrap from; empty for the first node
    snap: str  # shared-memory file: the working-copy snapshot (absolute path)
    result: str  # shared-memory file: theta_g, written by the outer process (absolute path)
    momentum: str  # shared-memory file: the outer momentum m (absolute path)
    config: OuterConfig  # settings of the outer-loop process and its optimizer
    # the node's key as a libp2p private-key protobuf (`NodeKey.libp2p_private_key`): the
    # hivemind daemon runs under it, so the DHT peer id is the member's; b"": a fresh key
    identity: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        out = {
            "op": self.OP,
            "run_id": self.run_id,
            "stage": self.stage,
            "numel": self.numel,
            "initial_peers": list(self.initial_peers),
            "snap": self.snap,
            "result": self.result,
            "momentum": self.momentum,
            "config": self.config.to_wire(),
        }
        if self.identity:
            out["identity"] = self.identity
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj, optional=("identity",))
        identity = d.get("identity", b"")
        if type(identity) is not bytes or (identity and not is_libp2p_private_key(identity)):
            raise ProtocolError("init: identity must be an ed25519 libp2p private key")
        paths = [path_of(d, k, cls) for k in ("snap", "result", "momentum")]
        if len(set(paths)) != 3:
            raise ProtocolError("init: the three shared-memory paths must differ")
        return cls(
            run_id=str_of(d, "run_id", cls, min_len=1, max_len=128),
            stage=int_of(d, "stage", cls, lo=0, hi=MAX_STAGE),
            numel=int_of(d, "numel", cls, lo=1, hi=MAX_NUMEL),
            initial_peers=strs_of(d, "initial_peers", cls),
            snap=paths[0],
            result=paths[1],
            momentum=paths[2],
            config=OuterConfig.from_wire(d["config"]),
            identity=identity,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SetState:
    """Make the snapshot buffer the global state, at `round` (a checkpoint's, or 0), with
    the momentum buffer as m when `momentum` is set and zero momentum otherwise."""

    OP: ClassVar[str] = "set_state"
    round: int = 0  # outer steps the state has taken (rounds)
    momentum: bool = False  # whether the momentum buffer holds m
    # the chain the state descends from (a checkpoint's), without the state itself
    lineage: list[Link] = dataclasses.field(default_factory=list)
    # the peer ids the coordinator lists on this stage (as `Fetch.members`): a replica
    # that seeds the state, or fetched none, believes only their DHT records from now on
    members: list[str] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": self.OP, "round": self.round, "momentum": self.momentum,
            "lineage": to_plain(self.lineage),
        }  # fmt: skip
        if self.members is not None:
            out["members"] = list(self.members)
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj, optional=("members",))
        return cls(
            round=int_of(d, "round", cls, lo=0, hi=MAX_COUNT),
            momentum=bool_of(d, "momentum"),
            lineage=lineage_of(d, cls),
            members=strs_of(d, "members", cls) if "members" in d else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Fetch:
    """Download (theta_g, m, round) from the most advanced live replica."""

    OP: ClassVar[str] = "fetch"
    timeout_s: float  # how long to keep trying (s)
    attested: Link | None = None  # take only this (round, digest) (None: any valid state)
    # the peer ids the coordinator lists on this stage: the only state sources, and the
    # only owners of the stage's DHT records believed from now on; None: as told before
    members: list[str] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.OP, "timeout_s": self.timeout_s}
        if self.members is not None:
            out["members"] = list(self.members)
        return with_link(out, "attested", self.attested)

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj, optional=("attested", "members"))
        timeout = float_of(d, "timeout_s", cls, lo=0.0, hi=MAX_WAIT_S, lo_open=True)
        members = strs_of(d, "members", cls) if "members" in d else None
        return cls(timeout_s=timeout, attested=link_of(d, "attested", cls), members=members)


@dataclass(frozen=True, kw_only=True, slots=True)
class Begin:
    """Run a round on the snapshot buffer (the working copy as it was)."""

    OP: ClassVar[str] = "begin"
    tokens: int  # tokens trained since the last theta_g (tokens)
    target_tokens: int | None = None  # replaces DilocoConfig.target_tokens from now (tokens)
    # the stage's attested state: rebase onto it first when it is newer than ours
    attested: Link | None = None
    # the peer ids the coordinator lists on this stage (this replica's among them): the
    # round forms a group with, and adopts state from, these only; None: anyone
    members: list[str] | None = None
    # this replica's signed credit from the coordinator (protocol.credit, encoded), shown
    # to its groupmates, who bound its token claim by it; b"": none
    credit: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.OP, "tokens": self.tokens}
        if self.target_tokens is not None:
            out["target_tokens"] = self.target_tokens
        if self.members is not None:
            out["members"] = list(self.members)
        if self.credit:
            out["credit"] = self.credit
        return with_link(out, "attested", self.attested)

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj, optional=("target_tokens", "attested", "members", "credit"))
        credit = d.get("credit", b"")
        if type(credit) is not bytes or len(credit) > MAX_CREDIT_BYTES:
            raise ProtocolError(f"begin: credit must be at most {MAX_CREDIT_BYTES} bytes")
        target = None
        if "target_tokens" in d:
            target = int_of(d, "target_tokens", cls, lo=0, hi=MAX_COUNT)
        tokens = int_of(d, "tokens", cls, lo=0, hi=MAX_COUNT)
        members = strs_of(d, "members", cls) if "members" in d else None
        return cls(
            tokens=tokens, target_tokens=target, attested=link_of(d, "attested", cls),
            members=members, credit=credit,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Stop:
    """Leave the group, release the buffers and exit."""

    OP: ClassVar[str] = "stop"

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP}

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        fields_of(cls, obj)
        return cls()


@dataclass(frozen=True, kw_only=True, slots=True)
class Peek:
    """Between rounds: how many other replicas of the stage are looking for a group now?"""

    OP: ClassVar[str] = "peek"

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP}

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        fields_of(cls, obj)
        return cls()


# --- replies: outer-loop process -> stage process ---------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready:
    """The DHT and averager are up."""

    OP: ClassVar[str] = "ready"
    addrs: list[str]  # multiaddrs other nodes can bootstrap their DHT from
    peer_id: str  # the DHT's peer id (base58)

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "addrs": list(self.addrs), "peer_id": self.peer_id}

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj)
        return cls(
            addrs=strs_of(d, "addrs", cls),
            peer_id=str_of(d, "peer_id", cls, min_len=1, max_len=256),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StateSet:
    """Answer to `SetState`: the state now held."""

    OP: ClassVar[str] = "state_set"
    round: int  # outer steps of the state (rounds)
    digest: str  # blake2b of (round, theta_g, m), hex
    # the chain of the state held, ending with it (protocol.lineage)
    lineage: list[Link] = dataclasses.field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "op": self.OP, "round": self.round, "digest": self.digest,
            "lineage": to_plain(self.lineage),
        }  # fmt: skip

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj)
        return cls(
            round=int_of(d, "round", cls, lo=0, hi=MAX_COUNT),
            digest=str_of(d, "digest", cls, max_len=MAX_DIGEST),
            lineage=lineage_of(d, cls),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StateFetched:
    """Answer to `Fetch`: whether a replica's state was adopted, and the state now held
    (round -1 and an empty digest while there is none)."""

    OP: ClassVar[str] = "state"
    ok: bool  # whether a live replica's state was adopted
    round: int  # outer steps of the state held now; -1 = none (rounds)
    digest: str  # blake2b of (round, theta_g, m), hex; "" = none
    # the chain of the state held, ending with it; [] = none
    lineage: list[Link] = dataclasses.field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "op": self.OP, "ok": self.ok, "round": self.round, "digest": self.digest,
            "lineage": to_plain(self.lineage),
        }  # fmt: skip

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj)
        return cls(
            ok=bool_of(d, "ok"),
            round=int_of(d, "round", cls, lo=-1, hi=MAX_COUNT),
            digest=str_of(d, "digest", cls, max_len=MAX_DIGEST),
            lineage=lineage_of(d, cls),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundResult:
    """What an outer round produced; the new theta_g is in the result buffer
    (`OuterLink.theta_g()`)."""

    OP: ClassVar[str] = "result"
    round: int  # outer steps in the global state after this round
    # whether this replica's global state changed, or a group with nothing to average
    # settled on this replica's state as the stage's
    applied: bool
    # whether this replica's pseudo-gradient is in the state now held with a weight above
    # zero: a step alone that applied, or a group round that weighted it and whose result
    # this replica holds (stepped or adopted)
    contributed: bool
    rebased: bool  # whether the state was downloaded from a more advanced replica
    group_size: int  # replicas whose contributions were averaged (1 when alone)
    tokens: int  # tokens behind the averaged pseudo-gradient
    eta_r: float  # outer learning rate used
    bytes_out: int  # pseudo-gradient bytes this replica sent (wire)
    bytes_in: int  # pseudo-gradient bytes it received (wire)
    raw_bytes: int  # fp32 size of one pseudo-gradient
    # fp32 state bytes (theta_g and m) this replica downloaded from others, and served
    # to others, since the last result (joins, rebases, adoptions)
    state_bytes_in: int = 0
    state_bytes_out: int = 0
    seconds: float  # wall time of the round in the outer process
    rejected: dict[str, str]  # peer -> reason for contributions left out
    # contributions that centered clipping scaled down in this member's own reduction
    # (its part; the whole vector in the all-gather scheme): 0 in every member's result
    # means the round's aggregates are the plain weighted mean's bits
    clipped: int = 0
    digest: str  # blake2b of (round, theta_g, m): equal digests mean bitwise-equal states
    # the chain of the state held now, ending with it (protocol.lineage)
    lineage: list[Link] = dataclasses.field(default_factory=list)
    # a group round's canonical state when at least two members held it as the round
    # began (None: stepped alone, or no state of the group was held twice)
    agreed: Link | None = None
    # groupmates this replica caught itself (peer id -> what): a contribution its own
    # reduction rejected as no honest replica sends it, or a reducer that lied about its
    # part; the node reports them to the coordinator
    accused: dict[str, str] = dataclasses.field(default_factory=dict)
    # whether this round's contribution, weighted above zero, carried the lone steps this
    # replica took since it last held a group's state (`node.outer.parts.carried_view`):
    # their training is in the state now held though their own states are not
    carried: bool = False
    # DHT records this replica's DHT refused since the last result (counted as each
    # round begins): unsigned, signed by another peer than the one they name, or of a
    # peer not listed on the stage (node.outer.dht_records)
    records_refused: int = 0

    def to_wire(self) -> dict[str, Any]:
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "agreed"
        }
        out["rejected"] = dict(self.rejected)
        out["accused"] = dict(self.accused)
        out["lineage"] = to_plain(self.lineage)
        return with_link({"op": self.OP, **out}, "agreed", self.agreed)

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(
            cls, obj, optional=("agreed", "accused", "carried", "records_refused", "clipped")
        )
        rejected = _reasons(d["rejected"], "rejected")
        accused = _reasons(d.get("accused", {}), "accused")
        return cls(
            round=int_of(d, "round", cls, lo=0, hi=MAX_COUNT),
            applied=bool_of(d, "applied"),
            contributed=bool_of(d, "contributed"),
            rebased=bool_of(d, "rebased"),
            group_size=int_of(d, "group_size", cls, lo=1, hi=MAX_COUNT),
            tokens=int_of(d, "tokens", cls, lo=0, hi=MAX_COUNT),
            eta_r=float_of(d, "eta_r", cls, lo=0.0, hi=1e6),
            bytes_out=int_of(d, "bytes_out", cls, lo=0, hi=MAX_COUNT),
            bytes_in=int_of(d, "bytes_in", cls, lo=0, hi=MAX_COUNT),
            raw_bytes=int_of(d, "raw_bytes", cls, lo=0, hi=MAX_COUNT),
            state_bytes_in=int_of(d, "state_bytes_in", cls, lo=0, hi=MAX_COUNT),
            state_bytes_out=int_of(d, "state_bytes_out", cls, lo=0, hi=MAX_COUNT),
            seconds=float_of(d, "seconds", cls, lo=0.0, hi=MAX_WAIT_S),
            rejected=dict(rejected),
            clipped=int_of(d, "clipped", cls, lo=0, hi=MAX_COUNT) if "clipped" in d else 0,
            digest=str_of(d, "digest", cls, max_len=MAX_DIGEST),
            lineage=lineage_of(d, cls),
            agreed=link_of(d, "agreed", cls),
            accused=accused,
            carried=bool_of(d, "carried") if "carried" in d else False,
            records_refused=int_of(d, "records_refused", cls, lo=0, hi=MAX_COUNT)
            if "records_refused" in d
            else 0,
        )


def _reasons(v: Any, key: str) -> dict[str, str]:
    """A map of at most MAX_PEERS peer ids to short reasons."""
    if type(v) is not dict or len(v) > MAX_PEERS:
        raise ProtocolError(f"result: {key!r} must be a map of at most {MAX_PEERS} entries")
    for k, r in v.items():
        if type(k) is not str or type(r) is not str or len(k) > MAX_ADDR or len(r) > MAX_TEXT:
            raise ProtocolError(f"result: {key!r} maps peer ids to reasons (str)")
    return dict(v)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundFailed:
    """Answer to `Begin` when no round could run (no state yet)."""

    OP: ClassVar[str] = "round_failed"
    error: str  # what went wrong, for people (clipped to MAX_TEXT on the wire)

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "error": self.error[:MAX_TEXT]}

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj)
        return cls(error=str_of(d, "error", cls, max_len=MAX_TEXT))


@dataclass(frozen=True, kw_only=True, slots=True)
class Peeked:
    """Answer to `Peek`: other replicas whose matchmaking declaration is live in the DHT."""

    OP: ClassVar[str] = "peeked"
    waiting: int  # replicas (peers), this one not counted

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "waiting": self.waiting}

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj)
        return cls(waiting=int_of(d, "waiting", cls, lo=0, hi=MAX_PEERS))


@dataclass(frozen=True, kw_only=True, slots=True)
class Fatal:
    """The outer process failed and is exiting."""

    OP: ClassVar[str] = "fatal"
    error: str  # the exception, for people (clipped to MAX_TEXT on the wire)

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, "error": self.error[:MAX_TEXT]}

    @classmethod
    def from_wire(cls, obj: Any) -> Self:
        d = fields_of(cls, obj)
        return cls(error=str_of(d, "error", cls, max_len=MAX_TEXT))


Command = Init | SetState | Fetch | Begin | Peek | Stop
Reply = Ready | StateSet | StateFetched | RoundResult | RoundFailed | Peeked | Fatal
COMMANDS: dict[str, type[Command]] = {c.OP: c for c in (Init, SetState, Fetch, Begin, Peek, Stop)}
REPLIES: dict[str, type[Reply]] = {
    r.OP: r for r in (Ready, StateSet, StateFetched, RoundResult, RoundFailed, Peeked, Fatal)
}


def encode(msg: Command | Reply) -> bytes:
    """One length-prefixed control frame holding `msg`. The sender checks `msg` as the
    receiver will, so an out-of-range value fails here with `ProtocolError` instead of
    killing the other process."""
    wire = msg.to_wire()
    type(msg).from_wire(wire)
    return frame(packb(wire), max_frame=MAX_CONTROL_FRAME)


def decode_command(payload: bytes) -> Command:
    """A command from one frame's payload, or `ProtocolError`."""
    op, obj = tagged(payload, "command")
    if op not in COMMANDS:
        raise ProtocolError(f"unknown command {op[:64]!r}")
    return COMMANDS[op].from_wire(obj)


def decode_reply(payload: bytes) -> Reply:
    """A reply from one frame's payload, or `ProtocolError`."""
    op, obj = tagged(payload, "reply")
    if op not in REPLIES:
        raise ProtocolError(f"unknown reply {op[:64]!r}")
    return REPLIES[op].from_wire(obj)
