"""The leader search of a replica waiting for its group reads the DHT at a bounded rate,
and offers only leaders the replica admits (the stage's listed members).

hivemind's own `PotentialLeaders.pop_next_leader`, with nobody else looking for a group,
asks for a fresh read of the group key each time it looks, and `_update_queue_periodically`
does each at once: a busy loop of DHT gets for the whole matchmaking window. Both run here
as hivemind wrote them, against a group-key store that counts reads (nobody declared), for
hivemind's class and for `node.outer.paced_leaders.PacedLeaders`. hivemind cannot share a
process with py-libp2p, so the check runs in a fresh interpreter (the pytest process
does not even import `node.outer.paced_leaders`).
"""

from __future__ import annotations

import json
import subprocess
import sys

WINDOW_S = 1.0  # the matchmaking window each class is driven for (s)

SCRIPT = """
import asyncio, json, sys
from hivemind.p2p import PeerID
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.utils import get_dht_time
from node.outer.paced_leaders import MIN_READ_GAP_S, PacedLeaders

WINDOW_S = float(sys.argv[1])

class NobodyDeclared:
    current_key = "agora-run-stage0.0b"
    def __init__(self):
        self.reads = 0
    async def get_averagers(self, group_key, only_active):
        self.reads += 1
        await asyncio.sleep(0)  # a DHT get yields to the loop at least once
        return []

async def reads(cls):
    leaders = cls(PeerID(b"me"), WINDOW_S, None)
    keys = NobodyDeclared()
    leaders.search_end_time = get_dht_time() + WINDOW_S
    leaders.running.set()
    updates = asyncio.create_task(leaders._update_queue_periodically(keys))
    try:
        await asyncio.wait_for(leaders.pop_next_leader(), WINDOW_S)
    except asyncio.TimeoutError:
        pass
    updates.cancel()
    return keys.reads

print(json.dumps({"hivemind": asyncio.run(reads(PotentialLeaders)),
                  "paced": asyncio.run(reads(PacedLeaders)), "gap": MIN_READ_GAP_S}))
"""


FOLLOW_SCRIPT = """
import asyncio, json
from hivemind.p2p import PeerID
from hivemind.averaging.matchmaking import PotentialLeaders
from hivemind.utils import get_dht_time
from node.outer.paced_leaders import PacedLeaders

STRANGER, MEMBER = PeerID(b"stranger"), PeerID(b"member")

class TwoLeaders:
    current_key = "agora-run-stage0.0b"
    async def get_averagers(self, group_key, only_active):
        await asyncio.sleep(0)
        now = get_dht_time()
        return [(STRANGER, now + 5.0), (MEMBER, now + 6.0)]  # the stranger searched first

async def first_leader(leaders):
    leaders.search_end_time = get_dht_time() + 10.0
    leaders.running.set()
    updates = asyncio.create_task(leaders._update_queue_periodically(TwoLeaders()))
    try:
        return (await asyncio.wait_for(leaders.pop_next_leader(), 5.0)).to_bytes().decode()
    finally:
        updates.cancel()

reached = []

async def reach(peer):  # dials the leader where it listens; the join request waits
    await asyncio.sleep(0)
    reached.append(peer.to_bytes().decode())

print(json.dumps({
    "hivemind": asyncio.run(first_leader(PotentialLeaders(PeerID(b"me"), 1.0, None))),
    "members_only": asyncio.run(first_leader(
        PacedLeaders(PeerID(b"me"), 1.0, None, admits=lambda p: p == MEMBER, reach=reach))),
    "reached": reached,
}))
"""


def test_a_replica_asks_to_join_only_leaders_it_admits() -> None:
    """Two averagers declared under the group key, a stranger that started searching
    first and a member: hivemind's search asks the stranger first; with the stage's
    members given, the search never offers the stranger and asks the member, dialed
    (`reach`) before it is handed to the join request."""
    out = subprocess.run(
        [sys.executable, "-c", FOLLOW_SCRIPT],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    first = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == {"hivemind": "stranger", "members_only": "member", "reached": ["member"]}, first


def test_a_waiting_replica_reads_the_group_key_at_most_once_per_gap() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(WINDOW_S)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    reads = json.loads(out.stdout.strip().splitlines()[-1])
    most = WINDOW_S / reads["gap"] + 1  # reads a paced search can make in the window
    # hivemind's own search spins: far more reads than a paced one could make
    assert reads["hivemind"] > 10 * most, reads
    assert 2 <= reads["paced"] <= most, reads
