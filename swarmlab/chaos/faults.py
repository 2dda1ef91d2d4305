"""The fault injectors of `agora chaos`: each takes the `Target` it acts on and one `Fault`
of the schedule, picks its victim among healthy nodes, injects the fault (signals to a
node's whole process tree, a coordinator kill and restart, a rogue peer process, a fresh
node), and records it on the run."""

from __future__ import annotations

import logging
import signal
import time

import psutil

from protocol.identity import NodeKey
from swarmlab.chaos.schedule import Fault
from swarmlab.chaos.target import Target
from swarmlab.procs import REPO, spawn

log = logging.getLogger("agora.chaos")

RESTART_TIMEOUT_S = 240.0  # seconds a restarted coordinator may take to serve (loaded box)


def kill_node(run: Target, f: Fault) -> None:
    name = run.victim(f.pick)
    if name is None:
        run.skip(f.kind)
        return
    proc = run.swarm.nodes[name]
    with run.lock:
        run.killed.add(name)
    for child in children(proc.popen.pid):
        kill_quietly(child)  # SIGKILL of a node takes its outer process along
    proc.signal(signal.SIGKILL)
    proc.popen.wait(10)
    fresh = run.new_node(int(proc.stage or 0), "r")
    run.counts[f.kind] += 1
    run.note(f.kind, victim=name, replacement=fresh.name)


def zombie(run: Target, f: Fault) -> None:
    name = run.victim(f.pick)
    if name is None:
        run.skip(f.kind)
        return
    proc = run.swarm.nodes[name]
    family = [proc.popen.pid, *children(proc.popen.pid)]
    with run.lock:
        run.stopped.add(name)
    for pid in family:
        signal_quietly(pid, signal.SIGSTOP)
    run.counts[f.kind] += 1
    run.note(f.kind, victim=name, stopped_s=f.hold_s)
    time.sleep(f.hold_s)
    for pid in reversed(family):
        signal_quietly(pid, signal.SIGCONT)
    with run.lock:
        run.stopped.discard(name)
    run.note("zombie_resumed", victim=name)


def kill_coordinator(run: Target, f: Fault) -> None:
    # One coordinator fault at a time: a restart can take tens of seconds on a
    # loaded machine, and a second kill must hit the restarted process, not the dead
    # one (nor start a second coordinator on the same port).
    if not run.coordinator_busy.acquire(blocking=False):
        run.skip(f.kind, why="a coordinator restart is in progress")
        return
    try:
        with run.lock:
            coord = run.swarm.coordinator
            assert coord is not None
            run.killed.add("coordinator")
        coord.signal(signal.SIGKILL)
        coord.popen.wait(10)
        run.counts[f.kind] += 1
        time.sleep(f.hold_s)
        t = time.monotonic()
        run.swarm.start_coordinator(timeout_s=RESTART_TIMEOUT_S)
        with run.lock:
            run.coordinator_generation += 1
            run.killed.discard("coordinator")
        run.note(f.kind, down_s=f.hold_s, restart_s=round(time.monotonic() - t, 2))
    finally:
        run.coordinator_busy.release()


def rogue(run: Target, f: Fault, attacks: str) -> None:
    healthy = run.healthy()
    stage1 = sorted(n for n, s in healthy.items() if s == 1)
    if not stage1:
        run.skip(f.kind)
        return
    name = stage1[int(f.pick * len(stage1))]
    peer = NodeKey((run.workdir / f"{name}.key").read_bytes()).peer_id
    with run.lock:
        run.serial += 1
        out = run.workdir / f"rogue{run.serial}.json"
    popen = spawn(
        run.workdir / f"rogue{run.serial}.log",
        ["-m", "swarmlab.chaos.rogue", "--coordinator", run.swarm.address,
         "--victim", peer, "--json", str(out), "--attacks", attacks],
        cwd=REPO,
    )  # fmt: skip
    with run.lock:
        run.rogue_procs.append((f.kind, popen, out))
    run.counts[f.kind] += 1
    run.note(f.kind, victim=name, attacks=attacks)


def join_mid_round(run: Target, f: Fault) -> None:
    stage = int(f.pick * 2)
    delay = 0.0
    if run.cfg.outer_every_steps > 0:
        delay = mid_round_delay(run, stage)
    time.sleep(delay)
    fresh = run.new_node(stage, "j")
    run.counts[f.kind] += 1
    run.note(f.kind, node=fresh.name, stage=stage, after_round_s=round(delay, 1))


def mid_round_delay(run: Target, stage: int, timeout_s: float = 90.0) -> float:
    """Wait for a replica of `stage` to apply a round; return half the observed gap."""
    key = 'agora_node_outer_rounds_total{result="ok"}'
    with run.lock:
        names = [n for n, p in run.swarm.nodes.items() if p.stage == stage and p.alive()]
    if not names:
        return 0.0
    watch = names[0]
    seen = run.swarm.scrape(watch).get(key, 0.0)
    marks: list[float] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and len(marks) < 2:
        time.sleep(0.5)
        now = run.swarm.scrape(watch).get(key, 0.0)
        if now > seen:
            seen = now
            marks.append(time.monotonic())
    if len(marks) < 2:
        return 0.0
    return (marks[1] - marks[0]) / 2


def inject(run: Target, f: Fault) -> None:
    """Inject one scheduled fault; a failure to inject is recorded, never raised."""
    try:
        if f.kind == "kill_node":
            kill_node(run, f)
        elif f.kind == "zombie":
            zombie(run, f)
        elif f.kind == "kill_coordinator":
            kill_coordinator(run, f)
        elif f.kind == "cut_stream":
            rogue(run, f, "cut")
        elif f.kind == "rogue":
            rogue(run, f, "not_member,garbage,nan,inf,shape,huge,streams,coordinator")
        elif f.kind == "join_mid_round":
            join_mid_round(run, f)
    except Exception as exc:
        log.exception("[%s] fault %s failed", run.name, f.kind)
        run.note("fault_error", fault=f.kind, error=f"{type(exc).__name__}: {exc}"[:300])


def children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def signal_quietly(pid: int, sig: int) -> None:
    try:
        psutil.Process(pid).send_signal(sig)
    except psutil.Error:
        pass


def kill_quietly(pid: int) -> None:
    signal_quietly(pid, signal.SIGKILL)
