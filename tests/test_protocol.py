"""Unit and property tests for the protocol core: codec, messages, framing, tensors, signing."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol
from protocol import (
    EncodedTensor,
    FrameDecoder,
    NodeKey,
    ProtocolError,
    ReplayGuard,
    TensorFrame,
    decode,
    encode,
    frame,
    packb,
    sign_request,
    verify_request,
)
from protocol.codec import UnpackLimits, unpackb
from protocol.control import ErrorReply
from protocol.corpus import Manifest, ShardInfo
from protocol.signing import envelope_limits, open_envelope, request_limits, signed_bytes

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def _samples() -> list[protocol.Message]:
    key = NodeKey(b"\x07" * 32)
    shard = ShardInfo(shard_id=3, start=10, tokens=5, sha256="a" * 64)
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    return [
        ErrorReply(code="fenced", detail="lease 4 epoch 2 < 3"),
        sign_request(key, ErrorReply(code="x"), now=1000.0, run="r"),
        Manifest(name="m", content_hash="b" * 64, total_tokens=5, train=[shard], heldout=[]),
        EncodedTensor(codec="raw", shape=[2, 3], parts=[TensorFrame.from_numpy(arr)]),
    ]


@pytest.mark.parametrize("msg", _samples(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: protocol.Message) -> None:
    if msg.TYPE:
        assert decode(encode(msg)) == msg
    else:  # a record travels inside messages, without a type tag
        assert type(msg).from_wire(protocol.unpackb(packb(msg.to_wire()))) == msg


def test_unknown_fields_are_ignored_and_missing_ones_refused() -> None:
    wire = ErrorReply(code="c").to_wire() | {"future_field": [1, 2]}
    assert decode(packb(wire)) == ErrorReply(code="c")
    del wire["code"]
    with pytest.raises(ProtocolError, match="missing field 'code'"):
        decode(packb(wire))


@pytest.mark.parametrize(
    "patch",
    [{"code": 5}, {"code": "x" * 65}, {"v": 0}, {"v": True}, {"t": "nope"}, {"t": 3}],
)
def test_bad_field_values_raise_protocol_error(patch: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode(packb(ErrorReply(code="c").to_wire() | patch))


def test_trailing_bytes_and_non_map_refused() -> None:
    with pytest.raises(ProtocolError, match="trailing"):
        decode(encode(ErrorReply(code="c")) + b"\x00")
    with pytest.raises(ProtocolError, match="must be a map"):
        decode(packb([1, 2]))


def test_oversized_payload_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        decode(b"\x00" * 101, max_size=100)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@FUZZ
@given(st.sampled_from(_samples()), st.data())
def test_mutated_messages_only_raise_protocol_error(
    msg: protocol.Message, data: st.DataObject
) -> None:
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[pos:]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decode(bytes(raw))
    except ProtocolError:
        pass


@FUZZ
@given(
    st.sampled_from(protocol.registered_tags()),
    st.dictionaries(st.text(max_size=10), msgpack_values),
)
def test_random_fields_for_every_message_type_only_raise_protocol_error(
    tag: str, fields: dict[str, object]
) -> None:
    try:
        decode(packb({**fields, "t": tag, "v": 1}))
    except ProtocolError:
        pass


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=8), st.integers(1, 50))
def test_frame_decoder_is_independent_of_chunking(payloads: list[bytes], chunk: int) -> None:
    stream = b"".join(frame(p) for p in payloads)
    dec = FrameDecoder()
    got: list[bytes] = []
    for i in range(0, len(stream), chunk):
        got.extend(dec.feed(stream[i : i + chunk]))
    assert got == payloads
    assert dec.buffered == 0


def test_frame_claiming_gigabytes_refused_at_the_header() -> None:
    dec = FrameDecoder(max_frame=1 << 20)
    with pytest.raises(ProtocolError, match="above the limit"):
        dec.feed(struct.pack(">I", 2 << 30) + b"xx")
    assert dec.buffered == 0
    with pytest.raises(ProtocolError, match="already refused"):
        dec.feed(b"more")


@FUZZ
@given(st.binary(max_size=500))
def test_frame_decoder_messages_only_raise_protocol_error(data: bytes) -> None:
    try:
        FrameDecoder(max_frame=256).feed_messages(data)
    except ProtocolError:
        pass


def test_tensor_frame_validation() -> None:
    ok = TensorFrame.from_numpy(np.ones((2, 3), np.float32))
    assert ok.to_numpy(expect_dtype="float32", expect_shape=(None, 3)).shape == (2, 3)
    with pytest.raises(ProtocolError, match="expected"):
        ok.to_numpy(expect_shape=(2, 4))
    with pytest.raises(ProtocolError, match="dtype"):
        ok.to_numpy(expect_dtype="float16")
    with pytest.raises(ProtocolError, match="does not match"):
        TensorFrame(dtype="float32", shape=[2, 3], data=b"\0" * 23).to_numpy()
    nan = TensorFrame.from_numpy(np.array([1.0, np.nan], np.float32))
    with pytest.raises(ProtocolError, match="NaN"):
        nan.to_numpy()
    inf = TensorFrame.from_numpy(np.array([np.inf], np.float16))
    with pytest.raises(ProtocolError, match="NaN or Inf"):
        inf.to_numpy()
    with pytest.raises(ProtocolError, match="bad shape"):
        TensorFrame(dtype="int8", shape=[-1], data=b"").to_numpy()


@FUZZ
@given(
    st.sampled_from(["float32", "float16", "int8", "int64"]),
    st.lists(st.integers(0, 2**40), max_size=4),
    st.binary(max_size=64),
)
def test_tensor_frame_decoder_only_raises_protocol_error(
    dtype: str, shape: list[int], data: bytes
) -> None:
    try:
        TensorFrame(dtype=dtype, shape=shape, data=data).to_numpy()
    except ProtocolError:
        pass


def test_signed_requests_verify_once_and_refuse_tampering_replay_and_skew() -> None:
    key = NodeKey.generate()
    body = ErrorReply(code="hello")
    guard = ReplayGuard(skew_s=30)
    req = decode(encode(sign_request(key, body, now=1000.0, run="r")))
    assert isinstance(req, protocol.SignedRequest)
    assert verify_request(req, now=1001.0, guard=guard, run="r") == body
    with pytest.raises(ProtocolError, match="replayed"):
        verify_request(req, now=1002.0, guard=guard, run="r")
    fresh = sign_request(key, body, now=1000.0, run="r")
    tampered = protocol.SignedRequest(
        key=fresh.key,
        ts=fresh.ts,
        nonce=fresh.nonce,
        body=encode(ErrorReply(code="evil")),
        sig=fresh.sig,
    )
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_request(tampered, now=1000.0, guard=guard, run="r")
    other = NodeKey.generate()
    stolen = protocol.SignedRequest(
        key=other.public_key, ts=fresh.ts, nonce=fresh.nonce, body=fresh.body, sig=fresh.sig
    )
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_request(stolen, now=1000.0, guard=guard, run="r")
    with pytest.raises(ProtocolError, match="outside"):
        verify_request(sign_request(key, body, now=0.0, run="r"), now=1000.0, guard=guard, run="r")


def test_a_signature_is_bound_to_its_run_and_unbound_only_for_named_types() -> None:
    key, body = NodeKey.generate(), ErrorReply(code="hello")
    guard = ReplayGuard(skew_s=30)
    for_a = sign_request(key, body, now=1000.0, run="run-a")
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_request(for_a, now=1000.0, guard=guard, run="run-b")
    # the flag is not signed over on its own, but flipping it changes the signed bytes
    flipped = dataclasses.replace(for_a, any_run=True)
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_request(flipped, now=1000.0, guard=guard, run="run-a")
    unbound = sign_request(key, body, now=1000.0, run=None)
    assert unbound.any_run
    with pytest.raises(ProtocolError, match="must be signed for run"):
        verify_request(unbound, now=1000.0, guard=guard, run="run-a")
    again = sign_request(key, body, now=1000.0, run=None)
    assert (
        verify_request(again, now=1000.0, guard=guard, run="run-a", any_run_types=(ErrorReply,))
        == body
    )
    assert signed_bytes(key.public_key, 1.0, b"n" * 16, b"", run="") != signed_bytes(
        key.public_key, 1.0, b"n" * 16, b"", run=None
    )


def test_a_bound_signature_names_one_certificate() -> None:
    key, body = NodeKey.generate(), ErrorReply(code="hello")
    guard = ReplayGuard(skew_s=30)
    cert, other = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    bound = sign_request(key, body, now=1000.0, run="r", cert=cert)
    assert bound.bound and not bound.any_run
    assert decode(encode(bound)) == bound
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_request(bound, now=1000.0, guard=guard, run="r", cert=other)
    with pytest.raises(ProtocolError, match="certificate"):
        verify_request(bound, now=1000.0, guard=guard, run="r")  # a server without one
    # flipping the flag either way changes the signed bytes
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_request(
            dataclasses.replace(bound, bound=False), now=1000.0, guard=guard, run="r", cert=cert
        )
    plain = sign_request(key, body, now=1000.0, run="r")
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_request(
            dataclasses.replace(plain, bound=True), now=1000.0, guard=guard, run="r", cert=cert
        )
    assert verify_request(bound, now=1000.0, guard=guard, run="r", cert=cert) == body
    with pytest.raises(ValueError, match="no run"):
        sign_request(key, body, now=1000.0, run=None, cert=cert)


def test_replay_guard_refuses_what_an_earlier_process_or_an_eviction_may_have_seen() -> None:
    guard = ReplayGuard(skew_s=60, not_before=1000.0)
    with pytest.raises(ProtocolError, match="before this coordinator started"):
        guard.check(b"k", b"a" * 16, ts=999.0, now=1001.0)
    guard.check(b"k", b"a" * 16, ts=1000.5, now=1001.0)
    # a full table forgets its oldest live nonce early; everything that old is refused
    small = ReplayGuard(skew_s=60, max_entries=3)
    for i in range(3):
        small.check(b"k", bytes([i]) * 16, ts=100.0 + i, now=103.0)
    small.check(b"k", b"\x09" * 16, ts=103.0, now=103.0)  # evicts the nonce of ts 100
    assert small.floor == 100.0
    with pytest.raises(ProtocolError, match="older than the replay window"):
        small.check(b"k", b"\x00" * 16, ts=100.0, now=104.0)
    small.check(b"k", b"\x0a" * 16, ts=104.0, now=104.0)


def test_replay_guard_memory_is_bounded() -> None:
    guard = ReplayGuard(skew_s=10, max_entries=100)
    for i in range(1000):
        guard.check(b"k", i.to_bytes(16, "big"), ts=500.0 + i / 1000, now=501.0)
    assert len(guard._seen) <= 100


def test_peer_id_matches_libp2p_format() -> None:
    key = NodeKey(b"\x01" * 32)
    # Computed by libp2p 0.8.1: ID.from_pubkey(create_new_key_pair(b"\x01"*32).public_key)
    assert key.peer_id == "12D3KooWK99VoVxNE7XzyBwXEzW7xhK7Gpv85r9F3V3fyKSUKPH5"
    assert "seed" not in repr(key) and key.seed.hex() not in repr(key)


def test_unpack_limits_bound_every_object_while_reading() -> None:
    lim = UnpackLimits(max_str_len=4, max_bin_len=4, max_array_len=2, max_map_len=2)
    assert unpackb(packb({"a": [1, 2], "b": b"xy"}), limits=lim) == {"a": [1, 2], "b": b"xy"}
    for too_big in ([1, 2, 3], "abcde", b"abcde", {"a": 1, "b": 2, "c": 3}, [[[]], [], []]):
        with pytest.raises(ProtocolError, match="exceeds max_"):
            unpackb(packb(too_big), limits=lim)
    with pytest.raises(ProtocolError):  # extension types are refused while reading
        unpackb(b"\xd4\x01\x00")
    assert envelope_limits(1 << 20).max_array_len == 0
    assert request_limits(1 << 20).max_array_len == 4096
    with pytest.raises(ProtocolError, match="max_array_len"):
        open_envelope(packb({"t": "signed", "v": 1, "junk": [[]]}))


@given(data=st.binary(max_size=64))
def test_base58_decodes_what_it_encodes(data: bytes) -> None:
    from protocol.identity import b58decode, b58encode

    assert b58decode(b58encode(data)) == data


@given(text=st.text(max_size=64))
def test_base58_decoding_raises_only_protocol_errors(text: str) -> None:
    from protocol.identity import b58decode

    try:
        b58decode(text)
    except ProtocolError:
        pass
