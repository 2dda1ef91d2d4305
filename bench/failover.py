"""`agora bench failover`: time from a peer's death to its traffic being re-routed and to
its data lease being re-issued, on real processes.

A real coordinator (its SQLite file, its sweeper) and 2 stages x 2 replicas of real
nodes (py-libp2p on loopback, `LocalSwarm`), tiny preset. The coordinator runs with a
short lease TTL, heartbeat and sweep interval (flags; the operator defaults are printed
alongside) so that the numbers are about the mechanism, not about waiting. The nodes run
without the DiLoCo outer loop by default (`--outer-every-steps 0`): a finished
micro-batch is then committed at once, so every micro-batch's completion is a
timestamped `commit` record in the coordinator's audit log. With the outer loop on,
commits wait for the outer round that covers them and `first_commit` grows by up to a
round.

Each trial is one SIGKILL on a swarm that trains steadily with all four nodes; the dead
node is replaced by a fresh node on its stage, which must train before the next kill
(not after the last one). Trial kinds, alternating:

1. **re-route** (a stage-1 replica dies). Stage 0 learns it when a request through the
   victim fails: stage 0 writes a `forward_failed` event naming the micro-batch and the
   victim (its event file, unix time), the
   micro-batch is retried through the other replica after a 0.5 s back-off, and the
   victim is banned in the router. `reroute_seconds` is kill -> the commit of the first
   such re-routed micro-batch (it completed through the survivor: the victim is dead);
   `reroute_all_seconds` the same for the last of them. Both come from the audit log
   (`commit` records carry the coordinator's `time.time()`; a commit covers the
   micro-batch's range once every earlier micro-batch of the lease is done too, so
   this is an upper bound on completion, by one commit round trip, a few ms here).
   `retried_microbatches` is the rise of stage 0's `agora_node_microbatches_total
   {result="retried"}` (Prometheus) from just before the kill to after the coordinator
   dropped the victim from the membership (its peer TTL) and the stage-0 nodes
   refreshed their view: until then the router tries the dead peer again each time its
   ban (2 s, doubling) runs out.
2. **lease re-issue** (a stage-0 replica holding a lease dies). From the audit log:
   kill -> the `expire` record of its lease (`lease_expire_seconds`), -> the `grant` of
   the same shard from the same committed offset at a higher fencing epoch
   (`lease_regrant_seconds`), -> the first `commit` on that new lease
   (`first_commit_seconds`). The expiry is bounded by [TTL - heartbeat interval,
   TTL + sweep interval] after the kill (the lease was last renewed by the victim's last
   heartbeat, and the sweeper runs every `sweep_interval_s`). The re-grant is pull-based:
   it happens when a stage-0 peer asks for work, i.e. when the survivor has finished
   its current lease (a stage-0 node trains one lease at a time; a lease is the rest of a
   shard). That is why the bench uses small shards (`--shard-tokens`); with the default
   262,144-token shards the expired range waits for a fresh node or for the survivor's
   whole shard (a shard re-queued after a partial grant goes to the front of the queue,
   so a survivor would get its own shard back first).

Times are wall-clock seconds measured by this process (kill) and by the coordinator
and nodes (audit records, node events, the coordinator's log) on the same machine. At the end every node is drained,
the coordinator stopped and `agora audit` replays the lease log: lost and duplicated
ranges must be 0. Exit 0 iff every trial measured and the audit is clean.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from coordinator.config import CoordinatorConfig
from coordinator.journal import AuditEvent
from node.config import NodeConfig
from node.routing import Router
from protocol.identity import NodeKey
from swarmlab.procs import Proc, workdir_path
from swarmlab.swarm import LocalSwarm

STAGES = 2
POLL_S = 0.2  # seconds between polls of the audit log, node events and the coordinator log
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")  # coordinator log
TIMES = (  # (JSON key, table label: seconds from the kill to ...)
    ("reroute_detect_seconds", "a request via the victim fails"),
    ("reroute_seconds", "first re-routed micro-batch done"),
    ("reroute_all_seconds", "last re-routed micro-batch done"),
    ("victim_dropped_seconds", "coordinator drops the dead peer"),
    ("lease_expire_seconds", "coordinator expires its lease"),
    ("lease_regrant_seconds", "the range is granted again"),
    ("first_commit_seconds", "first commit on the new lease"),
)


REPLACE_WAIT_S = 45.0  # seconds a replacement may take to get work before it is noted idle


class Interrupted(Exception):
    """A node we did not kill exited: the measurement cannot go on."""


def _parser() -> argparse.ArgumentParser:
    op = CoordinatorConfig()
    nd = NodeConfig(coordinator="127.0.0.1:1")
    p = argparse.ArgumentParser(
        prog="agora bench failover",
        description="SIGKILL peers of a local swarm (coordinator + 2 stages x 2 replicas) and"
        " measure the time to re-route their traffic (stage-1 victim) and to re-issue their"
        " data lease (stage-0 victim), from node logs and the coordinator's audit log; then"
        " check with `agora audit` that no range was lost or duplicated.",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--trials", type=int, default=3, help="kills of each kind (default 3)")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument(
        "--lease-ttl", type=float, default=5.0,
        help=f"coordinator lease/peer TTL, s (default 5; operator default {op.lease_ttl_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--heartbeat", type=float, default=1.0,
        help="heartbeat interval, s (default 1; operator default"
        f" {op.heartbeat_interval_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--sweep", type=float, default=0.5,
        help=f"expiry sweep interval, s (default 0.5; operator default {op.sweep_interval_s:g})",
    )  # fmt: skip
    p.add_argument(
        "--shard-tokens", type=int, default=8192,
        help="tokens per shard = per lease (default 8192, 8 micro-batches; operator default"
        f" {op.shard_tokens})",
    )  # fmt: skip
    p.add_argument(
        "--outer-every-steps", type=int, default=0,
        help="nodes' inner steps per DiLoCo round (default 0: off, commits per micro-batch;"
        f" node default {nd.outer_every_steps})",
    )  # fmt: skip
    p.add_argument(
        "--workdir",
        type=workdir_path,
        default=None,
        help="logs and the coordinator DB (default: temp)",
    )
    p.add_argument(
        "--start-timeout", type=float, default=240.0,
        help="seconds for nodes to start training (torch import on a loaded box)",
    )  # fmt: skip
    p.add_argument("--trial-timeout", type=float, default=120.0, help="seconds one trial may take")
    return p


# --- helpers ---------------------------------------------------------------------------


def _log_time(line: str) -> float | None:
    m = _LOG_TIME.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


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


def _summary(values: list[float]) -> dict[str, float] | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    return {
        "min": round(min(vals), 3),
        "median": round(statistics.median(vals), 3),
        "max": round(max(vals), 3),
    }


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

    def retried(self, names: list[str]) -> float:
        """Stage 0's retried micro-batches (Prometheus); a busy node may miss one scrape."""
        key = 'agora_node_microbatches_total{result="retried"}'
        total = 0.0
        for n in names:
            for _ in range(5):
                got = self.swarm.scrape(n, timeout_s=5.0)
                if got:
                    total += got.get(key, 0.0)
                    break
            else:
                raise TimeoutError(f"cannot scrape the metrics of {n}")
        return total

    def lapsed_at(self, peer: str, since: float) -> float | None:
        """When the coordinator logged the peer as lapsed (after `since`), from its log."""
        coord = self.swarm.coordinator
        assert coord is not None
        needle = f"peer {peer} lapsed"
        for line in coord.log.read_text(errors="replace").splitlines():
            if needle in line and (t := _log_time(line)) is not None and t >= since - 1.0:
                return t
        return None

    def failures(self, names: list[str], victim: str, since: float) -> list[dict[str, Any]]:
        """Stage-0 micro-batches that failed via `victim` after `since` (their
        `forward_failed` events; a micro-batch id is LEASE.EPOCH.START)."""
        out = []
        for n in names:
            for ev in self.swarm.events(n, "forward_failed"):
                if ev["peer"] != victim or ev["t"] < since - 0.5:
                    continue
                lease_id, epoch, start = (int(x) for x in str(ev["mb_id"]).split("."))
                out.append(
                    {"node": n, "holder": self.peer_id(n), "t": ev["t"], "lease_id": lease_id,
                     "epoch": epoch, "start": start}
                )  # fmt: skip
        return out

    # -- trials --------------------------------------------------------------------------

    def reroute_trial(self) -> dict[str, Any]:
        victim, survivor = self.names[1][0], self.names[1][1]
        stage0 = list(self.names[0])
        vid = self.peer_id(victim)
        before = self.retried(stage0)
        t_kill = self.kill(victim)
        self.say(f"re-route: SIGKILLed stage-1 {victim}; {survivor} survives")
        deadline = time.monotonic() + self.args.trial_timeout
        lapsed = None
        settle = 2 * max(1.0, self.args.heartbeat) + 1.0  # stage-0 membership refreshes
        while True:
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"re-route trial: no outcome in {self.args.trial_timeout}s")
            if lapsed is None:
                lapsed = self.lapsed_at(vid, t_kill)
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
                if all(f["commit_t"] is not None for f in fails):
                    break
            time.sleep(POLL_S)
        retried = self.retried(stage0) - before
        first_after = None
        if not fails:  # nothing was in flight to the victim nor sent to it before it lapsed
            first_after = min(
                (e.ts for e in _audit_since(self.swarm.db, t_kill) if e.kind == "commit"),
                default=None,
            )
        done_t = [f["commit_t"] for f in fails] or ([first_after] if first_after else [])
        res: dict[str, Any] = {
            "kind": "reroute",
            "victim": victim,
            "survivor": survivor,
            "kill_time": t_kill,
            "reroute_seconds": (min(done_t) - t_kill) if done_t else None,
            "reroute_all_seconds": (max(done_t) - t_kill) if done_t else None,
            "reroute_detect_seconds": (min(f["t"] for f in fails) - t_kill) if fails else None,
            "victim_dropped_seconds": (lapsed - t_kill) if lapsed is not None else None,
            "retried_microbatches": int(retried),
            "failed_requests": len(fails),
            "failed_microbatches": len({(f["lease_id"], f["start"]) for f in fails}),
            "failures": [  # each failed request via the victim, seconds after the kill
                {
                    "node": f["node"],
                    "microbatch": f"{f['lease_id']}.{f['epoch']}.{f['start']}",
                    "failed_s": round(f["t"] - t_kill, 3),
                    "committed_s": round(f["commit_t"] - t_kill, 3),
                }
                for f in sorted(fails, key=lambda f: f["t"])
            ],
            "signal": "audit commit of re-routed micro-batches"
            if fails
            else "no request went to the victim; first commit after the kill",
        }
        self.say(
            f"re-route: first re-routed micro-batch done after {_fmt(res['reroute_seconds'])}s,"
            f" all after {_fmt(res['reroute_all_seconds'])}s; {res['failed_microbatches']}"
            f" micro-batches hit the victim, {int(retried)} retries; coordinator dropped it"
            f" after {_fmt(res['victim_dropped_seconds'])}s"
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
        }
        self.say(
            f"lease: lease {expire.lease_id} (shard {expire.shard_id} @ {expire.start}) expired"
            f" after {res['lease_expire_seconds']:.2f}s, re-granted as lease {grant.lease_id}"
            f" (epoch {grant.epoch}, to the {res['regranted_to']}) after"
            f" {res['lease_regrant_seconds']:.2f}s, first commit after"
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


def _fmt(v: float | None) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.2f}"


def build_report(args: argparse.Namespace, workdir: Path, got: dict[str, Any]) -> dict[str, Any]:
    op = CoordinatorConfig()
    nd = NodeConfig(coordinator="127.0.0.1:1")
    router = Router()
    trials = got["trials"]
    out: dict[str, Any] = {}
    for key, _ in TIMES:
        out[key] = [round(t[key], 3) for t in trials if key in t and t[key] is not None]
    out["retried_microbatches"] = [
        t["retried_microbatches"] for t in trials if "reroute" == t["kind"]
    ]
    out["regranted_to"] = [t["regranted_to"] for t in trials if t["kind"] == "lease"]
    out["idle_replacements"] = got["idle_replacements"]
    out["lost_ranges"] = got["audit"]["lost_ranges"]
    out["duplicated_ranges"] = got["audit"]["duplicated_ranges"]
    out["summary"] = {k: _summary(out[k]) for k, _ in TIMES}
    out["summary"]["retried_microbatches"] = _summary(
        [float(x) for x in out["retried_microbatches"]]
    )
    out["bounds"] = {
        "lease_expire_seconds": [
            round(args.lease_ttl - args.heartbeat, 3),
            round(args.lease_ttl + args.sweep, 3),
        ],
        "lease_expire_why": "the lease was last renewed by the victim's last heartbeat (at most"
        " one interval before the kill) and lapses TTL later; the sweeper notices within one"
        " sweep interval",
        "lease_regrant_why": "pull-based: granted when a stage-0 peer asks for work, i.e. when"
        " the survivor finishes its current lease (at most shard_tokens of training) or a new"
        " node joins",
        "first_commit_why": "the new holder's first micro-batch through the pipeline plus a"
        " commit round trip (outer loop off; with it on, the next outer round)",
        "victim_dropped_seconds": [
            round(args.lease_ttl - args.heartbeat, 3),
            round(args.lease_ttl + args.sweep, 3),
        ],
    }
    out["signals"] = {
        "kill": "time.time() in the bench just before SIGKILL",
        "reroute": "stage-0 node event forward_failed via <victim> names the micro-batch; its"
        " range's `commit` record in the coordinator's audit log (SQLite, time.time() at the"
        " coordinator) is its completion through the survivor (an upper bound by one commit"
        " round trip)",
        "retried": 'stage-0 Prometheus agora_node_microbatches_total{result="retried"},'
        " scraped before the kill and after the victim left every stage-0 view",
        "victim_dropped": "coordinator log 'peer <id> lapsed' (ms)",
        "lease": "audit records expire / grant (same shard and offset, higher epoch) / first"
        " commit on the new lease, coordinator time.time()",
    }
    out["settings"] = {
        "preset": args.preset,
        "stages": STAGES,
        "replicas": 2,
        "trials": args.trials,
        "lease_ttl_s": args.lease_ttl,
        "heartbeat_interval_s": args.heartbeat,
        "sweep_interval_s": args.sweep,
        "shard_tokens": args.shard_tokens,
        "outer_every_steps": args.outer_every_steps,
        "micro_batch": nd.micro_batch,
        "seq_len": nd.seq_len,
        "in_flight": nd.in_flight,
        "request_timeout_s": nd.request_timeout_s,
        "retry_backoff_s": 0.5,
        "ban_base_s": router.ban_base_s,
        "poll_interval_s": POLL_S,
        "operator_defaults": {
            "lease_ttl_s": op.lease_ttl_s,
            "heartbeat_interval_s": op.heartbeat_interval_s,
            "sweep_interval_s": op.sweep_interval_s,
            "shard_tokens": op.shard_tokens,
            "outer_every_steps": nd.outer_every_steps,
        },
    }
    out["trials"] = trials
    out["audit"] = got["audit"]
    out["bad_exits"] = got["bad_exits"]
    out["workdir"] = str(workdir)
    return out


def print_report(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(100, Console().width))
    s = out["settings"]
    op = s["operator_defaults"]
    st = Table(title="failover settings (bench value / operator default)")
    st.add_column("setting")
    st.add_column("bench", justify="right")
    st.add_column("operator default", justify="right")
    for key in ("lease_ttl_s", "heartbeat_interval_s", "sweep_interval_s", "shard_tokens",
                "outer_every_steps"):  # fmt: skip
        st.add_row(key, f"{s[key]:g}", f"{op[key]:g}")
    console.print(st)
    t = Table(title=f"failover ({s['preset']}, 2 stages x 2 replicas, {s['trials']} trials each)")
    t.add_column("seconds from the kill to")
    t.add_column("n", justify="right")
    t.add_column("min s", justify="right")
    t.add_column("median s", justify="right")
    t.add_column("max s", justify="right")
    t.add_column("context")
    bounds = out["bounds"]
    ctx = {
        "lease_expire_seconds": f"TTL {s['lease_ttl_s']:g}: in"
        f" [{bounds['lease_expire_seconds'][0]:g}, {bounds['lease_expire_seconds'][1]:g}]",
        "victim_dropped_seconds": f"TTL {s['lease_ttl_s']:g}, sweep {s['sweep_interval_s']:g}",
        "lease_regrant_seconds": "+ survivor's lease",
        "first_commit_seconds": "+ one micro-batch",
        "reroute_seconds": "incl. 0.5 s back-off",
        "reroute_detect_seconds": "stage-1 replica killed",
    }
    for key, label in TIMES:
        sm = out["summary"].get(key)
        n = len(out[key])
        if sm is None:
            t.add_row(label, str(n), "-", "-", "-", ctx.get(key, ""))
        else:
            t.add_row(label, str(n), f"{sm['min']:.2f}", f"{sm['median']:.2f}",
                      f"{sm['max']:.2f}", ctx.get(key, ""))  # fmt: skip
    sm = out["summary"]["retried_microbatches"]
    if sm is not None:
        t.add_row("(micro-batches retried)", str(len(out["retried_microbatches"])),
                  f"{sm['min']:g}", f"{sm['median']:g}", f"{sm['max']:g}", "count, not s")  # fmt: skip
    console.print(t)
    console.print(
        f"agora audit: lost {out['lost_ranges']}, duplicated {out['duplicated_ranges']} ranges;"
        f" re-granted to: {', '.join(out['regranted_to']) or '-'}; logs in {out['workdir']}"
    )


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.trials < 1:
        print("agora bench failover: --trials must be >= 1", file=sys.stderr)
        return 2
    try:
        CoordinatorConfig(
            lease_ttl_s=args.lease_ttl, heartbeat_interval_s=args.heartbeat,
            sweep_interval_s=args.sweep, shard_tokens=args.shard_tokens,
        )  # fmt: skip
    except ValueError as exc:
        print(f"agora bench failover: {exc}", file=sys.stderr)
        return 2
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="agora-failover-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(args, workdir)
    op = CoordinatorConfig()
    bench.say(
        f"settings: lease TTL {args.lease_ttl:g}s (operator default {op.lease_ttl_s:g}),"
        f" heartbeat {args.heartbeat:g}s ({op.heartbeat_interval_s:g}), sweep {args.sweep:g}s"
        f" ({op.sweep_interval_s:g}), shard {args.shard_tokens} tokens ({op.shard_tokens}),"
        f" outer every {args.outer_every_steps} steps; {args.trials} trials of each kind;"
        f" logs in {workdir}"
    )
    try:
        got = bench.run()
    except KeyboardInterrupt:
        print("agora bench failover: interrupted; swarm killed", file=sys.stderr)
        return 130
    except (TimeoutError, Interrupted) as exc:
        print(f"agora bench failover: {exc}", file=sys.stderr)
        return 1
    finally:
        bench.swarm.kill_all()
    out = build_report(args, workdir, got)
    out["seconds_total"] = round(time.monotonic() - bench.t_start, 1)
    print_report(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    ok = (
        not out["lost_ranges"]
        and not out["duplicated_ranges"]
        and not out["bad_exits"]
        and all(len(out[k]) == args.trials for k in ("reroute_seconds", "lease_expire_seconds",
                                                     "lease_regrant_seconds", "first_commit_seconds"))
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
