"""Control-plane messages: round-trips of every request and reply, and hypothesis fuzzing:
random or mutated bytes only ever raise ProtocolError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import control as c
from protocol.codec import decode, encode, packb
from protocol.errors import ProtocolError
from protocol.message import Message

LEASE = c.LeaseInfo(
    lease_id=3,
    shard_id=1,
    epoch=2,
    data_epoch=0,
    committed=10,
    limit=100,
    shard_tokens=100,
    expires_at=1.5e9,
    state="active",
)
RUN = c.RunInfo(
    run_id="r",
    model_preset="small",
    n_stages=2,
    codec="subspace_int8",
    seed=1,
    heartbeat_interval_s=3.0,
    lease_ttl_s=15.0,
    dataset_name="stdlib",
    dataset_hash="a" * 64,
    shards=10,
    data_epoch=0,
)
PEER = c.PeerInfo(
    peer_id="12D3Koo",
    stage=1,
    addrs=["/ip4/1.2.3.4/tcp/5"],
    device="cuda",
    throughput=1e4,
    deadline=None,
)
SAMPLES: list[Message] = [
    c.ErrorReply(code="fenced", detail="lease 3 is fenced"),
    c.OkReply(),
    c.JoinRequest(
        addrs=["/ip4/127.0.0.1/tcp/1"],
        device="cpu",
        throughput=12.5,
        deadline=2e9,
        stage=1,
        join_token="t",
        metrics_port=9100,
        memory=c.DeviceMemory(
            total_bytes=12 << 30, free_bytes=11 << 30, cuda=True, precision="bf16", recompute=True
        ),
    ),
    c.JoinReply(peer_id="12D3Koo", stage=0, run=RUN, membership_version=7),
    c.HeartbeatRequest(leases=[c.LeaseRef(lease_id=3, epoch=2)], throughput=5.0),
    c.HeartbeatRequest(state=c.StateRef(round=4, digest="0a1b")),
    c.HeartbeatRequest(witnessed=[c.Witnessed(peer="12D3KooWx", tokens=4096)]),
    c.HeartbeatReply(stage=0, attested=c.StateRef(round=2**62, digest="f" * 64)),
    c.HeartbeatReply(
        stage=1,
        moved=True,
        renewed=[c.LeaseRef(lease_id=3, epoch=2)],
        fenced=[c.LeaseRef(lease_id=1, epoch=1)],
        expires_at=1e9,
        membership_version=3,
        data_epoch=1,
    ),
    c.MembershipRequest(since=5, stage=0),
    c.MembershipReply(version=9, full=False, peers=[PEER], left=["x"]),
    c.ManifestRequest(),
    c.LeaseAcquire(max_tokens=100),
    c.LeaseGrant(lease=LEASE),
    c.LeaseGrant(reason="no_shards"),
    c.LeaseCommit(lease_id=3, epoch=2, start=10, end=20),
    c.LeaseComplete(lease_id=3, epoch=2),
    c.LeaseRelease(lease_id=3, epoch=2),
    c.LeaseReply(lease=LEASE, shard_done=True),
    c.ShardFetch(shard_id=4),
    c.ShardData(shard_id=4, sha256="b" * 64, data=b"\x00\x01"),
    c.LeaveRequest(),
    c.StatusRequest(),
    c.StatusReply(
        run_id="r",
        membership_version=1,
        paused=False,
        peers=2,
        stages=[c.StageStatus(stage=0, peers=2, throughput=3.0, cost=1.0)],
        leases={"active": 1},
        shards={"pending": 3},
        data_epoch=0,
        committed_tokens=5,
        epoch_tokens=10,
        tokens_per_s=1.0,
        eta_s=5.0,
    ),
    c.AdminDrain(admin_token="x", peer_id="p"),
    c.AdminBan(admin_token="x", peer_id="p"),
    c.AdminPause(admin_token="x", paused=False),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.TYPE)
def test_round_trip(msg: Message) -> None:
    assert decode(encode(msg)) == msg


def test_every_request_type_has_a_sample() -> None:
    assert set(c.REQUEST_TYPES) <= {type(m) for m in SAMPLES}


@pytest.mark.parametrize(
    "wire",
    [
        {"t": "lease.commit", "v": 1, "lease_id": 0, "epoch": 1, "start": 0, "end": 1},
        {"t": "lease.commit", "v": 1, "lease_id": 1, "epoch": -1, "start": 0, "end": 1},
        {"t": "join", "v": 1, "addrs": ["a"] * 17},
        {"t": "join", "v": 1, "throughput": float("nan")},
        {"t": "join", "v": 1, "memory": {"free_bytes": -1}},
        {"t": "join", "v": 1, "memory": {"free_bytes": 1 << 60}},
        {"t": "join", "v": 1, "memory": {"micro_batch": 0}},
        {"t": "join", "v": 1, "memory": {"precision": "fp8"}},
        {"t": "heartbeat", "v": 1, "leases": [{"lease_id": "1", "epoch": 0}]},
        {"t": "heartbeat", "v": 1, "witnessed": [{"peer": "p", "tokens": 0}]},
        {"t": "heartbeat", "v": 1, "witnessed": [{"peer": "", "tokens": 1}]},
        {"t": "heartbeat", "v": 1, "witnessed": [{"peer": "p", "tokens": 1}] * 65},
        {"t": "shard.data", "v": 1, "shard_id": 1, "sha256": "x", "data": b""},
    ],
)
def test_invalid_fields_are_protocol_errors(wire: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode(packb(wire))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_messages_only_raise_protocol_error(msg: Message, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(("flip", "cut", "insert")))
        i = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = decode(bytes(raw))
    except ProtocolError:
        return
    assert isinstance(out, Message)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([type(m) for m in SAMPLES]),
    st.dictionaries(
        st.sampled_from(
            [
                "lease_id",
                "epoch",
                "start",
                "end",
                "peers",
                "run",
                "lease",
                "addrs",
                "stage",
                "data",
                "leases",
                "since",
                "paused",
                "code",
            ]
        ),
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats()
        | st.text(max_size=5)
        | st.binary(max_size=5)
        | st.lists(st.integers(), max_size=3)
        | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    ),
)
def test_wrong_field_types_only_raise_protocol_error(kind: type[Message], fields: dict) -> None:  # type: ignore[type-arg]
    try:
        decode(packb({"t": kind.TYPE, "v": 1, **fields}))
    except ProtocolError:
        pass
