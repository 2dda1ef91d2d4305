"""msgpack limits of data-plane frames: derived from each message schema, applied while
the frame is read (no libp2p: an in-memory stream stands in for it)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.p2p.wire import read_message
from protocol.codec import decode, encode, packb, schema_limits, unpackb
from protocol.dataplane import ECHO_PROTOCOL, Echo, Refused, reply_limits, request_limits
from protocol.errors import ProtocolError
from protocol.framing import HEADER
from protocol.pipeline import FORWARD_PROTOCOL, MAX_ROUTE, Backward, Forward
from protocol.state import STATE_PROTOCOL, StateChunk, StateRequest
from protocol.tensors import MAX_DIMS, EncodedTensor, TensorFrame

FRAME = 64 * 1024 * 1024  # bytes, the default frame limit
PROTOCOLS = (FORWARD_PROTOCOL, STATE_PROTOCOL, ECHO_PROTOCOL, "/agora/unknown/1")


def _largest_forward() -> Forward:
    """A forward with every list at its bound: the most containers an honest one has."""
    part = TensorFrame(dtype="float32", shape=[1] * MAX_DIMS, data=bytes(4))
    hidden = EncodedTensor(codec="raw", shape=[1] * MAX_DIMS, parts=[part] * 8)
    tokens = TensorFrame.from_numpy(np.zeros((8, 65), np.uint8))
    route = ["é" * 128] * MAX_ROUTE  # 2 bytes a character in UTF-8
    return Forward(mb_id="é" * 128, tokens=tokens, hidden=hidden, route=route, deadline=1.0)


def _honest_frames() -> list[tuple[str, bool, bytes]]:
    """(protocol, is a reply, encoded message) for the largest honest message of each kind."""
    fwd = _largest_forward()
    chunk = StateChunk(
        run_id="r" * 128, stage=3, round=7, version=2, numel=10, offset=2,
        data=TensorFrame.from_numpy(np.ones(8, np.float32)),
    )  # fmt: skip
    return [
        (FORWARD_PROTOCOL, False, encode(fwd)),
        (
            FORWARD_PROTOCOL,
            True,
            encode(Backward(mb_id=fwd.mb_id, grad=fwd.hidden, loss=1.0, tokens=3)),
        ),
        (FORWARD_PROTOCOL, True, encode(Refused(reason="internal", detail="d" * 256))),
        (STATE_PROTOCOL, False, encode(StateRequest(stage=1, offset=0, count=4))),
        (STATE_PROTOCOL, True, encode(chunk)),
        (ECHO_PROTOCOL, False, encode(Echo(seq=1, payload=b"x" * 1000, reply_size=5))),
        (ECHO_PROTOCOL, True, encode(Echo(seq=1, payload=b"x" * 1000))),
    ]


def _limits(protocol: str, reply: bool):  # type: ignore[no-untyped-def]
    return (reply_limits if reply else request_limits)(protocol, FRAME)


def test_limits_are_derived_from_each_schema() -> None:
    fwd = request_limits(FORWARD_PROTOCOL, FRAME)
    assert fwd.max_array_len == MAX_ROUTE  # the route is the longest list
    assert fwd.max_str_len == 4 * 128  # mb_id and peer ids: 128 characters, 4 bytes each
    assert fwd.max_bin_len == FRAME
    # Forward, tokens and its shape, hidden with its shape and 8 parts of 2: 23, + 8 spare
    assert fwd.max_containers == 23 + 8
    state = request_limits(STATE_PROTOCOL, FRAME)
    assert state.max_array_len == 0 and state.max_containers == 1 + 8
    assert schema_limits(Refused, max_size=10).max_str_len == 4 * 256


@pytest.mark.parametrize("case", range(len(_honest_frames())))
def test_the_largest_honest_message_of_each_kind_fits_its_limits(case: int) -> None:
    protocol, reply, data = _honest_frames()[case]
    msg = decode(data, max_size=FRAME, limits=_limits(protocol, reply))
    assert encode(msg) == data


def test_container_budget_counts_the_whole_object() -> None:
    lim = schema_limits(Echo, max_size=1024)
    nested = packb([[[]] * 4] * 4)  # 21 arrays, each short
    with pytest.raises(ProtocolError, match="arrays and maps"):
        unpackb(nested, limits=lim.__class__(10_000, 10, 100, 100, max_containers=20))
    assert unpackb(nested, limits=lim.__class__(10, 10, 100, 100, max_containers=21))


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("reply", [False, True])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_error(protocol: str, reply: bool, data: bytes) -> None:
    try:
        decode(data, max_size=FRAME, limits=_limits(protocol, reply))
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.integers(0, len(_honest_frames()) - 1),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
    cut=st.integers(0, 10**6),
)
def test_mutated_honest_frames_raise_only_protocol_error(
    case: int, flips: list[tuple[int, int]], cut: int
) -> None:
    protocol, reply, data = _honest_frames()[case]
    buf = bytearray(data)
    for pos, byte in flips:
        buf[pos % len(buf)] = byte
    if cut % 3 == 0:  # a third of the cases also lose a tail
        del buf[len(buf) - cut % len(buf) :]
    try:
        msg = decode(bytes(buf), max_size=FRAME, limits=_limits(protocol, reply))
    except ProtocolError:
        return
    for frame in _tensor_frames(msg):  # what the receiver does next: view the tensors
        try:
            frame.to_numpy()
        except ProtocolError:
            pass


def _tensor_frames(msg: object) -> list[TensorFrame]:
    if isinstance(msg, Forward):
        return [msg.tokens, *msg.hidden.parts]
    if isinstance(msg, Backward):
        return list(msg.grad.parts)
    if isinstance(msg, StateChunk):
        return [msg.data]
    return []


class _Stream:
    """A byte stream over one buffer, read in chunks like a libp2p stream."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        n = len(self.data) if n is None else min(n, 65536)
        out, self.data = bytes(self.data[:n]), self.data[n:]
        return out

    async def write(self, data: bytes) -> None:
        raise AssertionError("read only")


def test_a_frame_of_nested_msgpack_is_refused_while_it_is_read() -> None:
    # 8 MiB of one-byte empty arrays, 64 to an array (the route's bound) and nested so
    # that every array passes the per-object bounds: Python lists of about 530 MB
    # without a bound on the whole object's arrays and maps.
    leaf = b"\xdc" + (64).to_bytes(2, "big") + b"\x90" * 64  # array16 of 64 empty arrays
    n = (8 * 1024 * 1024) // len(leaf)
    payload = b"\xdd" + n.to_bytes(4, "big") + leaf * n  # array32 of n of them
    stream = _Stream(HEADER.pack(len(payload)) + payload)

    async def read() -> None:
        await read_message(stream, max_frame=FRAME, limits=request_limits(FORWARD_PROTOCOL, FRAME))

    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="array"):
            trio.run(read)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the frame itself (8 MiB, read once) and next to nothing for its objects
    assert peak < 12 * 1024 * 1024, peak


def test_the_same_nested_frame_under_per_object_bounds_only_is_expensive() -> None:
    """The test above would pass without `max_containers` if the frame were cheap anyway."""
    leaf = b"\xdc" + (64).to_bytes(2, "big") + b"\x90" * 64
    n = 2000  # a small frame: 134 KB
    payload = b"\xdd" + n.to_bytes(4, "big") + leaf * n
    per_object = request_limits(FORWARD_PROTOCOL, FRAME).__class__(512, FRAME, 2**32, 15)
    tracemalloc.start()
    try:
        unpackb(payload, max_size=FRAME, limits=per_object)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak > 30 * len(payload)  # dozens of bytes of objects per byte received
