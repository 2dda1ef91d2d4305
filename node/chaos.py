"""`agora chaos`: run a local swarm, inject a seeded schedule of faults, and check the
promise: training goes on, the audit finds no lost or duplicated range, and no honest
process crashes or grows without bound.

A run is a coordinator and 2 stages x 2 replicas (`LocalSwarm`, real processes on
loopback). After all four nodes train, the fault window of `--minutes` starts; the
schedule (`plan`) is a pure function of the seed: fault kinds come in shuffled cycles
(every kind once per cycle) at jittered, evenly spaced times in the first 85% of the
window, so the last part shows recovery. Kinds:

- `kill_node`: SIGKILL of a random trained node, replaced at once by a fresh node on
  the same stage;
- `zombie`: SIGSTOP of a node for the lease TTL plus a few seconds, then SIGCONT: its
  leases are fenced and it must re-join;
- `kill_coordinator`: SIGKILL of the coordinator, restart on the same port and DB;
- `cut_stream`: a rogue member cuts forward streams mid-message (EOF, reset);
- `rogue`: a rogue peer (`node.chaos_rogue`): non-member request, garbage, NaN, Inf,
  wrong shape, a frame claiming 2 GiB, thousands of streams, replayed / unsigned /
  forged / stale coordinator requests;
- `join_mid_round`: a fresh node joins, timed from the observed outer-round cadence to
  land while a round is under way.

Victims are drawn with the seeded generator among nodes that have trained and whose
stage keeps another healthy replica (so the run measures recovery, not a dead stage);
a fault with no eligible victim is counted as skipped. Then every node is drained
(SIGINT), the coordinator stopped, and `agora audit` replays the lease log. The same
seed without faults gives the comparison loss (`--baseline sequential|concurrent|none`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from node.swarm import LocalSwarm, Proc, child_env, workdir_path
from protocol.identity import NodeKey

log = logging.getLogger("agora.chaos")

KINDS = ("kill_node", "zombie", "kill_coordinator", "cut_stream", "rogue", "join_mid_round")
LEASE_TTL_S = 10.0  # the LocalSwarm run's lease TTL (run.toml), seconds
RESTART_TIMEOUT_S = 240.0  # seconds a restarted coordinator may take to serve (loaded box)
SAMPLE_S = 3.0  # seconds between loss / RSS / liveness samples
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(kw_only=True, slots=True)
class ChaosConfig:
    minutes: float  # length of the fault window (training time measured), minutes
    seed: int = 0  # schedule seed
    preset: str = "tiny"  # model preset
    outer_every_steps: int = 10  # inner steps between DiLoCo rounds (0 = no outer loop)
    fault_every_s: float = 45.0  # mean seconds between faults
    zombie_extra_s: float = 5.0  # seconds a zombie stays stopped past the lease TTL
    coordinator_down_s: float = 3.0  # seconds the coordinator stays dead
    start_timeout_s: float = 300.0  # seconds for the first four nodes to train
    stop_timeout_s: float = 120.0  # seconds for the final drain
    baseline: str = "sequential"  # fault-free comparison: sequential | concurrent | none
    workdir: Path = Path("chaos-out")  # logs, DBs and per-run files

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.fault_every_s <= 0:
            raise ValueError(f"fault_every_s must be positive, got {self.fault_every_s}")
        if self.baseline not in ("sequential", "concurrent", "none"):
            raise ValueError(
                f"baseline must be sequential, concurrent or none, not {self.baseline}"
            )
        if self.outer_every_steps < 0:
            raise ValueError("outer_every_steps must be >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds into the fault window
    kind: str  # one of KINDS
    pick: float  # uniform [0, 1): which eligible victim / stage
    hold_s: float  # seconds of SIGSTOP (zombie) or of coordinator downtime


def plan(seed: int, window_s: float, cfg: ChaosConfig) -> list[Fault]:
    """The fault schedule of a seed: pure, so the same seed gives the same schedule."""
    rng = random.Random(seed)
    n = max(len(KINDS), round(window_s * 0.85 / cfg.fault_every_s))
    kinds: list[str] = []
    while len(kinds) < n:
        cycle = list(KINDS)
        rng.shuffle(cycle)
        kinds += cycle
    kinds = kinds[:n]
    span = window_s * 0.85
    step = span / n
    faults = []
    for i, kind in enumerate(kinds):
        at = step * i + rng.uniform(0.1, 0.9) * step
        hold = (
            LEASE_TTL_S + cfg.zombie_extra_s + rng.uniform(0, 3)
            if kind == "zombie"
            else cfg.coordinator_down_s * rng.uniform(0.5, 1.5)
        )
        faults.append(Fault(round(at, 2), kind, rng.random(), round(hold, 2)))
    return faults


class Run:
    """One swarm under one schedule (empty for the fault-free run)."""

    def __init__(self, cfg: ChaosConfig, name: str, faults: list[Fault]) -> None:
        self.cfg = cfg
        self.name = name
        self.faults = faults
        self.rng = random.Random(f"{cfg.seed}-{name}-victims")
        self.workdir = cfg.workdir / name
        self.swarm = LocalSwarm(
            workdir=self.workdir,
            preset=cfg.preset,
            stages=2,
            node_args=["--outer-every-steps", str(cfg.outer_every_steps)],
        )
        self.lock = threading.RLock()
        self.coordinator_busy = threading.Lock()  # held during a coordinator kill+restart
        self.killed: set[str] = set()  # processes we SIGKILLed (not crashes)
        self.stopped: set[str] = set()  # nodes currently SIGSTOPped
        self.crashed: dict[str, str] = {}  # name -> why (exit code, log tail)
        self.coordinator_generation = 0
        self.counts: dict[str, int] = {k: 0 for k in KINDS}
        self.skipped: dict[str, int] = {k: 0 for k in KINDS}
        self.events: list[dict[str, Any]] = []
        self.rogue_results: list[dict[str, Any]] = []
        self.rogue_procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.rss_peak: dict[str, float] = {}  # process label -> peak MB (VmHWM)
        self.curve: list[dict[str, float]] = []  # t_s, loss, committed tokens
        self.t0 = 0.0
        self.serial = 0
        self._stop_sampling = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- helpers ------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, kind: str, **detail: Any) -> None:
        with self.lock:
            self.events.append({"t_s": round(self.now(), 1), "kind": kind, **detail})
        log.info("[%s] %6.1fs %s %s", self.name, self.now(), kind, detail)

    def new_node(self, stage: int, prefix: str) -> Proc:
        with self.lock:
            self.serial += 1
            name = f"{prefix}{self.serial}s{stage}"
            return self.swarm.add_node(name, stage)

    def trained(self, name: str) -> bool:
        scraped = self.swarm.scrape(name)
        return (
            scraped.get("agora_node_tokens_total", 0.0) > 0
            or scraped.get("agora_p2p_served_total", 0.0) > 0
        )

    def healthy(self) -> dict[str, int]:
        """Live, running (not stopped) nodes that have trained: name -> stage."""
        with self.lock:
            cands = [
                (n, p)
                for n, p in self.swarm.nodes.items()
                if p.alive() and n not in self.stopped and n not in self.killed
            ]
        return {n: int(p.stage or 0) for n, p in cands if self.trained(n)}

    def victim(self, pick: float) -> str | None:
        healthy = self.healthy()
        per_stage: dict[int, int] = {}
        for s in healthy.values():
            per_stage[s] = per_stage.get(s, 0) + 1
        eligible = sorted(n for n, s in healthy.items() if per_stage[s] >= 2)
        if not eligible:
            return None
        return eligible[int(pick * len(eligible))]

    # --- sampling -----------------------------------------------------------------------

    def _sample_rss(self) -> None:
        with self.lock:
            procs = list(self.swarm.nodes.items())
            if self.swarm.coordinator is not None:
                procs.append((f"coordinator#{self.coordinator_generation}", self.swarm.coordinator))
        for name, proc in procs:
            if not proc.alive():
                continue
            try:
                root = psutil.Process(proc.popen.pid)
                family = [(name, root)] + [
                    (f"{name}/{_pname(ch)}:{ch.pid}", ch) for ch in root.children(recursive=True)
                ]
            except psutil.Error:
                continue
            for label, p in family:
                mb = _hwm_mb(p)
                if mb is not None and mb > self.rss_peak.get(label, 0.0):
                    self.rss_peak[label] = mb

    def _check_liveness(self) -> None:
        with self.lock:
            procs = list(self.swarm.nodes.items())
            coord = self.swarm.coordinator
        for name, proc in procs:
            if not proc.alive() and name not in self.killed and name not in self.crashed:
                code = proc.popen.returncode
                if code == 0:
                    self.note("left", node=name)  # a clean leave (e.g. re-placed) is no crash
                    self.killed.add(name)
                    continue
                self.crashed[name] = f"exit {code}: {proc.tail(15)}"
                self.note("crash", node=name, code=code)
        if coord is not None and not coord.alive() and "coordinator" not in self.killed:
            self.crashed.setdefault(
                f"coordinator#{self.coordinator_generation}",
                f"exit {coord.popen.returncode}: {coord.tail(15)}",
            )

    def _sample_loss(self) -> None:
        with self.lock:
            stage0 = [n for n, p in self.swarm.nodes.items() if p.stage == 0 and p.alive()]
        losses = [
            v
            for n in stage0
            if n not in self.stopped and 0 < (v := self.swarm.scrape(n).get("agora_node_loss", 0))
        ]
        committed = -1.0
        try:
            committed = float(self.swarm.status(timeout_s=3).committed_tokens)
        except Exception:  # the coordinator may be down: a gap in the curve
            pass
        if losses:
            self.curve.append(
                {
                    "t_s": round(self.now(), 1),
                    "loss": round(statistics.fmean(losses), 4),
                    "committed_tokens": committed,
                }
            )

    def _sampler(self) -> None:
        while not self._stop_sampling.wait(SAMPLE_S):
            try:
                self._sample_rss()
                self._check_liveness()
                if self.t0 and self.now() >= 0:
                    self._sample_loss()
            except Exception:  # a sampling hiccup must not end the run
                log.exception("[%s] sampling failed", self.name)

    # --- faults -------------------------------------------------------------------------

    def _kill_node(self, f: Fault) -> None:
        name = self.victim(f.pick)
        if name is None:
            self.skipped[f.kind] += 1
            self.note("skip", fault=f.kind)
            return
        proc = self.swarm.nodes[name]
        with self.lock:
            self.killed.add(name)
        for child in _children(proc.popen.pid):
            _kill_quietly(child)  # SIGKILL of a node takes its outer process along
        proc.signal(signal.SIGKILL)
        proc.popen.wait(10)
        fresh = self.new_node(int(proc.stage or 0), "r")
        self.counts[f.kind] += 1
        self.note(f.kind, victim=name, replacement=fresh.name)

    def _zombie(self, f: Fault) -> None:
        name = self.victim(f.pick)
        if name is None:
            self.skipped[f.kind] += 1
            self.note("skip", fault=f.kind)
            return
        proc = self.swarm.nodes[name]
        family = [proc.popen.pid, *_children(proc.popen.pid)]
        with self.lock:
            self.stopped.add(name)
        for pid in family:
            _signal_quietly(pid, signal.SIGSTOP)
        self.counts[f.kind] += 1
        self.note(f.kind, victim=name, stopped_s=f.hold_s)
        time.sleep(f.hold_s)
        for pid in reversed(family):
            _signal_quietly(pid, signal.SIGCONT)
        with self.lock:
            self.stopped.discard(name)
        self.note("zombie_resumed", victim=name)

    def _kill_coordinator(self, f: Fault) -> None:
        # One coordinator fault at a time: a restart can take tens of seconds on a
        # loaded machine, and a second kill must hit the restarted process, not the dead
        # one (nor start a second coordinator on the same port).
        if not self.coordinator_busy.acquire(blocking=False):
            self.skipped[f.kind] += 1
            self.note("skip", fault=f.kind, why="a coordinator restart is in progress")
            return
        try:
            with self.lock:
                coord = self.swarm.coordinator
                assert coord is not None
                self.killed.add("coordinator")
            coord.signal(signal.SIGKILL)
            coord.popen.wait(10)
            self.counts[f.kind] += 1
            time.sleep(f.hold_s)
            t = time.monotonic()
            self.swarm.start_coordinator(timeout_s=RESTART_TIMEOUT_S)
            with self.lock:
                self.coordinator_generation += 1
                self.killed.discard("coordinator")
            self.note(f.kind, down_s=f.hold_s, restart_s=round(time.monotonic() - t, 2))
        finally:
            self.coordinator_busy.release()

    def _rogue(self, f: Fault, attacks: str) -> None:
        healthy = self.healthy()
        stage1 = sorted(n for n, s in healthy.items() if s == 1)
        if not stage1:
            self.skipped[f.kind] += 1
            self.note("skip", fault=f.kind)
            return
        name = stage1[int(f.pick * len(stage1))]
        peer = NodeKey((self.workdir / f"{name}.key").read_bytes()).peer_id
        with self.lock:
            self.serial += 1
            out = self.workdir / f"rogue{self.serial}.json"
        logf = (self.workdir / f"rogue{self.serial}.log").open("ab")
        popen = subprocess.Popen(
            [sys.executable, "-m", "node.chaos_rogue", "--coordinator", self.swarm.address,
             "--victim", peer, "--json", str(out), "--attacks", attacks],
            stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=child_env(), cwd=REPO,
        )  # fmt: skip
        logf.close()
        with self.lock:
            self.rogue_procs.append((f.kind, popen, out))
        self.counts[f.kind] += 1
        self.note(f.kind, victim=name, attacks=attacks)

    def _join_mid_round(self, f: Fault) -> None:
        stage = int(f.pick * 2)
        delay = 0.0
        if self.cfg.outer_every_steps > 0:
            delay = self._mid_round_delay(stage)
        time.sleep(delay)
        fresh = self.new_node(stage, "j")
        self.counts[f.kind] += 1
        self.note(f.kind, node=fresh.name, stage=stage, after_round_s=round(delay, 1))

    def _mid_round_delay(self, stage: int, timeout_s: float = 90.0) -> float:
        """Wait for a replica of `stage` to apply a round; return half the observed gap."""
        key = 'agora_node_outer_rounds_total{result="ok"}'
        with self.lock:
            names = [n for n, p in self.swarm.nodes.items() if p.stage == stage and p.alive()]
        if not names:
            return 0.0
        watch = names[0]
        seen = self.swarm.scrape(watch).get(key, 0.0)
        marks: list[float] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(marks) < 2:
            time.sleep(0.5)
            now = self.swarm.scrape(watch).get(key, 0.0)
            if now > seen:
                seen = now
                marks.append(time.monotonic())
        if len(marks) < 2:
            return 0.0
        return (marks[1] - marks[0]) / 2

    def _inject(self, f: Fault) -> None:
        try:
            if f.kind == "kill_node":
                self._kill_node(f)
            elif f.kind == "zombie":
                self._zombie(f)
            elif f.kind == "kill_coordinator":
                self._kill_coordinator(f)
            elif f.kind == "cut_stream":
                self._rogue(f, "cut")
            elif f.kind == "rogue":
                self._rogue(f, "not_member,garbage,nan,inf,shape,huge,streams,coordinator")
            elif f.kind == "join_mid_round":
                self._join_mid_round(f)
        except Exception as exc:
            log.exception("[%s] fault %s failed", self.name, f.kind)
            self.note("fault_error", fault=f.kind, error=f"{type(exc).__name__}: {exc}"[:300])

    # --- the run ------------------------------------------------------------------------

    def start(self) -> None:
        sw = self.swarm
        sw.start_coordinator()
        for name, stage in (("a0", 0), ("b0", 0), ("a1", 1), ("b1", 1)):
            sw.add_node(name, stage)
        sampler = threading.Thread(target=self._sampler, name=f"{self.name}-sampler", daemon=True)
        sampler.start()
        self._threads.append(sampler)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not all(self.trained(n) for n in ("a0", "b0", "a1", "b1")):
            if self.crashed:
                raise RuntimeError(f"[{self.name}] a node died while starting: {self.crashed}")
            if time.monotonic() > deadline:
                tails = {n: p.tail(8) for n, p in sw.nodes.items()}
                raise TimeoutError(
                    f"[{self.name}] nodes did not all train within start_timeout_s="
                    f"{self.cfg.start_timeout_s}: {tails}"
                )
            time.sleep(1.0)
        self.t0 = time.monotonic()
        log.info("[%s] all four nodes train; fault window of %.1f min starts", self.name,
                 self.cfg.minutes)  # fmt: skip

    def run(self) -> dict[str, Any]:
        window = self.cfg.minutes * 60
        try:
            self.start()
            for f in self.faults:
                while self.now() < f.at_s:
                    time.sleep(min(0.5, f.at_s - self.now()))
                t = threading.Thread(target=self._inject, args=(f,), daemon=True)
                t.start()
                self._threads.append(t)
            while self.now() < window:
                time.sleep(min(1.0, window - self.now()))
            for t in self._threads[1:]:
                t.join(timeout=120)
            return self.finish()
        finally:
            self._stop_sampling.set()
            for pid in self._all_pids():
                _signal_quietly(pid, signal.SIGCONT)
            for _, popen, _ in self.rogue_procs:
                if popen.poll() is None:
                    popen.kill()
            self.swarm.kill_all()

    def _all_pids(self) -> list[int]:
        pids = [p.popen.pid for p in self.swarm.nodes.values() if p.alive()]
        return pids + [c for p in list(pids) for c in _children(p)]

    def finish(self) -> dict[str, Any]:
        # Let the rogue processes end (they are bounded by their own deadlines).
        for kind, popen, out in self.rogue_procs:
            try:
                popen.wait(180)
            except subprocess.TimeoutExpired:
                popen.kill()
            result: dict[str, Any] = {"kind": kind, "exit": popen.returncode}
            if out.exists():
                result["results"] = json.loads(out.read_text())
            self.rogue_results.append(result)
        # Nodes that joined late get to finish starting: a drain needs a running node.
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                waiting = [
                    n for n, p in self.swarm.nodes.items() if p.alive() and not self.trained(n)
                ]
            if not waiting:
                break
            time.sleep(1.0)
        else:
            self.note("never_trained", nodes=waiting)
        self._sample_rss()
        self._check_liveness()
        self._stop_sampling.set()
        with self.lock:
            live = {n for n, p in self.swarm.nodes.items() if p.alive()}
        codes = self.swarm.stop(self.cfg.stop_timeout_s)
        for name, code in codes.items():
            if name in live or name == "coordinator":
                if code != 0:
                    proc = self.swarm.nodes.get(name) or self.swarm.coordinator
                    tail = proc.tail(15) if proc else ""
                    self.crashed.setdefault(name, f"stop exit {code}: {tail}")
        audit = audit_db(self.swarm.db, self.workdir / "audit.json")
        joiners = [e["node"] for e in self.events if e["kind"] == "join_mid_round"]
        joins = joins_during_rounds(self.workdir, joiners)
        loss_tail = [p["loss"] for p in self.curve if p["t_s"] >= self.cfg.minutes * 60 * 0.9]
        if not loss_tail and self.curve:
            loss_tail = [self.curve[-1]["loss"]]
        return {
            "faults": dict(self.counts),
            "faults_skipped": {k: v for k, v in self.skipped.items() if v},
            "schedule": [dataclasses.asdict(f) for f in self.faults],
            "events": self.events,
            "rogue": self.rogue_results,
            "joins": joins,
            "joins_in_round": sum(
                1 for j in joins.values() if isinstance(j, dict) and j["in_round"]
            ),
            "audit": audit,
            "lost_ranges": audit["lost_ranges"],
            "duplicated_ranges": audit["duplicated_ranges"],
            "committed_tokens": audit["committed_tokens"],
            "final_loss": round(statistics.median(loss_tail), 4) if loss_tail else None,
            "loss_curve": self.curve,
            "rss_peak_mb": {k: round(v, 1) for k, v in sorted(self.rss_peak.items())},
            "max_rss_mb": round(max(self.rss_peak.values(), default=0.0), 1),
            "crashed": self.crashed,
            "exit_codes": codes,
        }


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_JOINED = re.compile(r"node: joined run \S+ as \S+ on stage (\d+)/")
_APPLIED = re.compile(r"outer: round \d+ applied \(.*?, ([\d.]+)s, ")


def _log_time(line: str) -> float | None:
    m = _LOG_TIME.match(line)
    if not m:
        return None
    return dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def joins_during_rounds(workdir: Path, joiners: list[str]) -> dict[str, Any]:
    """Did each joiner's coordinator join land inside an outer round of its stage?

    From the logs: a joiner's "joined run ... on stage S" time, and every other node's
    "round N applied (..., X s, ...)" lines of stage S, which give the round's span
    [applied - X, applied]. Returns per joiner the join time's position.
    """
    stage_of: dict[str, int] = {}
    joined_at: dict[str, float] = {}
    rounds: dict[int, list[tuple[float, float]]] = {}
    for log_file in sorted(workdir.glob("*.log")):
        name = log_file.stem
        stage = None
        for line in log_file.read_text(errors="replace").splitlines():
            if (m := _JOINED.search(line)) and (t := _log_time(line)) is not None:
                stage = int(m.group(1))
                stage_of[name] = stage
                joined_at.setdefault(name, t)
            elif (m := _APPLIED.search(line)) and stage is not None:
                t = _log_time(line)
                if t is not None:
                    rounds.setdefault(stage, []).append((t - float(m.group(1)), t))
    out: dict[str, Any] = {}
    for name in joiners:
        if name not in joined_at:
            out[name] = "never joined"
            continue
        t, stage = joined_at[name], stage_of[name]
        inside = any(a <= t <= b for a, b in rounds.get(stage, []))
        out[name] = {"stage": stage, "in_round": inside, "rounds_seen": len(rounds.get(stage, []))}
    return out


def audit_db(db: Path, out: Path) -> dict[str, Any]:
    """Run `agora audit` on a coordinator DB; sum lost/duplicated ranges over epochs."""
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.audit", "--db", str(db), "--json", str(out)],
        env=child_env(), capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    if proc.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"agora audit failed ({proc.returncode}): {proc.stderr[-2000:]}")
    epochs = json.loads(out.read_text())
    return {
        "exit": proc.returncode,
        "lost_ranges": sum(len(e["lost"]) for e in epochs),
        "duplicated_ranges": sum(len(e["duplicated"]) for e in epochs),
        "committed_tokens": sum(e["committed_tokens"] for e in epochs),
        "epochs": len(epochs),
        "summary": proc.stdout.strip().splitlines()[-5:],
    }


def _hwm_mb(p: psutil.Process) -> float | None:
    """Peak resident set (VmHWM) of a process in MB; None if it is gone."""
    try:
        with open(f"/proc/{p.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float(p.memory_info().rss) / 2**20
    except (OSError, psutil.Error):
        return None


def _pname(p: psutil.Process) -> str:
    try:
        return str(p.name())
    except psutil.Error:
        return "gone"


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _signal_quietly(pid: int, sig: int) -> None:
    try:
        psutil.Process(pid).send_signal(sig)
    except psutil.Error:
        pass


def _kill_quietly(pid: int) -> None:
    _signal_quietly(pid, signal.SIGKILL)


def chaos(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the chaos swarm (and the fault-free one); return the report."""
    window = cfg.minutes * 60
    schedule = plan(cfg.seed, window, cfg)
    faulty = Run(cfg, "chaos", schedule)
    report: dict[str, Any]
    if cfg.baseline == "concurrent":
        calm = Run(cfg, "fault_free", [])
        box: dict[str, Any] = {}

        def run_calm() -> None:
            try:
                box["result"] = calm.run()
            except Exception as exc:
                log.exception("fault-free run failed")
                box["error"] = f"{type(exc).__name__}: {exc}"

        t = threading.Thread(target=run_calm, daemon=True)
        t.start()
        report = faulty.run()
        t.join()
        base = box.get("result")
    else:
        report = faulty.run()
        base = Run(cfg, "fault_free", []).run() if cfg.baseline == "sequential" else None
    report["seed"] = cfg.seed
    report["minutes"] = cfg.minutes
    report["preset"] = cfg.preset
    report["baseline_mode"] = cfg.baseline
    report["final_loss_fault_free"] = base["final_loss"] if base else None
    if base:
        report["fault_free"] = {
            k: base[k]
            for k in ("lost_ranges", "duplicated_ranges", "committed_tokens", "final_loss",
                      "loss_curve", "max_rss_mb", "rss_peak_mb", "crashed")
        }  # fmt: skip
        if report["final_loss"] and base["final_loss"]:
            report["final_loss_ratio"] = round(report["final_loss"] / base["final_loss"], 4)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="agora chaos",
        description="Run a local swarm (coordinator, 2 stages x 2 replicas) under a seeded"
        " schedule of faults: node SIGKILLs with replacements, SIGSTOP zombies, coordinator"
        " SIGKILL+restart, streams cut mid-message, a rogue peer, joins mid outer round. Then"
        " drain, audit, and compare the loss with a fault-free run of the same seed. Exit 0"
        " iff no range is lost or duplicated and no honest process crashed.",
    )
    p.add_argument("--minutes", type=float, required=True, help="length of the fault window")
    p.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument(
        "--workdir", type=workdir_path, default=None, help="logs and DBs (default a temp dir)"
    )
    p.add_argument(
        "--baseline", choices=("sequential", "concurrent", "none"), default="sequential",
        help="the fault-free run of the same seed: after the chaos run (default), at the same"
        " time (halves the CPU of each; fits a deadline), or none",
    )  # fmt: skip
    p.add_argument("--fault-every", type=float, default=45.0, help="mean seconds between faults")
    p.add_argument(
        "--outer-every-steps", type=int, default=10, help="inner steps between DiLoCo rounds"
    )
    p.add_argument("--plan-only", action="store_true", help="print the schedule and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="agora-chaos-"))
    try:
        cfg = ChaosConfig(
            minutes=args.minutes, seed=args.seed, preset=args.preset, baseline=args.baseline,
            fault_every_s=args.fault_every, outer_every_steps=args.outer_every_steps,
            workdir=workdir,
        )  # fmt: skip
    except ValueError as exc:
        print(f"agora chaos: {exc}", file=sys.stderr)
        return 2
    if args.plan_only:
        for f in plan(cfg.seed, cfg.minutes * 60, cfg):
            print(f"{f.at_s:8.1f}s  {f.kind:<17} pick={f.pick:.3f} hold={f.hold_s:.1f}s")
        return 0
    print(f"agora chaos: logs in {workdir}", flush=True)
    try:
        report = chaos(cfg)
    except KeyboardInterrupt:
        print("agora chaos: interrupted", file=sys.stderr)
        return 130
    report["workdir"] = str(workdir)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(
        f"faults {report['faults']}; lost {report['lost_ranges']}, duplicated"
        f" {report['duplicated_ranges']} ranges; final loss {report['final_loss']}"
        f" (fault-free {report['final_loss_fault_free']}); max RSS {report['max_rss_mb']} MB;"
        f" crashed {sorted(report['crashed']) or 'none'}"
    )
    ok = not report["lost_ranges"] and not report["duplicated_ranges"] and not report["crashed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
