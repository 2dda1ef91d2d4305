"""The trials of `agora bench failover` (see `bench.failover` for what is measured and
why): `Bench` runs the swarm, kills one replica per trial, and times the re-route and
the lease re-issue from the coordinator's audit log and status and the nodes' event
files."""

from __future__ import annotations

import argparse
import math
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from coordinator.journal import AuditEvent
from node.coordinator_client import CoordinatorUnavailable
from protocol.identity import NodeKey
from swarmlab.procs import Proc
from swarmlab.swarm import LocalSwarm

STAGES = 2
POLL_S = 0.2  # seconds between polls of the audit log, node events and the coordinator status
TIMES = (  # (JSON key, table label: seconds from the kill to ...)
    ("reroute_detect_seconds", "a request via the victim fails"),
    ("reroute_seconds", "first re-routed micro-batch done"),
    ("reroute_all_seconds", "last re-routed micro-batch done"),
    ("reroute_commit_seconds", "first re-routed micro-batch committed"),
    ("victim_dropped_seconds", "coordinator drops the dead peer"),
    ("lease_expire_seconds", "coordinator expires its lease"),
    ("lease_regrant_seconds", "the range is granted again"),
    ("first_commit_seconds", "first commit on the new lease"),
)
DELTAS = (  # (JSON key, table label: seconds ...)
    ("reroute_after_detection_s", "detection -> first re-routed done"),
    ("regrant_after_expiry_s", "lease expiry -> granted again"),
)
SEND_SLACK_S = 0.002  # seconds of clock rounding between an event's time and its duration


REPLACE_WAIT_S = 45.0  # seconds a replacement may take to get work before it is noted idle


class Interrupted(Exception):
    """A node we did not kill exited: the measurement cannot go on."""


def _audit_since(db: Path, since: float) -> list[AuditEvent]:
    """Audit records with ts >= since, in order (read-only; the coordinator keeps writing)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        rows = conn.execute(
            'SELECT ts, data_epoch, kind, shard_id, lease_id, holder, epoch, start, "end"'
            " FROM audit WHERE ts >= ? ORDER BY seq",
            (since,),
        ).fetchall()
    finally:
        conn.close()
    return [AuditEvent(*r) for r in rows]


def _active_leases(db: Path, holder: str) -> list[tuple[int, int, int]]:
    """(lease_id, shard_id, committed) of the holder's active leases."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(
            "SELECT lease_id, shard_id, committed FROM leases WHERE state = 'active'"
            " AND holder = ?",
            (holder,),
        ).fetchall()
    finally:
        conn.close()


def _family(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def fmt_seconds(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}"


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.t_start = time.monotonic()
        self.swarm = LocalSwarm(
            workdir=workdir, preset=args.preset, stages=STAGES, codec="subspace_int4",
            run_config={
                "run_id": "bench-failover", "heartbeat_interval_s": args.heartbeat,
                "lease_ttl_s": args.lease_ttl, "sweep_interval_s": args.sweep,
                "shard_tokens": args.shard_tokens,
            },
        )  # fmt: skip
        node_toml = self.swarm.write_node_config(outer_every_steps=args.outer_every_steps)
        self.swarm.node_args = ["--config", str(node_toml)]
        self.killed: set[str] = set()
        self.idle_replacements: list[str] = []  # replacements that got no work in time
        self.serial = 0
        self.names: dict[int, list[str]] = {0: [], 1: []}

    # -- plumbing ------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"[failover {time.monotonic() - self.t_start:6.1f}s] {text}", flush=True)

    def add(self, stage: int) -> str:
        name = f"n{self.serial}s{stage}"
        self.serial += 1
        self.swarm.add_node(name, stage)
        self.names[stage].append(name)
        return name

    def peer_id(self, name: str) -> str:
        return NodeKey((self.workdir / f"{name}.key").read_bytes()).peer_id

    def check_alive(self) -> None:
        coord = self.swarm.coordinator
        if coord is not None and not coord.alive():
            raise Interrupted(f"the coordinator exited {coord.popen.returncode}:\n{coord.tail()}")
        for name, proc in self.swarm.nodes.items():
            if name not in self.killed and not proc.alive():
                raise Interrupted(f"node {name} exited {proc.popen.returncode}:\n{proc.tail()}")

    def tokens(self, name: str) -> float:
        return self.swarm.scrape(name).get("agora_node_tokens_total", 0.0)

    def wait_training(self, names: list[str], timeout_s: float) -> None:
        """Until every node of `names` has trained twice since it was first seen training."""
        first: dict[str, float] = {}
        done: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while len(done) < len(names):
            self.check_alive()
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- {n}:\n{self.swarm.nodes[n].tail(8)}" for n in names if n not in done
                )
                raise TimeoutError(f"not training after {timeout_s:.0f}s: {tails}")
            for n in names:
                if n in done:
                    continue
                t = self.tokens(n)
                if t > 0 and n not in first:
                    first[n] = t
                elif n in first and t > first[n]:
                    done.add(n)
            time.sleep(0.5)

    def kill(self, name: str) -> float:
        """SIGKILL a node and its children; returns the kill time (unix seconds)."""
        proc: Proc = self.swarm.nodes[name]
        kids = _family(proc.popen.pid)
        self.killed.add(name)
        t = time.time()
        proc.signal(signal.SIGKILL)
        for pid in kids:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        proc.popen.wait(10)
        self.names[int(proc.stage or 0)].remove(name)
        return t

    def replace(self, stage: int) -> None:
        fresh = self.add(stage)
        self.say(f"started {fresh} on stage {stage}; waiting until it trains")
        try:  # a joiner trains within seconds when it gets traffic (docs/reliability.md)
            self.wait_training([fresh], min(self.args.start_timeout, REPLACE_WAIT_S))
        except TimeoutError as exc:
            # A finding, not a reason to stop: the next trial needs the survivors only.
            self.idle_replacements.append(fresh)
            self.say(f"WARNING: replacement {fresh} got no work in time ({exc})")

    def counters(self, names: list[str]) -> dict[str, float]:
        """Stage 0's retried micro-batches and its micro-batch round trips (sum and count
        of seconds), summed over `names` (Prometheus); a busy node may miss one scrape."""
        keys = {
            "retried": 'agora_node_microbatches_total{result="retried"}',
            "rtt_sum": "agora_node_microbatch_seconds_sum",
            "rtt_count": "agora_node_microbatch_seconds_count",
        }
        total = dict.fromkeys(keys, 0.0)
        for n in names:
            for _ in range(5):
                got = self.swarm.scrape(n, timeout_s=5.0)
                if got:
                    for name, key in keys.items():
                        total[name] += got.get(key, 0.0)
                    break
            else:
                raise TimeoutError(f"cannot scrape the metrics of {n}")
        return total

    def dropped(self, stage: int, before: int) -> bool:
        """The coordinator's status shows fewer than `before` peers on `stage` (the dead
        one was dropped); False if it did not answer in time."""
        try:
            status = self.swarm.status(timeout_s=5.0)
        except (OSError, TimeoutError, trio.TooSlowError, CoordinatorUnavailable):
            return False
        return any(s.stage == stage and s.peers < before for s in status.stages)

    def failures(self, names: list[str], victim: str, since: float) -> list[dict[str, Any]]:
        """Stage-0 micro-batch attempts that failed via `victim` after `since` (their
        `forward_failed` events; a micro-batch id is LEASE.EPOCH.START), with when each
        was sent and when (and through whom) its micro-batch completed afterwards (the
        node's `forward_rerouted` event; None while it has not)."""
        out = []
        for n in names:
            done = {ev["mb_id"]: ev for ev in self.swarm.events(n, "forward_rerouted")}
            for ev in self.swarm.events(n, "forward_failed"):
                if ev["peer"] != victim or ev["t"] < since - 0.5:
                    continue
                lease_id, epoch, start = (int(x) for x in str(ev["mb_id"]).split("."))
                after = done.get(ev["mb_id"])
                if after is not None and after["t"] < ev["t"]:
                    after = None
                out.append(
                    {"node": n, "holder": self.peer_id(n), "t": ev["t"], "lease_id": lease_id,
                     "epoch": epoch, "start": start, "mb_id": ev["mb_id"],
                     "kind": ev.get("kind", ""), "sent_t": ev["t"] - float(ev.get("seconds", 0.0)),
                     "done_t": None if after is None else after["t"],
                     "done_via": None if after is None else after["peer"]}
                )  # fmt: skip
        return out

    @staticmethod
    def sent_after_detection(fails: list[dict[str, Any]]) -> int:
        """Requests a stage-0 node sent to the victim after its own first transport-level
        failure there (the router should send none until the membership shows the victim
        alive: it never does, it is dead)."""
        first: dict[str, float] = {}
        for f in fails:
            if f["kind"] == "unreachable":
                first[f["node"]] = min(first.get(f["node"], f["t"]), f["t"])
        return sum(
            1 for f in fails if f["node"] in first and f["sent_t"] > first[f["node"]] + SEND_SLACK_S
        )

    # -- trials --------------------------------------------------------------------------

    def reroute_trial(self) -> dict[str, Any]:
        victim, survivor = self.names[1][0], self.names[1][1]
        stage0 = list(self.names[0])
        vid = self.peer_id(victim)
        before = self.counters(stage0)
        members = len(self.names[1])  # stage-1 peers the coordinator lists before the kill
        t_kill = self.kill(victim)
        self.say(f"re-route: SIGKILLed stage-1 {victim}; {survivor} survives")
        deadline = time.monotonic() + self.args.trial_timeout
        lapsed = None
        settle = 2 * max(1.0, self.args.heartbeat) + 1.0  # stage-0 membership refreshes
        while True:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"re-route trial: no outcome in {self.args.trial_timeout}s")
            if lapsed is None and self.dropped(1, before=members):
                lapsed = time.time()  # within one poll of the drop
            fails = self.failures(stage0, vid, t_kill)
            done = lapsed is not None and time.time() > lapsed + settle
            if done:
                commits = [
                    e for e in _audit_since(self.swarm.db, t_kill - 1.0) if e.kind == "commit"
                ]
                for f in fails:
                    f["commit_t"] = next(
                        (
                            e.ts
                            for e in commits
                            if e.holder == f["holder"] and e.lease_id == f["lease_id"]
                            and e.start <= f["start"] < e.end and e.ts >= f["t"] - 0.01
                        ),
                        None,
                    )  # fmt: skip
                # the commit rule may hold a commit back for long (module docstring of
                # bench.failover): what committed by now is reported, the rest as None
                if all(f["done_t"] is not None for f in fails):
                    break
            time.sleep(POLL_S)
        retried = self.counters(stage0)["retried"] - before["retried"]
        first_after = None
        if not fails:  # nothing was in flight to the victim nor sent to it before it lapsed
            first_after = min(
                (e.ts for e in _audit_since(self.swarm.db, t_kill) if e.kind == "commit"),
                default=None,
            )
        done_t = [f["done_t"] for f in fails] or ([first_after] if first_after else [])
        commit_t = [f["commit_t"] for f in fails if f["commit_t"] is not None] or (
            [first_after] if first_after else []
        )
        detect = (min(f["t"] for f in fails) - t_kill) if fails else None
        first_done = (min(done_t) - t_kill) if done_t else None
        res: dict[str, Any] = {
            "kind": "reroute",
            "victim": victim,
            "survivor": survivor,
            "kill_time": t_kill,
            "reroute_seconds": first_done,
            "reroute_all_seconds": (max(done_t) - t_kill) if done_t else None,
            "reroute_commit_seconds": (min(commit_t) - t_kill) if commit_t else None,
            "reroute_detect_seconds": detect,
            "reroute_after_detection_s": (
                first_done - detect if first_done is not None and detect is not None else None
            ),
            "victim_dropped_seconds": (lapsed - t_kill) if lapsed is not None else None,
            "retried_microbatches": int(retried),
            # the load: a micro-batch's mean round trip through stage 1 before the kill
            "microbatch_seconds_before_kill": before["rtt_sum"] / before["rtt_count"]
            if before["rtt_count"]
            else None,
            "failed_requests": len(fails),
            "failed_microbatches": len({(f["node"], f["mb_id"]) for f in fails}),
            "failure_kinds": sorted({f["kind"] for f in fails}),
            "sent_after_detection": self.sent_after_detection(fails),
            "rerouted_via_survivor": sum(
                1 for f in fails if f["done_via"] == self.peer_id(survivor)
            ),
            "failures": [  # each failed request via the victim, seconds after the kill
                {
                    "node": f["node"],
                    "microbatch": f["mb_id"],
                    "kind": f["kind"],
                    "sent_s": round(f["sent_t"] - t_kill, 3),
                    "failed_s": round(f["t"] - t_kill, 3),
                    "done_s": round(f["done_t"] - t_kill, 3),
                    "committed_s": None
                    if f["commit_t"] is None
                    else round(f["commit_t"] - t_kill, 3),
                }
                for f in sorted(fails, key=lambda f: f["t"])
            ],
            "signal": "node events forward_failed / forward_rerouted of the micro-batches"
            " that failed via the victim"
            if fails
            else "no request went to the victim; first commit after the kill",
        }
        self.say(
            f"re-route: detected after {fmt_seconds(detect)}s, first re-routed micro-batch"
            f" done after {fmt_seconds(res['reroute_seconds'])}s"
            f" ({fmt_seconds(res['reroute_after_detection_s'])}s after the detection), all"
            f" after {fmt_seconds(res['reroute_all_seconds'])}s; {res['failed_microbatches']}"
            f" micro-batches hit the victim, {int(retried)} retries,"
            f" {res['sent_after_detection']} requests sent to it after the detection;"
            f" coordinator dropped it after {fmt_seconds(res['victim_dropped_seconds'])}s"
        )
        return res

    def lease_trial(self) -> dict[str, Any]:
        db = self.swarm.db
        stage0 = list(self.names[0])
        deadline = time.monotonic() + self.args.trial_timeout
        victim = None
        while victim is None:  # a stage-0 node between two leases holds none for a moment
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("lease trial: no stage-0 node holds a lease")
            victim = next((n for n in stage0 if _active_leases(db, self.peer_id(n))), None)
            if victim is None:
                time.sleep(0.05)
        survivor = next(n for n in stage0 if n != victim)
        vid, sid = self.peer_id(victim), self.peer_id(survivor)
        t_kill = self.kill(victim)
        held = _active_leases(db, vid)
        self.say(f"lease: SIGKILLed stage-0 {victim} holding leases {held}; {survivor} survives")
        expire = grant = commit = None
        while commit is None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"lease trial: expire={expire} grant={grant} commit={commit} after"
                    f" {self.args.trial_timeout}s"
                )
            events = _audit_since(db, t_kill - 1.0)
            if expire is None:
                expire = next((e for e in events if e.kind == "expire" and e.holder == vid), None)
            if expire is not None and grant is None:
                grant = next(
                    (
                        e for e in events
                        if e.kind == "grant" and e.shard_id == expire.shard_id
                        and e.start == expire.start and e.epoch > expire.epoch
                        and e.data_epoch == expire.data_epoch
                    ),
                    None,
                )  # fmt: skip
            if grant is not None:
                commit = next(
                    (e for e in events if e.kind == "commit" and e.lease_id == grant.lease_id),
                    None,
                )
            if commit is None:
                time.sleep(POLL_S)
        assert expire is not None and grant is not None
        res: dict[str, Any] = {
            "kind": "lease",
            "victim": victim,
            "survivor": survivor,
            "kill_time": t_kill,
            "lease_id": expire.lease_id,
            "shard_id": expire.shard_id,
            "offset": expire.start,
            "new_lease_id": grant.lease_id,
            "new_epoch": grant.epoch,
            "regranted_to": "survivor" if grant.holder == sid else grant.holder,
            "lease_expire_seconds": expire.ts - t_kill,
            "lease_regrant_seconds": grant.ts - t_kill,
            "first_commit_seconds": commit.ts - t_kill,
            "regrant_after_expiry_s": grant.ts - expire.ts,
            "leases_held": len(held),
        }
        self.say(
            f"lease: lease {expire.lease_id} (shard {expire.shard_id} @ {expire.start}) expired"
            f" after {res['lease_expire_seconds']:.2f}s, re-granted as lease {grant.lease_id}"
            f" (epoch {grant.epoch}, to the {res['regranted_to']}) after"
            f" {res['lease_regrant_seconds']:.2f}s ({res['regrant_after_expiry_s']:.2f}s after"
            f" the expiry), first commit after"
            f" {res['first_commit_seconds']:.2f}s"
        )
        return res

    # -- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        args = self.args
        self.say("starting the coordinator")
        self.swarm.start_coordinator(timeout_s=args.start_timeout)
        for stage in (0, 0, 1, 1):
            self.add(stage)
        self.say(f"started {', '.join(self.swarm.nodes)}; waiting until all four train")
        self.wait_training(list(self.swarm.nodes), args.start_timeout)
        trials: list[dict[str, Any]] = []
        kinds = ["reroute", "lease"] * args.trials
        for i, kind in enumerate(kinds):
            self.say(f"trial {i // 2 + 1}/{args.trials}: {kind}")
            if kind == "reroute":
                trials.append(self.reroute_trial())
            else:
                trials.append(self.lease_trial())
            if i + 1 < len(kinds):
                self.replace(1 if kind == "reroute" else 0)
                # every node of the next kill's stage, and stage 0, trains again (an idle
                # replacement is already recorded as such)
                names = [n for s in (0, 1) for n in self.names[s]]
                self.wait_training(
                    [n for n in names if n not in self.idle_replacements], args.start_timeout
                )
        self.say("draining the nodes and stopping the coordinator")
        codes = self.swarm.stop_nodes(timeout_s=120.0)
        self.swarm.stop_coordinator()
        bad = {n: c for n, c in codes.items() if n not in self.killed and c != 0}
        self.say("running agora audit")
        audit = self.swarm.audit(self.workdir / "audit.json").summary()
        return {
            "trials": trials, "audit": audit, "exit_codes": codes, "bad_exits": bad,
            "idle_replacements": self.idle_replacements,
        }  # fmt: skip
