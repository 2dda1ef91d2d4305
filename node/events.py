"""Structured events of one node: one JSON object per line, for programs.

Log lines are for people and may change wording at any time; benches, chaos and tests
learn what a node did from this file instead (`agora-node --events FILE`). Each line is
`{"t": unix seconds, "event": NAME, ...fields}`. The names and their fields:

- `joined`: `peer_id`, `stage`, `n_stages`, `run_id`
- `forward_failed`: `mb_id`, `peer`, `error`, `kind` (unreachable, timeout, refused,
  bad_reply), `seconds` (the attempt's duration): a micro-batch attempt through `peer` failed
- `forward_rerouted`: `mb_id`, `peer`, `failures`, `seconds` (from its first failure),
  `attempt_s` (the attempt that got through, from its send to the reply): a micro-batch
  that failed before completed through `peer` (stage 0)
- `retry_served`: `mb_id`, `queued_s` (from its arrival until its forward began),
  `held_s` (from its arrival until the reply), `job_s` and `job_cpu_s` (its forward job
  on the torch worker: wall and the thread's CPU): this stage served a retried forward
- `lease_committed`: `lease_id`, `shard_id`, `start`, `end`
- `round_begun`: `tokens` (what this replica's contribution claims: the tokens trained
  since its last round began), `joining` (begun early, to join a forming group)
- `round_applied`: `round`, `group_size`, `tokens`, `seconds`, `rebased`, `contributed`
  (this replica's pseudo-gradient is in the new state with weight > 0), `carried` (that
  contribution also carried the lone rounds since its last group), `joined_early`
  (the round began before `every_steps` to join a replica that was forming a group),
  `digest` (of the state now held), `agreed`, `rejected` (peer id -> why its contribution
  was left out of the group's aggregate)
- `round_not_applied`: `round`, `group_size`, `seconds` (the state did not change)
- `accused`: `peer`, `round`, `reason`: this replica caught a groupmate in its outer round
  (a contribution no honest replica sends, or a reducer that lied) and reports it to the
  coordinator
- `dht_records_refused`: `count`, `round`: records this replica's outer DHT refused to
  store or believe since its last round (unsigned, signed by another peer than the one
  they name, or of a peer not listed on the stage)
- `ranges_returned`: `lease_id`, `shard_id`, `start`, `end` (trained tokens that did not
  reach the stage's global state: the commit rule hands them back to be trained again)
- `dht_move`: `reason`, `root` (peer id, "" when this node is the root), `rounds` (rounds
  applied on the DHT it leaves), `lone_rounds`: the outer loop restarts its outer
  process to join the run's DHT
- `draining`: `reason` (signal, coordinator, deadline, max_tokens, moved, ...)
- `left`: `tokens_trained`, `tokens_committed`

Writing never raises: an event file that cannot be written costs the events, not the node.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

EVENT_NAMES = frozenset(
    {
        "joined",
        "forward_failed",
        "forward_rerouted",
        "retry_served",
        "lease_committed",
        "round_begun",
        "round_applied",
        "round_not_applied",
        "accused",
        "dht_records_refused",
        "ranges_returned",
        "dht_move",
        "draining",
        "left",
    }  # fmt: skip
)


class EventLog:
    """Appends events to a JSON-lines file; with no path it drops them."""

    def __init__(self, path: Path | None = None) -> None:
        self._fh: IO[str] | None = None
        if path is not None:
            self._fh = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered

    def emit(self, event: str, **fields: Any) -> None:
        if event not in EVENT_NAMES:
            raise ValueError(f"unknown event {event!r}; known: {sorted(EVENT_NAMES)}")
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")
        except (OSError, ValueError) as exc:  # a full disk, or a closed file at exit
            log.warning("events: could not write %s: %s", event, exc)
            self._fh = None

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_events(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """Every complete event in `path` (a half-written last line is skipped), optionally
    only those named `event`; [] if the file does not exist yet."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and (event is None or item.get("event") == event):
            out.append(item)
    return out
