"""The peer view: routing candidates, replicas and the DHT root from the coordinator's
membership, and members whose entries do not parse left out (one bad entry costs that
member, never the node)."""

from __future__ import annotations

import dataclasses

from node.p2p.host import Libp2pTransport
from node.peer_view import PeerView
from node.routing import Router
from protocol.control import PeerInfo
from protocol.identity import NodeKey


def peer(stage: int, *, addrs: list[str] | None = None, dht: list[str] | None = None,
         observer: bool = False) -> PeerInfo:  # fmt: skip
    pid = NodeKey.generate().peer_id
    return PeerInfo(
        peer_id=pid, stage=stage, addrs=[f"/ip4/127.0.0.1/tcp/4001/p2p/{pid}"] if addrs is None
        else addrs, dht_addrs=dht or [], device="cpu", throughput=0.0, observer=observer,
    )  # fmt: skip


def view(stage: int) -> PeerView:
    return PeerView(Libp2pTransport(NodeKey.generate()), Router(), stage=stage)


def test_next_stage_replicas_and_observers() -> None:
    v = view(0)
    me = PeerInfo(peer_id=v.me, stage=0, addrs=[], device="cpu", throughput=0.0)
    a, b, other0 = peer(1), peer(1), peer(0)
    watcher = peer(2, observer=True)
    v.update(3, {p.peer_id: p for p in (me, a, b, other0, watcher)})
    assert sorted(v.next_stage_peers()) == sorted([a.peer_id, b.peer_id])
    assert v.replicas() == 2 and v.version == 3
    assert v.is_member(watcher.peer_id)  # admitted on the data plane, on no stage
    assert not v.other_replicas_have_dht()


def test_members_with_bad_addresses_are_left_out_and_the_rest_kept() -> None:
    v = view(0)
    good = peer(1)
    garbage = peer(1, addrs=["garbage"])
    bad_dht = peer(1, dht=["/ip4/999.1.1.1/tcp/1"])
    bad_id = PeerInfo(peer_id="not-a-peer-id", stage=1, addrs=["/ip4/127.0.0.1/tcp/1"],
                      device="cpu", throughput=0.0)  # fmt: skip
    members = {p.peer_id: p for p in (good, garbage, bad_dht, bad_id)}
    v.update(1, members)
    v.update(2, members)  # a second refresh changes nothing and logs nothing new
    assert v.next_stage_peers() == [good.peer_id]
    assert set(v.rejected) == {garbage.peer_id, bad_dht.peer_id, "not-a-peer-id"}
    # a known member that later announces a bad DHT address is left out too
    changed = dataclasses.replace(good, dht_addrs=["nonsense"])
    v.update(3, {good.peer_id: changed})
    assert v.next_stage_peers() == [] and list(v.rejected) == [good.peer_id]


def test_dht_root_is_the_coordinators_assignment() -> None:
    v = view(1)
    others = [peer(0, dht=["/ip4/127.0.0.1/tcp/5000"]) for _ in range(4)]
    members = {p.peer_id: p for p in others}
    largest = max(p.peer_id for p in others)
    v.update(1, members, dht_root=largest)  # whatever its id: no key grinding wins it
    root = v.dht_root()
    assert root is not None and root.peer_id == largest
    assert v.dht_bootstrap()[0] == others[[p.peer_id for p in others].index(largest)].dht_addrs[0]
    assert len(v.dht_bootstrap()) == 4
    v.update(2, members, dht_root="")  # no assignment: no root to move to
    assert v.dht_root() is None
    v.update(3, members, dht_root=v.me)  # this node is the root: it stays where it is
    assert v.dht_root() is None
    v.update(4, members, dht_root="12D3KooWnotamember")  # not in the view: ignored
    assert v.dht_root() is None


def paired(n: int, m: int) -> list[list[int]]:
    """The ranks of the next-stage replicas each of `n` replicas of stage 0 is paired with,
    by its own rank, with `m` replicas on stage 1."""
    mine = [view(0) for _ in range(n)]
    nxt = [peer(1) for _ in range(m)]
    listed = [PeerInfo(peer_id=v.me, stage=0, addrs=[], device="cpu", throughput=0.0)
              for v in mine]  # fmt: skip
    rank = {pid: i for i, pid in enumerate(sorted(p.peer_id for p in nxt))}
    for v in mine:
        v.update(1, {p.peer_id: p for p in [*listed, *nxt]})
    return [[rank[p] for p in v.partners()] for v in sorted(mine, key=lambda v: v.me)]


def test_each_replica_is_paired_with_next_stage_replicas_by_rank() -> None:
    """Replicas are paired by rank (peer id order) so that each pair trains as one model:
    one to one when the stages are as large, every next-stage replica paired when it is
    larger, and senders wrapping round when it is smaller; none on the last stage."""
    assert paired(2, 2) == [[0], [1]]
    assert paired(2, 3) == [[0, 2], [1]]
    assert paired(3, 2) == [[0], [1], [0]]
    last = view(1)
    last.update(1, {p.peer_id: p for p in (peer(1), peer(0))})
    assert last.partners() == []
