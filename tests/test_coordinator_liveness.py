"""Liveness is soft state: a heartbeat that only renews its peer and its leases writes
nothing and its answer does not wait for a write, while grants, commits, announced
addresses and fences stay durable. Driven through the real `Service` on a real SQLite
file, with the store's transactions counted at the `Store` interface (the group commit
writes the journal whenever it holds anything, as here)."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import pytest
from coordinator_harness import SHARD_TOKENS, CountingStore, small_dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.dataset import load_dataset
from coordinator.metrics import CoordinatorMetrics
from coordinator.server import build_state
from coordinator.service import Answer, Service
from protocol import control as c
from protocol.codec import encode
from protocol.corpus import Manifest
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.signing import sign_request

RUN = "live-run"
TTL = 20.0  # seconds
KEYS = [NodeKey.generate() for _ in range(4)]


class Rig:
    """A service over a counting store; `call` answers one signed request and then does
    what the group commit would: writes whatever the journal holds."""

    def __init__(self, tmp: Path, data: tuple[CoordinatorConfig, Manifest, bytes]) -> None:
        cfg, manifest, corpus = data
        self.store = CountingStore(tmp / "c.sqlite")
        now = time.time()
        journal, membership, book, paused = build_state(cfg, self.store, manifest, now)
        self.svc = Service(
            cfg, manifest=manifest, corpus=corpus, journal=journal, membership=membership,
            book=book, metrics=CoordinatorMetrics(), paused=paused,
        )  # fmt: skip
        self.now = self.svc.started
        self.flush()

    def flush(self) -> None:
        if self.svc.journal:
            self.store.write(self.svc.journal.take())

    def call(self, key: NodeKey, body: Message) -> Answer:
        raw = encode(sign_request(key, body, now=self.now, run=RUN))
        answer = self.svc.handle(raw, "127.0.0.1", self.now)
        self.flush()
        return answer


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[CoordinatorConfig, Manifest, bytes]:
    tmp = tmp_path_factory.mktemp("liveness")
    cfg = CoordinatorConfig(
        run_id=RUN, dataset=str(small_dataset(tmp)), shard_tokens=SHARD_TOKENS,
        db=str(tmp / "unused.sqlite"), token_cache="", lease_ttl_s=TTL,
        heartbeat_interval_s=2.0, min_grant_tokens=16,
    )  # fmt: skip
    manifest, corpus = load_dataset(cfg)
    return cfg, manifest, corpus


@settings(max_examples=30, deadline=None)
@given(
    peers=st.integers(1, len(KEYS)),
    grants=st.lists(st.integers(0, len(KEYS) - 1), max_size=6),
    rounds=st.lists(
        st.tuples(
            st.floats(0.0, TTL / 2),  # seconds since the previous round of heartbeats
            st.none() | st.floats(0.0, 1e6),  # throughput reported
            st.booleans(),  # each lists its leases
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_renew_only_heartbeats_write_nothing(
    data: tuple[CoordinatorConfig, Manifest, bytes],
    peers: int,
    grants: list[int],
    rounds: list[tuple[float, float | None, bool]],
) -> None:
    with tempfile.TemporaryDirectory() as d:
        rig = Rig(Path(d), data)
        for key in KEYS[:peers]:
            assert rig.call(key, c.JoinRequest(throughput=100.0)).durable
        held: dict[str, list[c.LeaseRef]] = {k.peer_id: [] for k in KEYS}
        for i in grants:
            key = KEYS[i % peers]
            answer = rig.call(key, c.LeaseAcquire())
            assert answer.durable and isinstance(answer.reply, c.LeaseGrant)
            if answer.reply.lease is not None:
                lease = answer.reply.lease
                held[key.peer_id].append(c.LeaseRef(lease_id=lease.lease_id, epoch=lease.epoch))
        writes = rig.store.writes
        for dt, throughput, listed in rounds:
            rig.now += dt
            assert rig.svc.expire(rig.now) == (0, 0)  # the sweeper: nothing lapsed
            for key in KEYS[:peers]:
                refs = held[key.peer_id] if listed else []
                answer = rig.call(key, c.HeartbeatRequest(leases=refs, throughput=throughput))
                reply = answer.reply
                assert isinstance(reply, c.HeartbeatReply), reply
                assert reply.renewed == held[key.peer_id] and reply.fenced == []
                assert reply.expires_at == rig.now + TTL
                assert not answer.durable  # sent without waiting for a write
        assert rig.store.writes == writes  # ... and none was made
        # what is not a renewal is still written, and its answer waits for the write
        answer = rig.call(KEYS[0], c.LeaseAcquire())
        assert answer.durable and rig.store.writes == writes + 1
        rig.store.close()


def test_heartbeats_that_announce_or_fence_wait_for_the_write(
    data: tuple[CoordinatorConfig, Manifest, bytes], tmp_path: Path
) -> None:
    rig = Rig(tmp_path, data)
    key = KEYS[0]
    rig.call(key, c.JoinRequest(throughput=100.0))
    writes = rig.store.writes
    announce = c.HeartbeatRequest(dht_addrs=[f"/ip4/10.0.0.1/tcp/4001/p2p/{key.peer_id}"])
    assert rig.call(key, announce).durable and rig.store.writes == writes + 1  # versioned
    again = rig.call(key, announce)  # the same addresses: nothing changed, yet it waits
    assert again.durable and rig.store.writes == writes + 1
    unknown = c.LeaseRef(lease_id=99, epoch=1)
    fenced = rig.call(key, c.HeartbeatRequest(leases=[unknown]))
    assert isinstance(fenced.reply, c.HeartbeatReply) and fenced.reply.fenced == [unknown]
    assert fenced.durable  # a node drops work on it: never shown before what led to it
    stranger = rig.call(KEYS[1], c.HeartbeatRequest())  # never joined
    assert isinstance(stranger.reply, c.ErrorReply) and stranger.durable
    rig.store.close()


def test_a_member_cannot_announce_another_peers_dht(
    data: tuple[CoordinatorConfig, Manifest, bytes], tmp_path: Path
) -> None:
    """DHT addresses name the member's own peer id (its outer loop runs under its key):
    a join or heartbeat announcing another peer's DHT, or an address with no peer id, is
    refused whole, and the view keeps what the member announced before."""
    rig = Rig(tmp_path, data)
    me, other = KEYS[0], KEYS[1]
    theirs = f"/ip4/10.0.0.2/tcp/4001/p2p/{other.peer_id}"
    refused = rig.call(me, c.JoinRequest(throughput=1.0, dht_addrs=[theirs])).reply
    assert isinstance(refused, c.ErrorReply) and refused.code == "bad_request", refused
    assert me.peer_id not in rig.svc.membership.live
    mine = f"/ip4/10.0.0.1/tcp/4001/p2p/{me.peer_id}"
    assert isinstance(rig.call(me, c.JoinRequest(dht_addrs=[mine])).reply, c.JoinReply)
    for bad in ([theirs], [mine, "/ip4/10.0.0.1/tcp/4002"]):
        reply = rig.call(me, c.HeartbeatRequest(dht_addrs=bad)).reply
        assert isinstance(reply, c.ErrorReply) and "does not end in /p2p/" in reply.detail
    assert rig.svc.membership.live[me.peer_id].dht_addrs == (mine,)
    rig.store.close()


def test_a_stage0_replica_is_refused_past_its_share_of_the_shards(
    data: tuple[CoordinatorConfig, Manifest, bytes], tmp_path: Path
) -> None:
    rig = Rig(tmp_path, data)
    first, second = KEYS[0], KEYS[1]
    for key in (first, second):
        rig.call(key, c.JoinRequest(throughput=100.0, stage=0))

    def take(key: NodeKey) -> tuple[int, str]:
        n = 0
        while True:
            reply = rig.call(key, c.LeaseAcquire()).reply
            assert isinstance(reply, c.LeaseGrant)
            if reply.lease is None:
                return n, reply.reason
            n += 1

    shards = len(rig.svc.book.shards)
    share = -(-shards // 2)
    assert take(first) == (share, "fair_share")  # the rest waits for the second replica
    assert take(second) == (shards - share, "no_shards")
    rig.store.close()


def test_a_database_of_another_shard_cut_is_refused(
    data: tuple[CoordinatorConfig, Manifest, bytes], tmp_path: Path
) -> None:
    # The corpus hash does not change with the cut, so the stored shards are checked too:
    # restored under another cut, shard ids would name other tokens.
    cfg, manifest, _ = data
    Rig(tmp_path, data).store.close()
    other = dataclasses.replace(cfg, shard_tokens=cfg.shard_tokens // 2)
    recut, _ = load_dataset(other)
    assert recut.content_hash == manifest.content_hash
    store = CountingStore(tmp_path / "c.sqlite")
    with pytest.raises(ValueError, match=r"other shards than shard_tokens = 1024"):
        build_state(other, store, recut, time.time())
    store.close()
