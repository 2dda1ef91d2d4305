"""Paced leader search: hivemind's matchmaking without its DHT busy loop.

While a replica waits for its group, hivemind's `PotentialLeaders` re-reads the group
key from the DHT whenever its queue of candidate leaders is empty or holds only peers
that would follow it (`pop_next_leader` sets `update_triggered` each time it looks), and
`_update_queue_periodically` answers each trigger at once. With nobody to join yet,
that is one DHT get after another for the whole matchmaking window, as fast as the DHT
process and the p2p daemon answer: measured on a 2-core box, about 1.2 CPU-seconds per
second for two replicas of a stage, whatever the stage's size, so each round took most
of the box away from training for its matchmaking seconds (docs/outer-averaging.md,
"What a round costs").

`PacedLeaders` leaves hivemind's search as it is and spaces its reads of the group key
at least `MIN_READ_GAP_S` apart: a follower sees a new leader at most that much later,
which a matchmaking window of seconds absorbs.

It also drops, from what it reads, every averager this replica does not admit (`admits`:
the stage's members as the coordinator listed them when the round began). Refusing a
stranger's join request (`StageAverager.rpc_join_group`) covers groups this replica leads;
this covers groups it would follow. Without it, a replica asked to join a group led by a
peer its list does not hold yet (a replica that joined the stage just after this round
began), found the stranger in the assembled group and stepped alone, while the leader
pushed parts to it until its timeouts: in a churn run the joiner's first round took
27.5 s and the next round of the replica it chose found no group either.

And before a join request goes out, `reach` dials the leader where it says it listens.
The p2p daemon otherwise dials the addresses it last knew for the peer id: a replica
whose outer process restarted (a move to the run's DHT; it keeps its node's key) listens
elsewhere now, and a daemon that was given its old address (a bootstrap list read while
both restarted) fails the dial and backs off from it for longer at each failure. Two
replicas that moved together then never met again: each found the other's
declaration on the DHT and could not reach it, round after round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.averaging.matchmaking import PotentialLeaders

MIN_READ_GAP_S = 0.25  # seconds between two reads of the group key by one replica


def _admit_anyone(_peer: Any) -> bool:
    return True


async def _as_known(_peer: Any) -> None:
    return None


class _PacedKeys:
    """A `GroupKeyManager` whose `get_averagers` waits out `gap` since its last call and
    returns only the averagers `admits` takes."""

    def __init__(self, keys: Any, gap: float, admits: Callable[[Any], bool]) -> None:
        self._keys, self._gap, self._last = keys, gap, float("-inf")
        self._admits = admits

    def __getattr__(self, name: str) -> Any:
        return getattr(self._keys, name)

    async def get_averagers(self, *args: Any, **kwargs: Any) -> Any:
        wait = self._last + self._gap - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last = time.monotonic()
        found = await self._keys.get_averagers(*args, **kwargs)
        return [(peer, expiration) for peer, expiration in found if self._admits(peer)]


Reach = Callable[[Any], Awaitable[None]]  # dial a peer (hivemind `PeerID`) where it listens


class PacedLeaders(PotentialLeaders):  # type: ignore[misc]
    """hivemind's `PotentialLeaders`, its group-key reads at most one per `gap` seconds,
    only leaders that `admits` takes (hivemind `PeerID` -> bool) in its queue, and each
    leader dialed by `reach` before it is handed to the join request."""

    gap = MIN_READ_GAP_S

    def __init__(
        self,
        *args: Any,
        admits: Callable[[Any], bool] = _admit_anyone,
        reach: Reach = _as_known,
    ) -> None:
        super().__init__(*args)
        self.admits = admits
        self.reach = reach

    async def _update_queue_periodically(self, key_manager: Any) -> None:
        await super()._update_queue_periodically(_PacedKeys(key_manager, self.gap, self.admits))

    async def pop_next_leader(self) -> Any:
        leader = await super().pop_next_leader()
        await self.reach(leader)
        return leader


def pace(
    matchmaking: Any, admits: Callable[[Any], bool] = _admit_anyone, reach: Reach = _as_known
) -> None:
    """Give a hivemind `Matchmaking` a `PacedLeaders` in place of its own (before any
    search has begun: the new one starts empty, as the old one was), following only
    leaders that `admits` takes, each dialed by `reach` first."""
    old = matchmaking.potential_leaders
    matchmaking.potential_leaders = PacedLeaders(
        old.peer_id, old.min_matchmaking_time, old.target_group_size, admits=admits, reach=reach
    )
