"""`agora chaos --hostile`: the chaos swarm under hostile attacks instead of crashes, and
the judgement of what the honest processes experienced meanwhile.

`HostileRun` is a `Run` whose schedule (`hostile_plan`, a pure function of the seed)
plays the attacks of `ATTACKS`, each from a fresh process: the raw-socket ones of
`swarmlab.chaos.raw_attacks`, the member ones of `swarmlab.chaos.member_attacks` and the
flood of the coordinator's circuit relay of `swarmlab.chaos.relay_attacks` (the hostile
swarm's coordinator runs its relay, with a small circuit byte limit; the honest nodes
listen directly and never use it). A
`HeartbeatProbe` (an observer member on its own connection) times a heartbeat every
second and reads the committed tokens from the coordinator's status meanwhile. The
report adds to `Run.finish`'s:

- `attacks`: per attack, how often it was played, its outcome (`defended`,
  `not_defended`, `not_reached`, `error`, `unfinished` (killed past its deadline with
  no result), `mixed` or `not played`) and each play's
  details: the attacker's replies, the heartbeat worst case and commit growth during it,
  and the coordinator's fenced / expired lease counters before and after;
- `heartbeat_max_s` (slowest probe heartbeat, a failed one counted up to its failure),
  `heartbeat_max_gap_s` (longest time between two answered heartbeats), `lease_ttl_s`
  and `heartbeat_ok` (both below the TTL);
- `commits_by_third` (committed tokens gained in each third of the window) and
  `commits_kept_growing`;
- `ok`: no honest process crashed, nothing lost or duplicated, heartbeats within the
  TTL, commits grew in every third. `agora chaos --hostile` exits 0 iff `ok`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from pathlib import Path
from typing import Any

from protocol import control as c
from protocol.identity import NodeKey
from protocol.pinning import parse_address
from swarmlab.chaos.control_wire import Control, code
from swarmlab.chaos.run import Run
from swarmlab.chaos.schedule import LEASE_TTL_S, ChaosConfig, Fault, plan
from swarmlab.procs import REPO, spawn
from swarmlab.swarm import scrape_metrics

log = logging.getLogger("agora.chaos")

RAW = ("bad_addrs", "amplify", "conn_flood", "slow_drip", "stranger_lease", "forged_facility",
       "key_flood", "fat_member")  # fmt: skip
MEMBER = ("poison_backward", "oversized_forward")
RELAY = ("relay_flood",)
ATTACKS = RAW + MEMBER + RELAY
MODULES = {**dict.fromkeys(RAW, "swarmlab.chaos.raw_attacks"),
           **dict.fromkeys(MEMBER, "swarmlab.chaos.member_attacks"),
           **dict.fromkeys(RELAY, "swarmlab.chaos.relay_attacks")}  # fmt: skip
RELAY_CIRCUIT_BYTES = 1 << 20  # the hostile coordinator's relay cuts a circuit past this
ATTACK_GRACE_S = 120.0  # seconds an attacker may take beyond its hold (imports on a busy box)
# seconds the relay flood's burst may take: 50 fresh libp2p peers, one after another, took
# 73 to 141 s on the loaded 2-core box
RELAY_GRACE_S = 300.0
PROBE_EVERY_S = 1.0  # seconds between probe heartbeats
STATUS_EVERY = 2  # probe heartbeats per status read
LEASE_COUNTERS = ("agora_coordinator_fenced_calls_total", "agora_coordinator_expired_leases_total")
EXPIRED = "agora_coordinator_expired_leases_total"  # honest leases lapse only by expiry here


def attack_hold_s(window_s: float) -> float:
    """Seconds a held attack (flood, drip, poisoning member) lasts: a fifth of the window,
    between 5 and 20."""
    return min(20.0, max(5.0, window_s * 0.2))


def hostile_plan(seed: int, window_s: float, cfg: ChaosConfig) -> list[Fault]:
    """Every attack once per shuffled cycle over the first 85% of the window (pure)."""
    hold = attack_hold_s(window_s)
    return [
        Fault(f.at_s, f.kind, f.pick, hold) for f in plan(seed, window_s, cfg, kinds_played=ATTACKS)
    ]


class HeartbeatProbe:
    """An observer member that heartbeats every `PROBE_EVERY_S` on its own connection,
    timing each round trip, and reads committed tokens from the status."""

    def __init__(self, address: str, clock: Any, timeout_s: float = LEASE_TTL_S) -> None:
        parsed = parse_address(address)
        self.host, self.port, self.pin = parsed.host, parsed.port, parsed.pin
        self.clock = clock  # seconds into the window
        self.timeout_s = timeout_s
        self.key = NodeKey.generate()
        self.beats: list[tuple[float, float, bool]] = []  # (t_s, seconds, answered)
        self.progress: list[tuple[float, int, int]] = []  # (t_s, data_epoch, committed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)

    def _loop(self) -> None:
        conn: Control | None = None
        n = 0
        while not self._stop.wait(PROBE_EVERY_S):
            t = self.clock()
            try:
                if conn is None:
                    conn = Control(self.host, self.port, timeout_s=self.timeout_s, pin=self.pin)
                    conn.call(self.key, c.JoinRequest(observer=True))
                reply, took = conn.call(self.key, c.HeartbeatRequest())
                ok = isinstance(reply, c.HeartbeatReply)
                if code(reply) == "not_member":
                    conn.call(self.key, c.JoinRequest(observer=True))
                n += 1
                if n % STATUS_EVERY == 0:
                    status, _ = conn.call(self.key, c.StatusRequest())
                    if isinstance(status, c.StatusReply):
                        self.progress.append(
                            (self.clock(), status.data_epoch, status.committed_tokens)
                        )
            except (OSError, ConnectionError):
                ok, took = False, self.clock() - t
                if conn is not None:
                    conn.close()
                conn = None
            self.beats.append((round(t, 2), round(took, 4), ok))
        if conn is not None:
            try:
                conn.call(self.key, c.LeaveRequest())
            except (OSError, ConnectionError):
                pass
            conn.close()

    def worst(self, a: float, b: float) -> float:
        """The slowest heartbeat started in [a, b]."""
        return max((s for t, s, _ in self.beats if a <= t <= b), default=0.0)

    def max_gap(self, end: float) -> float:
        """The longest time between two answered heartbeats (or the last one and `end`)."""
        answered = [t + s for t, s, ok in self.beats if ok]
        if not answered:
            return end
        gaps = [b - a for a, b in zip(answered, answered[1:], strict=False)]
        return max([*gaps, end - answered[-1]])

    def committed_at(self, t: float) -> tuple[int, int] | None:
        """(data epoch, committed tokens) of the last status read at or before `t`."""
        seen = [(e, n) for s, e, n in self.progress if s <= t]
        return seen[-1] if seen else None

    def grew(self, a: float, b: float) -> bool:
        start = self.committed_at(a) or (self.progress[0][1:] if self.progress else None)
        end = self.committed_at(b)
        return start is not None and end is not None and end > start


class HostileRun(Run):
    """The chaos swarm under the hostile schedule."""

    def __init__(self, cfg: ChaosConfig, name: str, faults: list[Fault]) -> None:
        super().__init__(cfg, name, faults)
        self.swarm.metrics = True  # the lease counters come from the coordinator's metrics
        self.swarm.run_config.update(relay=True, relay_circuit_bytes=RELAY_CIRCUIT_BYTES)
        self.counts = {k: 0 for k in ATTACKS}
        self.skipped = {k: 0 for k in ATTACKS}
        self.plays: list[dict[str, Any]] = []
        self.probe: HeartbeatProbe | None = None

    def start(self) -> None:
        super().start()
        self.probe = HeartbeatProbe(self.swarm.address, self.now)
        self.probe.start()

    def _lease_counters(self) -> dict[str, float]:
        coord = self.swarm.coordinator
        if coord is None or coord.metrics_port is None:
            return {}
        scraped = scrape_metrics(f"127.0.0.1:{coord.metrics_port}")
        return {k: scraped.get(k, 0.0) for k in LEASE_COUNTERS}

    def _victim(self, pick: float) -> str:
        stage1 = sorted(n for n, s in self.healthy().items() if s == 1)
        if not stage1:
            return ""
        name = stage1[int(pick * len(stage1))]
        return NodeKey((self.workdir / f"{name}.key").read_bytes()).peer_id

    def inject(self, f: Fault) -> None:
        with self.lock:
            self.serial += 1
            out = self.workdir / f"attack{self.serial}-{f.kind}.json"
        args = ["-m", MODULES[f.kind], "--coordinator", self.swarm.address, "--attack", f.kind,
                "--json", str(out)]  # fmt: skip
        if f.kind not in RELAY:  # the relay flood is one burst
            args += ["--hold", str(f.hold_s)]
        coord = self.swarm.coordinator
        if f.kind == "stranger_lease" and coord is not None and coord.metrics_port:
            args += ["--coordinator-metrics", f"127.0.0.1:{coord.metrics_port}"]
        if f.kind == "oversized_forward":
            victim = self._victim(f.pick)
            if not victim:
                self.skip(f.kind, why="no healthy stage-1 node")
                return
            args += ["--victim", victim]
        if f.kind == "relay_flood":
            args += ["--circuit-bytes", str(RELAY_CIRCUIT_BYTES)]
        before = self._lease_counters()
        started = self.now()
        popen = spawn(out.with_suffix(".log"), args, cwd=REPO)
        with self.lock:
            self.counts[f.kind] += 1
        self.note("attack", attack=f.kind)
        try:
            popen.wait(f.hold_s + (RELAY_GRACE_S if f.kind in RELAY else ATTACK_GRACE_S))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)
            killed = True
        else:
            killed = False
        ended = self.now()
        result = _read(out)
        after = self._lease_counters()
        probe = self.probe
        play = {
            "attack": f.kind, "started_s": round(started, 1), "ended_s": round(ended, 1),
            "exit": popen.returncode, "killed_past_deadline": killed, "result": result,
            "lease_counters_delta": {k: after[k] - before.get(k, 0.0) for k in after},
            "heartbeat_max_s": probe.worst(started, ended) if probe else None,
            "commits_grew": probe.grew(started, ended) if probe else None,
        }  # fmt: skip
        play["outcome"] = judge(f.kind, play)
        with self.lock:
            self.plays.append(play)
        self.note("attack_done", attack=f.kind, outcome=play["outcome"])

    def finish(self) -> dict[str, Any]:
        window = self.cfg.minutes * 60
        probe = self.probe
        end = self.now()
        if probe is not None:
            probe.stop()
        report = super().finish()
        ttl = LEASE_TTL_S
        beat_max = max((s for _, s, _ in probe.beats), default=0.0) if probe else None
        gap = probe.max_gap(end) if probe else None
        thirds = [(window * i / 3, window * (i + 1) / 3) for i in range(3)]
        gained = []
        for a, b in thirds:
            x, y = (probe.committed_at(a), probe.committed_at(b)) if probe else (None, None)
            if x is None and probe and probe.progress:
                x = probe.progress[0][1:]
            gained.append(
                None if x is None or y is None else y[1] - x[1] if y[0] == x[0] else "new epoch"
            )
        report.update(
            hostile=True,
            attacks=summarize(self.plays),
            heartbeat_max_s=beat_max,
            heartbeat_max_gap_s=None if gap is None else round(gap, 2),
            heartbeats=len(probe.beats) if probe else 0,
            heartbeats_failed=sum(1 for b in probe.beats if not b[2]) if probe else 0,
            lease_ttl_s=ttl,
            commits_by_third=gained,
            commits_kept_growing=probe is not None and all(probe.grew(a, b) for a, b in thirds),
        )
        report["heartbeat_ok"] = (
            beat_max is not None and gap is not None and beat_max < ttl and gap < ttl
        )
        report["ok"] = hostile_ok(report)
        return report


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"error": f"no result: {type(exc).__name__}", "defended": None}
    return data if isinstance(data, dict) else {"error": "bad result", "defended": None}


def judge(kind: str, play: dict[str, Any]) -> str:
    """One play's outcome from the attacker's replies and the honest side: `defended`
    needs the attacker to have got the defended answer and, for lease calls, no honest
    lease expired meanwhile (with no crashes in the run, an honest lease is fenced only
    by expiring)."""
    result = play["result"]
    if result.get("error") and play.get("killed_past_deadline"):
        return "unfinished"  # the attacker outlived its deadline: nothing to judge
    if result.get("error"):
        return "error"
    defended = result.get("defended")
    if defended is None:
        return "not_reached"
    if kind == "stranger_lease" and play["lease_counters_delta"].get(EXPIRED, 0) > 0:
        return "not_defended"
    return "defended" if defended else "not_defended"


def summarize(plays: list[dict[str, Any]]) -> dict[str, Any]:
    """Per attack: times played, the outcome over its plays, and the plays."""
    out: dict[str, Any] = {}
    for kind in ATTACKS:
        mine = [p for p in plays if p["attack"] == kind]
        outcomes = sorted({p["outcome"] for p in mine})
        outcome = outcomes[0] if len(outcomes) == 1 else ("mixed" if outcomes else "not played")
        out[kind] = {"played": len(mine), "outcome": outcome, "plays": mine}
    return out


def hostile_ok(report: dict[str, Any]) -> bool:
    return (
        not report["crashed"]
        and report["lost_ranges"] == 0
        and report["duplicated_ranges"] == 0
        and bool(report["heartbeat_ok"])
        and bool(report["commits_kept_growing"])
    )
