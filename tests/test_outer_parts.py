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
    audit_choice,
    checked_gathered,
    decode_header,
    decode_manifest,
    group_ref_norm,
    own_entry_finding,
)
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
        "round": 3, "digest": "ab", "base_round": 2, "tokens": 10, "ref_norm": 1,
        "addrs": ["/ip4/10.0.0.2/tcp/4001"],
    }  # fmt: skip
    assert checked_gathered(good) == {**good, "ref_norm": 1.0}
    for bad in (
        {**good, "tokens": -1},
        {**good, "tokens": 1.5},
        {**good, "ref_norm": float("inf")},
        {**good, "digest": "x" * 100},
        {**good, "extra": 1},
        {**good, "addrs": "/ip4/10.0.0.2/tcp/4001"},
        {**good, "addrs": ["/ip4/10.0.0.2/tcp/4001"] * 17},
        {**good, "addrs": ["x" * 257]},
        {**good, "addrs": [""]},
        {**good, "addrs": [7]},
        {k: v for k, v in good.items() if k != "round"},
        "not a map",
    ):
        assert checked_gathered(bad) == NO_METADATA
    assert group_ref_norm([{"ref_norm": x} for x in (1.0, 1e9, 2.0, 3.0)]) == 2.0


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
