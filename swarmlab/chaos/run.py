"""One swarm of `agora chaos` under one schedule: `Run` starts the swarm, samples loss,
peak RSS and liveness while the faults are injected, then drains, audits and reports.
`joins_during_rounds` reads the nodes' event files to tell whether each join landed
inside an outer round. A run that measures its model (`ChaosConfig.measures_model`) ends
with the whole model its live nodes drained to (`final_point`) and, with `keep_states`,
every model it held on the way (`points`), each with its committed tokens
(swarmlab.chaos.heldout); `swarmlab.chaos.main` evaluates them."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from coordinator.store import read_audit
from node.events import read_events
from swarmlab.chaos.faults import children, inject, signal_quietly
from swarmlab.chaos.heldout import (
    ModelPoint,
    Snapshots,
    commits_of,
    current_states,
    model_points,
    with_tokens,
)
from swarmlab.chaos.schedule import ChaosConfig, Fault
from swarmlab.chaos.target import Target
from swarmlab.swarm import EVENTS_SUFFIX

log = logging.getLogger("agora.chaos")

SAMPLE_S = 3.0  # seconds between loss / RSS / liveness samples


class Run(Target):
    """One swarm under one schedule (empty for the fault-free run)."""

    def __init__(
        self, cfg: ChaosConfig, name: str, faults: list[Fault], *, keep_states: bool = False
    ) -> None:
        super().__init__(cfg, name)
        self.faults = faults
        # every stage state the nodes checkpoint, kept as it appears (the fault-free run's
        # models at any committed-token count)
        self.snapshots = (
            Snapshots(self.swarm.checkpoint_root, self.workdir / "states")
            if keep_states and cfg.measures_model
            else None
        )
        self.points: list[ModelPoint] = []  # the kept models, with their committed tokens
        # Past the window the run trains on while this says so (the fault-free run, until
        # the chaos run drains or its committed tokens are reached), within `extend_s`.
        self.keep_going: Callable[[Run], bool] | None = None
        self.extended_s = 0.0  # seconds trained past the window
        self.draining = threading.Event()  # set when the final drain starts (or the run ends)
        self.final_point: ModelPoint | None = None  # the model the live nodes drained to
        self.rng = random.Random(f"{cfg.seed}-{name}-victims")
        self.crashed: dict[str, str] = {}  # name -> why (exit code, log tail)
        self.rogue_results: list[dict[str, Any]] = []
        self.rss_peak: dict[str, float] = {}  # process label -> peak MB (VmHWM)
        self.curve: list[dict[str, float]] = []  # t_s, loss, committed tokens
        self._stop_sampling = threading.Event()
        self._threads: list[threading.Thread] = []

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
                    (f"{name}/{pname(ch)}:{ch.pid}", ch) for ch in root.children(recursive=True)
                ]
            except psutil.Error:
                continue
            for label, p in family:
                mb = peak_rss_mb(p)
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
                if self.snapshots is not None:
                    self.snapshots.poll()
                if self.t0 and self.now() >= 0:
                    self._sample_loss()
            except Exception:  # a sampling hiccup must not end the run
                log.exception("[%s] sampling failed", self.name)

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
                t = threading.Thread(target=self.inject, args=(f,), daemon=True)
                t.start()
                self._threads.append(t)
            while self.now() < window:
                time.sleep(min(1.0, window - self.now()))
            self._extend(window)
            for t in self._threads[1:]:
                t.join(timeout=120)
            return self.finish()
        finally:
            self.draining.set()
            self._stop_sampling.set()
            for pid in self._all_pids():
                signal_quietly(pid, signal.SIGCONT)
            for _, popen, _ in self.rogue_procs:
                if popen.poll() is None:
                    popen.kill()
            self.swarm.kill_all()

    def _extend(self, window: float) -> None:
        """Train on past the window while `keep_going` says so, at most `extend_s` more."""
        if self.keep_going is None:
            return
        deadline = window + self.extend_s
        while self.now() < deadline and self.keep_going(self):
            time.sleep(2.0)
        self.extended_s = round(max(0.0, self.now() - window), 1)
        self.note("trained_past_window", seconds=self.extended_s)

    @property
    def extend_s(self) -> float:
        """The most a run trains past its window: another window plus the time a chaos
        run's end may take (late joiners starting, then the drain)."""
        return self.cfg.minutes * 60 + self.cfg.start_timeout_s + self.cfg.stop_timeout_s

    def committed_now(self) -> int | None:
        """The coordinator's committed tokens now; None when it does not answer."""
        try:
            return int(self.swarm.status(timeout_s=3).committed_tokens)
        except Exception:
            return None

    def inject(self, f: Fault) -> None:
        """Inject one scheduled fault (on its own thread)."""
        inject(self, f)

    def _final_model(self, live: set[str]) -> dict[str, Any]:
        """After the drain: the model of the nodes that were live at the end (each wrote
        its stage's state at its drain), else of every node that ever checkpointed; and,
        with `keep_states`, the kept models. Each with its committed tokens."""
        commits = commits_of(read_audit(self.swarm.db))
        root = self.swarm.checkpoint_root
        final = model_points(current_states(root, live)) or model_points(current_states(root))
        self.final_point = with_tokens(final[-1:], commits)[0] if final else None
        if self.snapshots is not None:
            self.snapshots.poll()
            self.points = with_tokens(model_points(self.snapshots.states), commits)
        p = self.final_point
        return {
            "model_rounds": p.rounds if p else None,
            "model_states": len(self.points),
            "tokens_on_lineage": p.on_chain if p else None,
            "stage0_commits": len(commits),
            "stage0_commit_rounds": len({c.link for c in commits if c.link[0] >= 0}),
        }

    def _all_pids(self) -> list[int]:
        pids = [p.popen.pid for p in self.swarm.nodes.values() if p.alive()]
        return pids + [c for p in list(pids) for c in children(p)]

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
        self.draining.set()
        codes = self.swarm.stop(self.cfg.stop_timeout_s)
        for name, code in codes.items():
            if name in live or name == "coordinator":
                if code != 0:
                    proc = self.swarm.nodes.get(name) or self.swarm.coordinator
                    tail = proc.tail(15) if proc else ""
                    self.crashed.setdefault(name, f"stop exit {code}: {tail}")
        audit = self.swarm.audit(self.workdir / "audit.json").summary()
        model = self._final_model(live) if self.cfg.measures_model else {}
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
            "trained_twice_tokens": audit["trained_twice_tokens"],
            "trained_past_window_s": self.extended_s,
            **model,
            "final_loss": round(statistics.median(loss_tail), 4) if loss_tail else None,
            "loss_curve": self.curve,
            "rss_peak_mb": {k: round(v, 1) for k, v in sorted(self.rss_peak.items())},
            "max_rss_mb": round(max(self.rss_peak.values(), default=0.0), 1),
            "crashed": self.crashed,
            "exit_codes": codes,
        }


def joins_during_rounds(workdir: Path, joiners: list[str]) -> dict[str, Any]:
    """Did each joiner's coordinator join land inside an outer round of its stage?

    From the nodes' event files in `workdir`: a joiner's first `joined` time, and every
    node's `round_applied` events of stage S, each of which spans [t - seconds, t].
    Returns per joiner the join time's position.
    """
    stage_of: dict[str, int] = {}
    joined_at: dict[str, float] = {}
    rounds: dict[int, list[tuple[float, float]]] = {}
    for path in sorted(workdir.glob(f"*{EVENTS_SUFFIX}")):
        name = path.name.removesuffix(EVENTS_SUFFIX)
        stage = None
        for ev in read_events(path):
            if ev["event"] == "joined":
                stage = int(ev["stage"])
                stage_of[name] = stage
                joined_at.setdefault(name, float(ev["t"]))
            elif ev["event"] == "round_applied" and stage is not None:
                t = float(ev["t"])
                rounds.setdefault(stage, []).append((t - float(ev["seconds"]), t))
    out: dict[str, Any] = {}
    for name in joiners:
        if name not in joined_at:
            out[name] = "never joined"
            continue
        t, stage = joined_at[name], stage_of[name]
        inside = any(a <= t <= b for a, b in rounds.get(stage, []))
        out[name] = {"stage": stage, "in_round": inside, "rounds_seen": len(rounds.get(stage, []))}
    return out


def peak_rss_mb(p: psutil.Process) -> float | None:
    """Peak resident set (VmHWM) of a process in MB; None if it is gone."""
    try:
        with open(f"/proc/{p.pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float(p.memory_info().rss) / 2**20
    except (OSError, psutil.Error):
        return None


def pname(p: psutil.Process) -> str:
    try:
        return str(p.name())
    except psutil.Error:
        return "gone"
