"""The coordinator assigns the run's DHT bootstrap (`Membership.dht_root`): the member
that first announced a DHT, directly reachable ones first, whatever its peer id; every
membership reply carries it."""

from __future__ import annotations

from coordinator.journal import Journal
from coordinator.membership import Membership, Peer

CIRCUIT = "/ip4/10.0.0.9/tcp/4001/p2p/12D3KooWrelay/p2p-circuit"


def member(pid: str, joined_at: float, *, dht: bool = True, relayed: bool = False,
           observer: bool = False) -> Peer:  # fmt: skip
    addrs = [CIRCUIT] if relayed else ["/ip4/10.0.0.2/tcp/4001"]
    p = Peer(pid, b"k", 0, addrs, ["/ip4/10.0.0.2/tcp/5000"] if dht else [], "cpu", 1.0,
             None, "10.0.0.2", None, False, joined_at, joined_at + 10.0)  # fmt: skip
    p.observer = observer
    return p


def test_the_first_direct_member_with_a_dht_is_the_root_whatever_its_id() -> None:
    m = Membership(n_stages=1, stage_costs=[1.0], ttl_s=10.0, journal=Journal())
    assert m.dht_root() == "" and m.delta(0).dht_root == ""
    m.join(member("12D3KooWzzz", 1.0))
    m.join(member("12D3KooW111", 2.0))  # a smaller id, later: no takeover
    m.join(member("12D3KooW000", 0.5, dht=False))  # earlier, but no DHT
    m.join(member("12D3KooW001", 0.1, relayed=True))  # earlier, but only behind a relay
    m.join(member("12D3KooW002", 0.2, observer=True))  # an observer never is
    assert m.dht_root() == "12D3KooWzzz"
    since = m.version
    assert m.delta(0).dht_root == "12D3KooWzzz"  # a full view carries it
    m.join(member("12D3KooW003", 3.0))
    assert m.delta(since).dht_root == "12D3KooWzzz"  # and a delta
    m.remove("12D3KooWzzz", "left")
    assert m.dht_root() == "12D3KooW111"  # the next to have joined


def test_a_relayed_member_is_the_root_only_when_no_direct_one_announces_a_dht() -> None:
    m = Membership(n_stages=1, stage_costs=[1.0], ttl_s=10.0, journal=Journal())
    m.join(member("12D3KooWbbb", 1.0, relayed=True))
    m.join(member("12D3KooWaaa", 2.0, relayed=True))
    assert m.dht_root() == "12D3KooWbbb"


def test_a_member_that_announces_its_dht_later_does_not_take_the_root() -> None:
    """Nodes start together: the first to announce a DHT is the root others move to, and
    an earlier joiner whose DHT comes up later does not take the role from it."""
    m = Membership(n_stages=1, stage_costs=[1.0], ttl_s=10.0, journal=Journal())
    m.join(member("12D3KooWearly", 1.0, dht=False))
    m.join(member("12D3KooWlate", 2.0))  # joined second, its DHT already up
    assert m.dht_root() == "12D3KooWlate"
    m.announce("12D3KooWearly", ["/ip4/10.0.0.2/tcp/5001"], 3.0)
    assert m.dht_root() == "12D3KooWlate"
    m.announce("12D3KooWlate", ["/ip4/10.0.0.2/tcp/5002"], 4.0)  # a move keeps its place
    assert m.dht_root() == "12D3KooWlate"
    m.remove("12D3KooWlate", "left")
    assert m.dht_root() == "12D3KooWearly"
