"""Accusations between replicas of a stage, and when they drop the accused.

A replica accuses a groupmate it caught itself in an outer round (`protocol.control.
Accusation`): a contribution its own reduction rejected as no honest replica sends it
(non-finite, past the norm bounds), or a reducer whose part contradicts what it
acknowledged. One accusation proves nothing (the accuser may lie), so a replica is
dropped only when more than half of the other live replicas of its stage, and at least
two of them, each accused it in `strikes` distinct rounds within `window_s` seconds. A
lying minority cannot drop an honest replica; a stage of two replicas drops nobody (each
could be the liar). Soft state: a restarted coordinator starts counting again.

Bounded: each (accuser, accused) pair keeps its last `4 x strikes` reports, and only
pairs of live replicas of one stage are recorded (the caller checks), so memory grows
with the square of a stage's replica count at most.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container


class Accusations:
    """Reports per accused replica, and the verdict on it."""

    def __init__(self, *, strikes: int, window_s: float) -> None:
        if strikes < 1 or window_s <= 0:
            raise ValueError(f"strikes must be >= 1 and window_s > 0, got {strikes}, {window_s}")
        self.strikes = strikes  # distinct rounds one accuser must report (rounds)
        self.window_s = window_s  # how long a report counts (s)
        # accused -> accuser -> its reports (round, unix seconds), newest last
        self._reports: dict[str, dict[str, deque[tuple[int, float]]]] = {}

    def record(self, accuser: str, accused: str, round_: int, now: float) -> None:
        """`accuser` caught `accused` in its outer round `round_` (both live replicas of
        one stage; the caller checks)."""
        if accuser == accused:
            raise ValueError("a replica cannot accuse itself")
        by = self._reports.setdefault(accused, {})
        got = by.setdefault(accuser, deque(maxlen=4 * self.strikes))
        got.append((round_, now))

    def accusers(self, accused: str, now: float) -> set[str]:
        """Those that accused `accused` in `strikes` distinct rounds within the window."""
        since = now - self.window_s
        return {
            who
            for who, got in self._reports.get(accused, {}).items()
            if len({r for r, t in got if t >= since}) >= self.strikes
        }

    def guilty(self, accused: str, stage: Container[str], replicas: int, now: float) -> bool:
        """Whether to drop `accused`: more than half of the other live replicas of its
        stage (`stage` holds their peer ids and the accused's; `replicas` counts them all,
        the accused included), and at least two, are its `accusers`. Costs the accusers,
        not the stage: the caller passes a view (`coordinator.attest.LiveOn`)."""
        votes = len([p for p in self.accusers(accused, now) if p in stage and p != accused])
        return votes >= 2 and 2 * votes > replicas - 1

    def forget(self, peer_id: str) -> None:
        """A replica that left or was dropped: its reports, and the reports on it."""
        self._reports.pop(peer_id, None)
        for by in self._reports.values():
            by.pop(peer_id, None)
