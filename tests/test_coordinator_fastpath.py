"""The coordinator's hot path runs on the `protocol` codecs themselves, and they keep
their contract: the envelope reader (`open_envelope`) accepts exactly the envelopes the
written-out rules below accept (hostile maps and random bytes), `to_wire` packs the same
bytes as the reference converter it replaced (heartbeat replies, and every message in the
tests' samples), and the body cache is bounded and returns what `decode_body` returns."""

from __future__ import annotations

import math
import time
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.fastpath import BodyCache
from protocol import control as c
from protocol.codec import schema_limits
from protocol.credit import MAX_CREDIT_BYTES
from protocol.errors import ProtocolError
from protocol.framing import HEADER, frame_message
from protocol.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, NodeKey
from protocol.message import Message, message_class, registered_tags
from protocol.signing import (
    ENVELOPE_MAX_MAP,
    ENVELOPE_MAX_STR,
    NONCE_SIZE,
    SignedRequest,
    decode_body,
    open_envelope,
    sign_request,
)

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


def reference_envelope(payload: bytes, max_size: int) -> SignedRequest:
    """The envelope rules written out: a flat msgpack map within the envelope limits,
    tagged "signed" with a version >= 1, a 32-byte key, a finite time >= 0, a 16-byte
    nonce, a body, a 64-byte signature and a bool `any_run` (unknown keys ignored)."""
    if len(payload) > max_size:
        raise ProtocolError("too large")
    try:
        obj = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_str_len=ENVELOPE_MAX_STR,
            max_bin_len=max_size, max_array_len=0, max_map_len=ENVELOPE_MAX_MAP, max_ext_len=0,
        )  # fmt: skip
    except Exception as exc:
        raise ProtocolError("malformed") from exc
    if type(obj) is not dict or obj.get("t") != "signed":
        raise ProtocolError("not a signed request")
    v = obj.get("v")
    if type(v) is not int or v < 1:
        raise ProtocolError("version")
    sizes = {"key": PUBLIC_KEY_SIZE, "nonce": NONCE_SIZE, "body": None, "sig": SIGNATURE_SIZE}
    for name, size in sizes.items():
        if type(obj.get(name)) is not bytes or size not in (None, len(obj[name])):
            raise ProtocolError(name)
    ts = obj.get("ts")
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise ProtocolError("ts")
    any_run = obj.get("any_run", False)
    if type(any_run) is not bool:
        raise ProtocolError("any_run")
    return SignedRequest(
        key=obj["key"], ts=float(ts), nonce=obj["nonce"], body=obj["body"], sig=obj["sig"],
        any_run=any_run,
    )  # fmt: skip


def _same(payload: bytes) -> None:
    try:
        want: SignedRequest | None = reference_envelope(payload, MAX)
    except ProtocolError:
        want = None
    try:
        got: SignedRequest | None = open_envelope(payload, max_size=MAX)
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
    assert open_envelope(payload, max_size=MAX) == req == reference_envelope(payload, MAX)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        open_envelope(payload, max_size=len(payload) - 1)
    extra = msgpack.packb({**req.to_wire(), "later": 1}, use_bin_type=True)
    assert open_envelope(extra, max_size=MAX) == req  # a newer sender's field is ignored


def reference_wire(msg: Message) -> dict[str, Any]:
    """`Message.to_wire` as the generic converter wrote it, value by value."""

    def value(v: Any) -> Any:
        if isinstance(v, Message):
            return {spec.name: value(getattr(v, spec.name)) for spec in v._SPECS}
        if isinstance(v, list | tuple):
            return [value(x) for x in v]
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        return v

    out: dict[str, Any] = {"t": msg.TYPE, "v": msg.VERSION}
    out.update(value(msg))
    return out


def heartbeat_reply_wire(r: c.HeartbeatReply) -> dict[str, Any]:
    """A heartbeat reply's wire map written out (the keys in field order)."""
    refs = [
        [{"lease_id": x.lease_id, "epoch": x.epoch} for x in xs] for xs in (r.renewed, r.fenced)
    ]
    return {
        "t": "heartbeat.reply", "v": 1, "stage": r.stage, "moved": r.moved, "drain": r.drain,
        "paused": r.paused, "renewed": refs[0], "fenced": refs[1], "expires_at": r.expires_at,
        "membership_version": r.membership_version, "data_epoch": r.data_epoch, "freed": r.freed,
        "attested": None if r.attested is None
        else {"round": r.attested.round, "digest": r.attested.digest},
        "credit": r.credit,
    }  # fmt: skip


def _framed(wire: dict[str, Any]) -> bytes:
    payload = msgpack.packb(wire, use_bin_type=True)
    return bytes(HEADER.pack(len(payload)) + payload)


state_refs = st.none() | st.builds(
    c.StateRef,
    round=st.integers(min_value=0, max_value=2**62),
    digest=st.text(alphabet="0123456789abcdef", min_size=1, max_size=64),
)
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
        attested=state_refs,
        credit=st.binary(max_size=MAX_CREDIT_BYTES),
    )
)
def test_heartbeat_reply_frames_are_byte_identical(reply: c.HeartbeatReply) -> None:
    framed = frame_message(reply, max_frame=MAX)
    assert framed == _framed(heartbeat_reply_wire(reply)) == _framed(reference_wire(reply))


lease_infos = st.builds(
    c.LeaseInfo,
    lease_id=st.integers(min_value=1, max_value=2**63 - 1),
    shard_id=st.integers(min_value=0, max_value=2**31),
    epoch=st.integers(min_value=0, max_value=2**31),
    data_epoch=st.integers(min_value=0, max_value=2**31),
    committed=st.integers(min_value=0, max_value=2**40),
    limit=st.integers(min_value=0, max_value=2**40),
    shard_tokens=st.integers(min_value=0, max_value=2**40),
    expires_at=st.floats(min_value=0, max_value=1e12),
    state=st.sampled_from(["active", "complete"]),
)
replies = st.one_of(
    st.builds(c.LeaseGrant, lease=st.none() | lease_infos, reason=st.text(max_size=20)),
    st.builds(c.LeaseReply, lease=lease_infos, shard_done=st.booleans()),
    st.builds(c.OkReply, detail=st.text(max_size=40)),
    st.builds(c.ErrorReply, code=st.sampled_from(["fenced", "conflict"]), detail=st.text()),
    st.builds(
        c.HeartbeatRequest,
        leases=refs,
        throughput=st.none() | st.floats(min_value=0, max_value=1e12),
        dht_addrs=st.none() | st.just(["/ip4/10.0.0.1/tcp/4001"]),
        state=state_refs,
    ),
)


@settings(max_examples=300, deadline=None)
@given(replies)
def test_to_wire_packs_what_the_reference_converter_packs(msg: Message) -> None:
    assert msg.to_wire() == reference_wire(msg)
    assert frame_message(msg, max_frame=MAX) == _framed(reference_wire(msg))


def test_the_frame_limit() -> None:
    big = c.HeartbeatReply(
        stage=0, renewed=[c.LeaseRef(lease_id=i + 1, epoch=0) for i in range(500)]
    )
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        frame_message(big, max_frame=4096)


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


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(
        [
            cls
            for cls in map(message_class, registered_tags())
            if not hasattr(cls, "__post_init__")  # its own checks refuse arbitrary fields
        ]
    ).flatmap(st.builds)
)
def test_every_message_packs_what_the_reference_converter_packs(msg: Message) -> None:
    assert msg.to_wire() == reference_wire(msg)
