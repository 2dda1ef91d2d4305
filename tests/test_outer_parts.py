"""The pure pieces of a reduce-scatter round (node.outer.parts): push headers and
manifests from other members are decoded or refused, gathered metadata is checked, the
audit draw, and a member's check of how its reducer reported its contribution."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.outer.parts import (
    NO_METADATA,
    Entry,
    Header,
    Undecided,
    audit_choice,
    canonical_state,
    carried_view,
    checked_gathered,
    decode_header,
    decode_manifest,
    group_canonical,
    group_claims,
    group_ref_norm,
    group_target,
    own_entry_finding,
)
from node.outer.settings import MAX_COUNT
from protocol.codec import packb
from protocol.errors import ProtocolError

ENTRY = Entry(peer="QmA", weight=3.0, reason="", digest="ab" * 16)


def test_headers_round_trip() -> None:
    for h in (
        Header(kind="contrib", part=2),
        Header(kind="audit", part=0),
        Header(kind="reduced", part=1, manifest=[ENTRY, Entry(peer="QmB", weight=0.0,
               reason="no tokens", digest="")]),
    ):  # fmt: skip
        assert decode_header(h.encode(), parts=3) == h


@pytest.mark.parametrize(
    "obj",
    [
        {"kind": "contrib", "part": 3},  # part out of range
        {"kind": "contrib", "part": -1},
        {"kind": "bogus", "part": 0},
        {"kind": "reduced", "part": 0},  # a reduced part without its manifest
        {"kind": "contrib", "part": 0, "manifest": []},  # a manifest where none belongs
        {"kind": "contrib", "part": 0, "extra": 1},
        {"kind": "reduced", "part": 0, "manifest": [["QmA", -1.0, "", ""]]},
        {"kind": "reduced", "part": 0, "manifest": [["QmA", float("nan"), "", ""]]},
        {"kind": "reduced", "part": 0, "manifest": [["QmA", 1.0, "", ""]] * 2},  # twice
        {"kind": "reduced", "part": 0, "manifest": [["", 1.0, "", ""]]},
        {"kind": "reduced", "part": 0, "manifest": [["QmA", 1.0, "x" * 600, ""]]},
        {"kind": "reduced", "part": 0, "manifest": [["QmA", 1.0, ""]]},
        [1, 2],
    ],
)
def test_malformed_headers_are_refused(obj: object) -> None:
    with pytest.raises(ProtocolError):
        decode_header(packb(obj), parts=3)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_protocol_error(raw: bytes) -> None:
    try:
        h = decode_header(raw, parts=4)
    except ProtocolError:
        return
    assert 0 <= h.part < 4 and (h.manifest is not None) == (h.kind == "reduced")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(
            st.one_of(st.text(max_size=8), st.floats(), st.integers(), st.none()),
            min_size=0,
            max_size=5,
        ),
        max_size=6,
    )
)
def test_arbitrary_manifests_decode_to_valid_entries_or_raise(obj: list[list[object]]) -> None:
    try:
        entries = decode_manifest(obj)
    except ProtocolError:
        return
    assert len({e.peer for e in entries}) == len(entries)
    assert all(e.weight >= 0.0 and e.peer for e in entries)


def test_gathered_metadata_is_checked() -> None:
    good = {
        "round": 3, "digest": "ab", "base_round": 2, "tokens": 10, "target": 40, "ref_norm": 1,
        "addrs": ["/ip4/10.0.0.2/tcp/4001"], "carry_round": 1, "carry_digest": "cd",
        "carry_tokens": 20, "attested_round": 2, "attested_digest": "ef", "credit": b"",
    }  # fmt: skip
    assert checked_gathered(good) == {**good, "ref_norm": 1.0}
    assert checked_gathered({**good, "attested_round": -1, "attested_digest": ""})["round"] == 3
    for bad in (
        {**good, "tokens": -1},
        {**good, "tokens": 1.5},
        {**good, "target": -1},
        {**good, "target": 2**70},
        {**good, "ref_norm": float("inf")},
        {**good, "digest": "x" * 100},
        {**good, "extra": 1},
        {**good, "addrs": "/ip4/10.0.0.2/tcp/4001"},
        {**good, "addrs": ["/ip4/10.0.0.2/tcp/4001"] * 17},
        {**good, "addrs": ["x" * 257]},
        {**good, "addrs": [""]},
        {**good, "addrs": [7]},
        {**good, "carry_round": -2},
        {**good, "carry_tokens": -1},
        {**good, "carry_tokens": 2**70},
        {**good, "carry_digest": None},
        {**good, "carry_digest": "x" * 100},
        {**good, "attested_round": -2},
        {**good, "attested_round": "2"},
        {**good, "attested_digest": 7},
        {**good, "attested_digest": "x" * 100},
        {**good, "credit": "not bytes"},
        {**good, "credit": b"x" * 513},
        {k: v for k, v in good.items() if k != "round"},
        "not a map",
    ):
        assert checked_gathered(bad) == NO_METADATA
    assert group_ref_norm([{"ref_norm": x} for x in (1.0, 1e9, 2.0, 3.0)]) == 2.0


def test_a_group_steps_with_one_target_whatever_each_member_sees() -> None:
    # two replicas that count the stage's replicas differently around a join agree
    assert group_target([{"target": 3000}, {"target": 2000}], own=3000) == 2000
    assert group_target([{"target": 2000}, {"target": 3000}], own=2000) == 2000
    # a minority cannot raise it (which would shrink the step); zero claims do not count
    assert group_target([{"target": 2000}, {"target": 2000}, {"target": 10**15}], own=1) == 2000
    assert group_target([{"target": 0}, {"target": 0}], own=777) == 777


def test_the_audit_draw_never_audits_the_auditors_own_part() -> None:
    assert audit_choice(b"g", 2, 2) is None and audit_choice(b"g", 3, 1) is None
    seen = set()
    for i in range(200):
        got = audit_choice(i.to_bytes(4, "little"), 5, 5)
        assert got is not None
        auditor, part = got
        assert 0 <= auditor < 5 and 0 <= part < 5 and part != auditor
        seen.add(got)
    assert len(seen) == 20  # every (auditor, other part) pair gets drawn


def test_a_member_catches_a_reducer_that_misreports_its_contribution() -> None:
    dg = ENTRY.digest
    ok = [ENTRY]
    assert own_entry_finding(ok, "QmA", dg, 3.0, None) is None
    assert "left out" in str(own_entry_finding([], "QmA", dg, 3.0, None))
    assert "other bytes" in str(own_entry_finding(ok, "QmA", "cd" * 16, 3.0, None))
    assert "weighted" in str(own_entry_finding(ok, "QmA", dg, 6.0, None))  # under-weighted
    rejected = [Entry(peer="QmA", weight=0.0, reason="non-finite values", digest=dg)]
    assert "which it passes" in str(own_entry_finding(rejected, "QmA", dg, 3.0, None))
    assert own_entry_finding(rejected, "QmA", dg, 3.0, "non-finite values") is None
    median = [Entry(peer="QmA", weight=0.0, reason="norm 9 above 20 x median 0.1", digest=dg)]
    assert own_entry_finding(median, "QmA", dg, 3.0, None) is None  # the auditor's to check
    for others in ("pair: cosine 0.001 with the reducer's below 0.01", "direction: agrees"):
        needs = [Entry(peer="QmA", weight=0.0, reason=others, digest=dg)]
        assert own_entry_finding(needs, "QmA", dg, 3.0, None) is None


def claim(rnd: int, tokens: int) -> dict[str, int]:
    return {"round": rnd, "base_round": rnd, "tokens": tokens}


def test_group_claims_by_example() -> None:
    assert group_claims([], 4.0) == (-1, [], [])
    # one liar in three: its round does not make the others stale, its tokens are capped
    head, stale, tokens = group_claims([claim(5, 1000), claim(2**62, 10**15), claim(5, 900)], 4.0)
    assert head == 5 and stale == [0, 0, 0] and tokens == [1000, 4 * 1000, 900]
    # two honest members, one behind: the newer round is the head, as before
    head, stale, tokens = group_claims([claim(3, 100), claim(5, 100)], 4.0)
    assert head == 5 and stale == [2, 0] and tokens == [100, 100]
    # a replica out of data (0 tokens) does not pull the cap to 0
    assert group_claims([claim(1, 0), claim(1, 700)], 4.0)[2] == [0, 700]


@settings(max_examples=200, deadline=None)
@given(
    honest=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 10**6)), min_size=1, max_size=8),
    liars=st.lists(st.tuples(st.integers(0, 2**62), st.integers(0, 2**62)), min_size=0, max_size=7),
    ratio=st.floats(1.0, 16.0),
)
def test_a_minority_of_claims_cannot_steer_the_head_or_the_weights(
    honest: list[tuple[int, int]], liars: list[tuple[int, int]], ratio: float
) -> None:
    liars = liars[: (len(honest) - 1)]  # strictly fewer liars than honest members
    gathered = [claim(r, t) for r, t in honest] + [claim(r, t) for r, t in liars]
    head, stale, tokens = group_claims(gathered, ratio)
    assert head <= max(r for r, _ in honest)  # no liar makes the honest ones staler
    top = max(t for _, t in honest)
    assert all(t <= ratio * top for t in tokens)  # no claim counts more than ratio x honest
    assert all(tokens[i] == min(t, tokens[i]) for i, (_, t) in enumerate(honest))
    assert all(s >= 0 for s in stale)


def test_the_canonical_state_is_the_most_held_then_the_attested_then_the_newest() -> None:
    a, b, c = (0, "aa"), (3, "bb"), (1, "cc")
    assert canonical_state({"x": a, "y": b, "z": b}, attested=a) == (b, ["y", "z"])
    assert canonical_state({"x": a, "y": b}, attested=a) == (a, ["x"])  # a tie: attested
    assert canonical_state({"x": a, "y": b, "z": c}) == (b, ["y"])  # then the newest
    assert canonical_state({"x": (2, "ff"), "y": (2, "ee")}) == ((2, "ee"), ["y"])


def test_a_group_breaks_a_tie_with_the_attested_state_most_members_name() -> None:
    a, b = (29, "aa"), (31, "bb")
    # two replicas whose views of the attested state differ for a heartbeat after a round:
    # each stepping its own view's state would split the stage; neither steps
    with pytest.raises(Undecided):
        group_canonical({"x": a, "y": b}, [a, b])
    assert group_canonical({"x": a, "y": b}, [b, b]) == (b, ["y"])
    assert group_canonical({"x": a, "y": b}, [None, None]) == (b, ["y"])  # none: newest
    # a minority naming another state does not move it
    assert group_canonical({"x": a, "y": b, "z": (0, "cc")}, [a, a, b]) == (a, ["x"])
    # no tie: the most held state, whatever is named
    assert group_canonical({"x": a, "y": b, "z": b}, [a, a, a]) == (b, ["y", "z"])


@settings(max_examples=300, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 3), st.sampled_from("ab")), min_size=1, max_size=7),
    names=st.lists(
        st.one_of(st.none(), st.tuples(st.integers(0, 3), st.sampled_from("ab"))),
        min_size=7, max_size=7,
    ),
)  # fmt: skip
def test_every_member_derives_one_canonical_state_from_the_gathered_metadata(
    held: list[tuple[int, str]], names: list[tuple[int, str] | None]
) -> None:
    """What `group_canonical` returns, or whether it refuses, depends on the gathered
    metadata only (every member sees the same), not on the order it is listed in, and
    what it returns is a held state with its holders."""
    named = names[: len(held)]
    members = {i: s for i, s in enumerate(held)}
    try:
        head, holders = group_canonical(members, named)
    except Undecided:
        with pytest.raises(Undecided):
            group_canonical(dict(reversed(list(members.items()))), list(reversed(named)))
        return
    rev = group_canonical(dict(reversed(list(members.items()))), list(reversed(named)))
    assert rev[0] == head and sorted(rev[1]) == sorted(holders)
    assert head in held and holders and all(held[i] == head for i in holders)


def gathered_entry(held: tuple[int, str], tokens: int, carry: tuple[int, str, int]) -> dict:
    return {
        **NO_METADATA, "round": held[0], "digest": held[1], "base_round": held[0],
        "tokens": tokens, "carry_round": carry[0], "carry_digest": carry[1],
        "carry_tokens": carry[2],
    }  # fmt: skip


def test_lone_steps_are_carried_only_into_a_group_that_steps_the_state_they_left() -> None:
    base, lone = (0, "aa"), (3, "bb")
    gathered = {
        "slow": gathered_entry(base, 100, (-1, "", 0)),
        "lone": gathered_entry(lone, 100, (*base, 300)),
    }
    view, carried = carried_view(gathered, base)
    assert carried == {"lone"} and view["slow"] is gathered["slow"]
    assert (view["lone"]["round"], view["lone"]["base_round"], view["lone"]["tokens"]) == (
        0,
        0,
        400,
    )
    assert view["lone"]["digest"] == "bb"  # what it holds is unchanged
    head, stale, tokens = group_claims([view["slow"], view["lone"]], 4.0)
    assert head == 0 and stale == [0, 0] and tokens == [100, 400]  # neither counts as stale
    # a group that steps the lone state itself, or another state, carries nothing
    assert carried_view(gathered, lone)[1] == set()
    assert carried_view(gathered, (0, "zz"))[1] == set()
    # a declared base without tokens (nothing stepped alone) carries nothing
    idle = {"m": gathered_entry(lone, 100, (*base, 0))}
    assert carried_view(idle, base)[1] == set()


@settings(max_examples=200, deadline=None)
@given(
    members=st.lists(
        st.tuples(
            st.integers(-1, 4), st.sampled_from(["a", "b", ""]), st.integers(0, 10**6),
            st.integers(-1, 4), st.sampled_from(["a", "b", ""]), st.integers(0, 2**62),
        ),
        min_size=1, max_size=8,
    ),
    attested=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.sampled_from(["a", "b"]))),
)  # fmt: skip
def test_carrying_never_raises_a_claim_past_the_cap_or_moves_a_holder(
    members: list[tuple[int, str, int, int, str, int]], attested: tuple[int, str] | None
) -> None:
    gathered = {
        i: checked_gathered(gathered_entry((r, d), t, (cr, cd, ct)))
        for i, (r, d, t, cr, cd, ct) in enumerate(members)
    }
    head, holders = canonical_state(
        {i: (g["round"], g["digest"]) for i, g in gathered.items()}, attested
    )
    view, carried = carried_view(gathered, head)
    assert not carried & set(holders)  # a holder of the stepped state carries nothing
    for i, g in view.items():
        assert 0 <= g["tokens"] <= MAX_COUNT
        if i in carried:
            assert (g["round"], g["base_round"]) == (head[0], head[0])
        else:
            assert g == gathered[i]
