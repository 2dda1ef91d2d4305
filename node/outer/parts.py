"""The pieces of a reduce-scatter round that do not touch the network: the header each
push carries, the manifest a reducer returns with its part, the check of the gathered
metadata, who audits which part, and the per-member checks of a reducer's manifest.

`node.outer.averager` moves the bytes; everything here is pure data in, data out (the
manifest checks take decoded tensors) so that it can be tested on its own. Every header,
manifest and gathered map comes from another participant: the decoders bound sizes and
check types and raise `ProtocolError` (headers, manifests) or replace the entry
(gathered metadata) instead of trusting it. See docs/outer-averaging.md.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from node.diloco import ROBUST_REASONS
from node.outer.settings import MAX_COUNT
from protocol.codec import packb, unpackb
from protocol.credit import MAX_CREDIT_BYTES
from protocol.errors import ProtocolError
from protocol.lineage import Link

KINDS = ("contrib", "audit", "reduced")  # what a push carries
MAX_HEADER = 1 << 18  # bytes in one push header (a manifest of up to MAX_MEMBERS entries)
MAX_MEMBERS = 1024  # entries in a manifest (peers)
MAX_PEER = 128  # characters in a base58 peer id
MAX_REASON = 512  # characters in a rejection reason
MAX_DIGEST = 64  # characters in a hex digest
# the gathered metadata of a member whose own is malformed: it contributes nothing and is
# never the group's canonical state (round -1)
NO_METADATA: dict[str, Any] = {
    "round": -1, "digest": "", "base_round": -1, "tokens": 0, "target": 0, "ref_norm": 0.0,
    "addrs": [], "carry_round": -1, "carry_digest": "", "carry_tokens": 0,
    "attested_round": -1, "attested_digest": "", "credit": b"",
}  # fmt: skip
K = TypeVar("K", bound=Hashable)  # how a caller names a group's members
MAX_ADDRS = 16  # addresses a member announces in its gathered metadata
MAX_ADDR = 256  # characters in one of them


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One contribution a reducer received for its part, as its manifest reports it."""

    peer: str  # the contributor (base58 peer id)
    weight: float  # its weight in the part's aggregate; 0 = rejected (token units)
    reason: str  # why it was rejected; "" when weighted
    digest: str  # `digest()` of the compressed part the reducer received (hex)


@dataclass(frozen=True, kw_only=True, slots=True)
class Header:
    """The first message of a push: what follows and for which part."""

    kind: str  # one of KINDS
    part: int  # the part's index in the group's parts
    manifest: list[Entry] | None = None  # with kind "reduced" only

    def encode(self) -> bytes:
        obj: dict[str, Any] = {"kind": self.kind, "part": self.part}
        if self.manifest is not None:
            obj["manifest"] = [[e.peer, e.weight, e.reason, e.digest] for e in self.manifest]
        out = packb(obj)
        if len(out) > MAX_HEADER:
            raise ProtocolError(f"push header of {len(out)} bytes is over {MAX_HEADER}")
        return out


def decode_header(raw: bytes, parts: int) -> Header:
    """A push header from another member, for a round of `parts` parts, or ProtocolError."""
    if len(raw) > MAX_HEADER:
        raise ProtocolError(f"push header of {len(raw)} bytes is over {MAX_HEADER}")
    obj = unpackb(raw, max_size=MAX_HEADER)
    if type(obj) is not dict or set(obj) - {"kind", "part", "manifest"}:
        raise ProtocolError("push header: expected a map of kind, part and manifest")
    kind, part = obj.get("kind"), obj.get("part")
    if kind not in KINDS or type(part) is not int or not 0 <= part < parts:
        raise ProtocolError(f"push header: bad kind or part (of {parts})")
    if (kind == "reduced") != ("manifest" in obj):
        raise ProtocolError("push header: a manifest comes with a reduced part, and only then")
    manifest = decode_manifest(obj["manifest"]) if kind == "reduced" else None
    return Header(kind=kind, part=part, manifest=manifest)


def decode_manifest(obj: Any) -> list[Entry]:
    """A reducer's manifest: distinct peers, finite non-negative weights, bounded strings."""
    if type(obj) is not list or len(obj) > MAX_MEMBERS:
        raise ProtocolError(f"manifest: expected a list of at most {MAX_MEMBERS} entries")
    out: list[Entry] = []
    for item in obj:
        if type(item) is not list or len(item) != 4:
            raise ProtocolError("manifest: each entry is [peer, weight, reason, digest]")
        peer, weight, reason, dg = item
        if type(weight) is int and 0 <= weight <= MAX_COUNT:
            weight = float(weight)
        if type(weight) is not float or not math.isfinite(weight) or weight < 0.0:
            raise ProtocolError("manifest: a weight must be a finite number >= 0")
        for value, limit in ((peer, MAX_PEER), (reason, MAX_REASON), (dg, MAX_DIGEST)):
            if type(value) is not str or len(value) > limit:
                raise ProtocolError(f"manifest: strings of at most {limit} characters")
        if not peer:
            raise ProtocolError("manifest: an entry names no peer")
        out.append(Entry(peer=peer, weight=weight, reason=reason, digest=dg))
    if len({e.peer for e in out}) != len(out):
        raise ProtocolError("manifest: a peer appears twice")
    return out


def digest(compression: int, dtype: str, size: Sequence[int], buffer: bytes) -> str:
    """blake2b of one compressed tensor's fields, hex: what a member sent and what its
    reducer received compare equal exactly when the bytes are the same."""
    h = hashlib.blake2b(digest_size=16)
    h.update(packb([compression, dtype, list(size)]))
    h.update(buffer)
    return h.hexdigest()


def checked_gathered(raw: Any) -> dict[str, Any]:
    """One member's gathered metadata (round, digest, base_round, tokens, the
    participation rule's target tokens as it sees the stage, ref_norm, the multiaddrs
    its outer process listens on, without `/p2p/`, its carry: see `carried_view`, and
    the stage's attested state as it last heard, round -1 for none: see
    `group_canonical`, and its encoded credit, b"" for none: see `node.outer.credit`),
    or `NO_METADATA` when it is malformed."""
    if type(raw) is not dict or set(raw) != set(NO_METADATA):
        return dict(NO_METADATA)
    ints = ("round", "base_round", "tokens", "target", "carry_round", "carry_tokens")
    for key in (*ints, "attested_round"):
        v = raw[key]
        low = 0 if key in ("tokens", "target", "carry_tokens") else -1
        if type(v) is not int or not low <= v <= MAX_COUNT:
            return dict(NO_METADATA)
    norm = raw["ref_norm"]
    if type(norm) is int:
        norm = float(norm)
    if type(norm) is not float or not math.isfinite(norm) or norm < 0.0:
        return dict(NO_METADATA)
    for key in ("digest", "carry_digest", "attested_digest"):
        if type(raw[key]) is not str or len(raw[key]) > MAX_DIGEST:
            return dict(NO_METADATA)
    if not addrs_ok(raw["addrs"]):
        return dict(NO_METADATA)
    if type(raw["credit"]) is not bytes or len(raw["credit"]) > MAX_CREDIT_BYTES:
        return dict(NO_METADATA)
    return {**raw, "ref_norm": norm}


def addrs_ok(addrs: object) -> bool:
    """A peer's announced addresses: a list of at most MAX_ADDRS non-empty strings of at
    most MAX_ADDR characters (untrusted input, checked before use)."""
    return (
        type(addrs) is list
        and len(addrs) <= MAX_ADDRS
        and all(type(a) is str and 0 < len(a) <= MAX_ADDR for a in addrs)
    )


def canonical_state(held: Mapping[K, Link], attested: Link | None = None) -> tuple[Link, list[K]]:
    """A group's canonical (round, digest), the state its round steps, and the members
    holding it (`held`: member -> the state it holds as the round begins): the state most
    members hold; among equally held ones the stage's attested state, then the newest
    round, then the smaller digest."""
    claims = list(held.values())
    head = max(
        set(claims),
        key=lambda s: (claims.count(s), s == attested, s[0], [-ord(ch) for ch in s[1]]),
    )
    return head, [p for p, s in held.items() if s == head]


class Undecided(ValueError):
    """A group whose members tie on the state they hold and do not agree which one the
    stage attested: no member may step any of them."""


def named_attested(g: Mapping[str, Any]) -> Link | None:
    """The attested state one member's gathered metadata names, None for none."""
    rnd = int(g["attested_round"])
    return None if rnd < 0 else (rnd, str(g["attested_digest"]))


def group_canonical(held: Mapping[K, Link], named: Sequence[Link | None]) -> tuple[Link, list[K]]:
    """`canonical_state` of a group whose members name, in their gathered metadata, the
    attested state each heard of last (`named`). The tie-break needs one attested state
    for the whole group: each member's own view differs for a heartbeat after a round,
    and two members stepping two states in one group round leave the stage split. So the
    group takes the state more than half of its members name (None when that is no
    state); when the held states tie and no state is named by more than half, it raises
    `Undecided` (each member then rounds alone, as when no group forms). A minority
    cannot name the tie-break; in a group of two, either member can refuse it."""
    holders = Counter(held.values())
    top = max(holders.values())
    if sum(1 for n in holders.values() if n == top) < 2:
        return canonical_state(held)
    counts = Counter(named)
    value, n = counts.most_common(1)[0] if counts else (None, 0)
    if 2 * n <= len(named):
        raise Undecided(
            f"members tie on {top} holder(s) each and name {len(counts)} attested states "
            f"(none by more than half): {sorted(counts.items(), key=str)[:4]}"
        )
    return canonical_state(held, value)


def carried_view(
    gathered: Mapping[K, dict[str, Any]], head: Link
) -> tuple[dict[K, dict[str, Any]], set[K]]:
    """The gathered metadata as the group weights it, once its canonical state `head` is
    known, and the members whose contribution carries their lone rounds.

    A replica that stepped alone since it last held a group's state declares that state
    (`carry_round`, `carry_digest`) and the tokens of its lone steps (`carry_tokens`).
    When the group steps that very state and the member does not hold it, the member's
    lone work would be dropped: it adopts the stepped state. Instead it contributes its
    progress from that state (its lone steps' updates plus this round's pseudo-gradient),
    which counts as fresh (round and base round of `head`) with the lone steps' tokens
    added. Every member derives this alike from the gathered metadata, and the robust
    rules and token cap apply to the carried contribution as to any other."""
    view: dict[K, dict[str, Any]] = {}
    carried: set[K] = set()
    for p, g in gathered.items():
        held = (int(g["round"]), str(g["digest"]))
        base = (int(g["carry_round"]), str(g["carry_digest"]))
        if held != head and base == head and int(g["carry_tokens"]) > 0:
            tokens = min(MAX_COUNT, int(g["tokens"]) + int(g["carry_tokens"]))
            view[p] = {**g, "round": head[0], "base_round": head[0], "tokens": tokens}
            carried.add(p)
        else:
            view[p] = g
    return view, carried


def group_ref_norm(gathered: Sequence[dict[str, Any]]) -> float:
    """The reference norm every reducer of the group uses: the lower median of the
    members' ref_norm (a minority cannot move it past an honest member's)."""
    norms = sorted(float(g["ref_norm"]) for g in gathered)
    return norms[(len(norms) - 1) // 2] if norms else 0.0


def group_target(gathered: Sequence[dict[str, Any]], own: int) -> int:
    """The participation rule's target (tokens) the whole group steps with: the lower
    median of the members' positive targets, `own` when none claims one. Each member
    derives its target from its own view of the stage's replicas, and views differ for a
    heartbeat or two around a join or a leave; two members stepping one group round with
    different targets end with different states (the same round, two digests). A
    minority cannot raise it past an honest member's (the step cannot be shrunk), and
    lowering it only reaches the full outer learning rate."""
    positive = sorted(t for g in gathered if (t := int(g["target"])) > 0)
    return positive[(len(positive) - 1) // 2] if positive else own


def group_claims(
    gathered: Sequence[dict[str, Any]],
    max_token_ratio: float,
    caps: Sequence[int | None] | None = None,
) -> tuple[int, list[int], list[int]]:
    """What a group counts of its members' own claims (in `gathered`'s order), so that a
    minority cannot steer it: (head round, each member's staleness, each member's
    counted tokens).

    - The head is the upper median of the claimed rounds: inflated rounds from fewer
      than half the members cannot make the others' contributions stale (with the max,
      one claim of round 2**62 dropped every honest contribution).
    - A member's tokens count up to `max_token_ratio` times the lower median of the
      positive claims: an inflated claim cannot outweigh the group (zero claims, e.g.
      from a replica out of data, do not pull the cap down), and up to its entry of
      `caps` (what the coordinator's credits back, `node.outer.credit.credit_caps`;
      None: no bound).
    """
    if not gathered:
        return -1, [], []
    rounds = sorted(int(g["round"]) for g in gathered)
    head = rounds[len(rounds) // 2]
    staleness = [max(0, head - int(g["base_round"])) for g in gathered]
    positive = sorted(t for g in gathered if (t := int(g["tokens"])) > 0)
    cap = int(max_token_ratio * positive[(len(positive) - 1) // 2]) if positive else 0
    tokens = [min(int(g["tokens"]), cap) for g in gathered]
    if caps is not None:
        tokens = [t if c is None else min(t, c) for t, c in zip(tokens, caps, strict=True)]
    return head, staleness, tokens


def audit_choice(group_id: bytes, members: int, parts: int) -> tuple[int, int] | None:
    """(auditor, part): the member that re-aggregates one part from the raw contributions,
    and that part (never the auditor's own), both drawn from the group id; None below 3
    members or 2 parts."""
    if members < 3 or parts < 2:
        return None
    h = int.from_bytes(hashlib.blake2b(group_id, digest_size=8).digest(), "little")
    auditor = h % members
    others = [j for j in range(parts) if j != auditor]
    return auditor, others[(h // members) % len(others)]


def needs_others(reason: str) -> bool:
    """Whether a rejection reason is one a member cannot re-check from its own
    contribution alone: the median check's, the pair bound's (`node.diloco.
    pair_problem`, against the reducer's own contribution) or the majority's direction
    (`node.diloco.direction_problems`). The audit re-checks them."""
    return "median" in reason or reason.startswith(ROBUST_REASONS)


def own_entry_finding(
    manifest: Sequence[Entry],
    me: str,
    sent_digest: str,
    owed_weight: float,
    own_reason: str | None,
) -> str | None:
    """What is wrong with a reducer's report of this member's contribution, which the
    reducer acknowledged receiving, or None: it must list it, with the digest of the bytes
    sent, and weight it with the weight it is owed (`owed_weight`: tokens x staleness
    weight from the gathered metadata) unless it rejects it; a rejection that does not
    need the others' contributions (`needs_others`) must be one that the member's own
    check (`own_reason`: the single-contribution rules on its own part) also finds."""
    mine = [e for e in manifest if e.peer == me]
    if not mine:
        return "left out a contribution it acknowledged"
    e = mine[0]
    if e.digest != sent_digest:
        return "reports other bytes than the contribution sent"
    if e.weight != 0.0 or not e.reason:
        if e.reason or e.weight != owed_weight:
            return f"weighted it {e.weight!r}, owed {owed_weight!r}"
        return None
    if not needs_others(e.reason) and own_reason is None:
        return f"rejected it for {e.reason[:120]!r}, which it passes"
    return None
