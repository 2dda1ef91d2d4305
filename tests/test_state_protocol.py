"""`/agora/state/1`: the messages (round trips, bounds, fuzzed decoding) and the node's
state server (chunking, its own stage only, one copy per round, live parameters without
an outer loop)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.checkpoint import GlobalState
from node.state_server import StateServer
from node.worker import TorchWorker
from protocol import ProtocolError, TensorFrame, decode, encode
from protocol.codec import DEFAULT_MAX_FRAME
from protocol.control import JoinRequest, PeerInfo, StatusReply
from protocol.dataplane import Refused
from protocol.state import MAX_CHUNK_ELEMENTS, StateChunk, StateRequest

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _chunk(n: int = 5, *, offset: int = 0, numel: int = 10) -> StateChunk:
    data = TensorFrame.from_numpy(np.arange(n, dtype=np.float32))
    return StateChunk(
        run_id="r1", stage=1, round=3, version=7, numel=numel, offset=offset, data=data
    )


def test_round_trips() -> None:
    req = StateRequest(stage=2, offset=4096, count=1024)
    assert decode(encode(req)) == req
    chunk = _chunk(offset=5)
    got = decode(encode(chunk))
    assert isinstance(got, StateChunk) and got == chunk
    assert got.end == 10 and got.values().tolist() == [0, 1, 2, 3, 4]


def test_a_full_chunk_fits_the_default_frame() -> None:
    big = StateChunk(
        run_id="r" * 128, stage=0, round=2**40, version=2**62, numel=2**33, offset=2**32,
        data=TensorFrame.from_numpy(np.zeros(MAX_CHUNK_ELEMENTS, dtype=np.float32)),
    )  # fmt: skip
    assert len(encode(big)) < DEFAULT_MAX_FRAME


@pytest.mark.parametrize(
    "wire_change, match",
    [
        ({"offset": 8}, "exceeds the state"),  # [8, 13) past numel 10
        ({"data": {"dtype": "float16", "shape": [5], "data": b"\0" * 10}}, "1-D float32"),
        ({"data": {"dtype": "float32", "shape": [5, 1], "data": b"\0" * 20}}, "1-D float32"),
        ({"data": {"dtype": "float32", "shape": [0], "data": b""}}, "outside"),
        ({"numel": 0}, "below minimum"),
        ({"round": -1}, "below minimum"),
    ],
)
def test_bad_chunks_are_protocol_errors(wire_change: dict[str, Any], match: str) -> None:
    wire = _chunk().to_wire() | wire_change
    with pytest.raises(ProtocolError, match=match):
        StateChunk.from_wire(wire)


def test_non_finite_or_short_payload_is_refused_on_read() -> None:
    bad = _chunk().to_wire()
    bad["data"]["data"] = np.array([0, 1, np.nan, 3, 4], dtype=np.float32).tobytes()
    with pytest.raises(ProtocolError, match="NaN"):
        StateChunk.from_wire(bad).values()
    bad["data"]["data"] = b"\0" * 12
    with pytest.raises(ProtocolError, match="does not match"):
        StateChunk.from_wire(bad).values()


def test_request_bounds() -> None:
    for field, value in (("count", 0), ("count", MAX_CHUNK_ELEMENTS + 1), ("offset", -1)):
        wire = StateRequest(stage=0, offset=0, count=1).to_wire() | {field: value}
        with pytest.raises(ProtocolError):
            StateRequest.from_wire(wire)


def test_observer_fields_are_wire_compatible() -> None:
    # a new decoder reads an old join (no field) as a member; an old peer's decoder
    # ignores the unknown field (unknown keys are ignored by every decoder)
    old = JoinRequest(device="cpu").to_wire()
    assert "observer" in old
    del old["observer"]
    assert JoinRequest.from_wire(old).observer is False
    assert JoinRequest.from_wire(JoinRequest(observer=True).to_wire()).observer is True
    info = PeerInfo(peer_id="p", stage=2, addrs=[], device="x", throughput=0.0, observer=True)
    wire = info.to_wire() | {"future_field": 1}
    assert PeerInfo.from_wire(wire).observer is True
    status = StatusReply(
        run_id="r", membership_version=1, paused=False, peers=0, stages=[], leases={},
        shards={}, data_epoch=0, committed_tokens=0, epoch_tokens=0, tokens_per_s=0.0,
    ).to_wire()  # fmt: skip
    del status["observers"]
    assert StatusReply.from_wire(status).observers == 0


# --- fuzzing: random and mutated bytes only ever raise ProtocolError ---------------------


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    if isinstance(msg, StateChunk):
        try:
            msg.values()
        except ProtocolError:
            pass


_SEEDS = [
    encode(_chunk()),
    encode(_chunk(3, offset=7)),
    encode(StateRequest(stage=1, offset=5, count=9)),
]


@FUZZ
@given(
    st.sampled_from(_SEEDS),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(0, 10_000),
)
def test_mutated_state_messages_raise_only_protocol_error(
    seed: bytes, flips: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(seed)
    for pos, value in flips:
        data[pos % len(data)] = value
    data = data[: max(1, len(data) - cut % 8)]
    try:
        msg = decode(bytes(data))
    except ProtocolError:
        return
    if isinstance(msg, StateChunk):
        try:
            arr = msg.values()
        except ProtocolError:
            return
        assert arr.shape == (msg.end - msg.offset,) and msg.end <= msg.numel


# --- the node's state server (real torch worker, no transport) ----------------------------


class _Link:
    """An outer loop's live buffer and round, of which `state()` is a private copy."""

    def __init__(self, numel: int) -> None:
        self.buf = torch.arange(numel, dtype=torch.float32)
        self.round = 4

    def state(self) -> GlobalState:
        return GlobalState(theta_g=self.buf.clone(), momentum=None, round=self.round)


def _serve(server: StateServer, stage: int, offset: int, count: int) -> Any:
    return server.handle("peer", StateRequest(stage=stage, offset=offset, count=count))


def test_outer_state_is_served_in_chunks_from_one_copy() -> None:
    worker = TorchWorker()
    link = _Link(10)
    server = StateServer(
        worker, run_id="r1", stage=lambda: 1, params=list, outer=True, max_frame=4096 + 16
    )
    assert server.max_elements == 4  # the frame limit caps the chunk

    async def main() -> None:
        refused = await _serve(server, 1, 0, 100)
        assert isinstance(refused, Refused) and refused.retry_after > 0  # nothing held yet
        server.hold(link.state())
        link.buf.add_(100.0)  # the link moves on; the held copy does not
        got, offset = [], 0
        while offset < 10:
            chunk = await _serve(server, 1, offset, 100)
            assert isinstance(chunk, StateChunk) and chunk.round == 4 and chunk.numel == 10
            assert chunk.end - chunk.offset <= 4
            got += chunk.values().tolist()
            offset = chunk.end
        assert got == list(range(10))
        wrong = await _serve(server, 0, 0, 4)
        assert isinstance(wrong, Refused) and "serves stage 1" in wrong.detail
        with pytest.raises(ProtocolError, match="past the state"):
            await _serve(server, 1, 10, 4)
        first = await _serve(server, 1, 0, 4)
        link.round = 5
        server.hold(link.state())
        again = await _serve(server, 1, 4, 4)
        assert again.round == 5 and again.version != first.version
        assert again.values().tolist() == [104.0, 105.0, 106.0, 107.0]

    try:
        trio.run(main)
    finally:
        worker.close()


def test_without_outer_loop_the_live_parameters_are_served_at_round_0() -> None:
    worker = TorchWorker()
    params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    server = StateServer(worker, run_id="r1", stage=lambda: 0, params=lambda: params, outer=False)

    async def main() -> None:
        chunk = await _serve(server, 0, 0, 100)
        assert isinstance(chunk, StateChunk)
        assert chunk.round == 0 and chunk.numel == 10
        assert chunk.values().tolist() == [1.0] * 6 + [0.0] * 4
        with torch.no_grad():
            params[1].add_(1.0)
        tail = await _serve(server, 0, 6, 100)  # same copy while it is fresh
        assert tail.version == chunk.version and tail.values().tolist() == [0.0] * 4

    try:
        trio.run(main)
    finally:
        worker.close()
