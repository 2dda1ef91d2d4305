"""The coordinator's hot-path codecs agree with the generic protocol codecs: the envelope
reader accepts exactly what `open_envelope` accepts (hostile maps and random bytes), the
heartbeat reply frames are byte-identical, and the body cache is bounded and returns
what `decode_body` returns."""

from __future__ import annotations

import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.fastpath import BodyCache, frame_reply, open_signed
from protocol import control as c
from protocol.codec import schema_limits
from protocol.errors import ProtocolError
from protocol.framing import frame_message
from protocol.identity import NodeKey
from protocol.signing import SignedRequest, decode_body, open_envelope, sign_request

MAX = 1 << 20
KEY = NodeKey.generate()

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=70),
    st.sampled_from([b"\0" * 16, b"\1" * 32, b"\2" * 64]),
    st.text(max_size=70),
    st.sampled_from(["signed", "heartbeat", "join"]),
    st.lists(st.integers(min_value=0, max_value=9), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(min_value=0, max_value=9), max_size=2),
)
field_names = st.sampled_from(["t", "v", "key", "ts", "nonce", "body", "sig", "any_run", "x"])


def _same(payload: bytes) -> None:
    try:
        want: SignedRequest | None = open_envelope(payload, max_size=MAX)
    except ProtocolError:
        want = None
    try:
        got: SignedRequest | None = open_signed(payload, MAX)
    except ProtocolError:
        got = None
    assert got == want


def _valid_wire() -> dict[str, object]:
    req = sign_request(KEY, c.HeartbeatRequest(), now=time.time(), run="r")
    wire = req.to_wire()
    assert isinstance(wire, dict)
    return wire


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_read_alike(data: bytes) -> None:
    _same(data)


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(field_names, values, max_size=9), st.booleans())
def test_hostile_envelopes_are_read_alike(changes: dict[str, object], base: bool) -> None:
    wire = _valid_wire() if base else {}
    wire.update(changes)
    _same(msgpack.packb(wire, use_bin_type=True))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["t", "v", "key", "ts", "nonce", "body", "sig", "any_run"]))
def test_a_missing_field_is_refused_alike(name: str) -> None:
    wire = _valid_wire()
    del wire[name]
    _same(msgpack.packb(wire, use_bin_type=True))


def test_a_valid_envelope_reads_the_same_request() -> None:
    req = sign_request(KEY, c.HeartbeatRequest(), now=time.time(), run="r")
    payload = msgpack.packb(req.to_wire(), use_bin_type=True)
    assert open_signed(payload, MAX) == req == open_envelope(payload, max_size=MAX)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        open_signed(payload, len(payload) - 1)
    extra = msgpack.packb({**req.to_wire(), "later": 1}, use_bin_type=True)
    assert open_signed(extra, MAX) == req  # a newer sender's field is ignored, as before


refs = st.lists(
    st.builds(
        c.LeaseRef,
        lease_id=st.integers(min_value=1, max_value=2**63 - 1),
        epoch=st.integers(min_value=0, max_value=2**63 - 1),
    ),
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    st.builds(
        c.HeartbeatReply,
        stage=st.integers(min_value=0, max_value=64),
        moved=st.booleans(),
        drain=st.booleans(),
        paused=st.booleans(),
        renewed=refs,
        fenced=refs,
        expires_at=st.floats(min_value=0, max_value=1e12),
        membership_version=st.integers(min_value=0, max_value=2**63 - 1),
        data_epoch=st.integers(min_value=0, max_value=2**31),
        freed=st.integers(min_value=0, max_value=2**31),
    )
)
def test_heartbeat_reply_frames_are_byte_identical(reply: c.HeartbeatReply) -> None:
    assert frame_reply(reply, MAX) == frame_message(reply, max_frame=MAX)


def test_other_replies_and_the_frame_limit() -> None:
    ok = c.OkReply(detail="x")
    assert frame_reply(ok, MAX) == frame_message(ok, max_frame=MAX)
    big = c.HeartbeatReply(
        stage=0, renewed=[c.LeaseRef(lease_id=i + 1, epoch=0) for i in range(500)]
    )
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        frame_reply(big, 4096)


def test_body_cache_is_bounded_and_decodes_like_decode_body() -> None:
    limits = schema_limits(c.HeartbeatRequest, c.JoinRequest, max_size=MAX)
    cache = BodyCache(limits=limits, max_size=MAX, max_entries=3)
    reqs = [
        sign_request(KEY, c.HeartbeatRequest(throughput=float(i)), now=time.time(), run="r")
        for i in range(5)
    ]
    for r in reqs + reqs[-2:]:
        assert cache.decode(r) == decode_body(r, max_size=MAX, limits=limits)
    assert len(cache._cache) == 3 and cache.hits == 2 and cache.misses == 5
    same = sign_request(KEY, c.HeartbeatRequest(throughput=4.0), now=time.time(), run="r")
    assert cache.decode(same) is cache.decode(reqs[4])  # the one decoded instance
    bad = sign_request(KEY, c.HeartbeatRequest(), now=time.time(), run="r")
    bad = SignedRequest(key=bad.key, ts=bad.ts, nonce=bad.nonce, body=b"\xc1", sig=bad.sig)
    for _ in range(2):  # refused every time, never cached
        with pytest.raises(ProtocolError):
            cache.decode(bad)
    assert b"\xc1" not in cache._cache
