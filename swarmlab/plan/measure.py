"""Measure a real loopback swarm of a given shape, for `agora plan`'s validation.

`measure_shape` starts a coordinator and `stages x replicas` real nodes (`LocalSwarm`,
node defaults: outer loop on), and reads, as an operator would:
- **tokens/s**: stage 0's trained tokens (`agora_node_tokens_total`, Prometheus) over a
  steady-state window that starts `warmup_s` after the first trained micro-batch;
- **CPU**: each node's process tree (its own and its children's, psutil) and its torch
  thread alone (`agora_node_torch_cpu_seconds_total`), per second of the window;
- **round time**: the mean gap between consecutive `round_applied` events of each
  replica (node events), over the window;
- **message wait**: per hop, half the mean round trip the calling stage saw
  (`agora_node_microbatch_seconds`) less the mean time the serving stage held a request
  (`agora_node_serve_seconds`): what a message spends outside both ends' handlers;
- **re-route time**: after the window, the longest-serving replica of stage 1 is
  SIGKILLed; the time from the kill to the first `forward_rerouted` event of a stage-0
  node (the first micro-batch that failed through the victim and came back, trained,
  through a survivor; only stage 0 writes the event, after its backward). A fresh
  replica replaces it; before the next of `reroute_trials` kills the swarm settles: the
  replacement serves and has applied an outer round, so its start-up (imports, model
  build, outer process and DHT join: several CPU-seconds on this box) is not measured
  as re-route time. The victim is never that replacement: a replica that has just
  joined may carry no micro-batch yet (the router rates it by its slow first replies),
  and killing it would time how long until a sender next picks it, not a re-route. The
  median is reported, every trial kept, each with the seconds until a stage-0 node saw
  the kill (its first `forward_failed`) and where that re-routed micro-batch spent its
  time (`retry_served` events of the stages that served it, and its successful
  attempt's round trip).
"""

from __future__ import annotations

import signal
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

from swarmlab.swarm import LocalSwarm


def _trained(sw: LocalSwarm, names: list[str]) -> float:
    return sum(sw.scrape(n).get("agora_node_tokens_total", 0.0) for n in names)


def _cpu(sw: LocalSwarm, names: list[str]) -> dict[str, tuple[float, float]]:
    """(own, children's) user + system CPU seconds of each node's process tree."""
    out = {}
    for n in names:
        try:
            proc = psutil.Process(sw.nodes[n].popen.pid)
            kids = proc.children(recursive=True)
            own = sum(proc.cpu_times()[:2])
            children = 0.0
            for k in kids:
                try:
                    children += sum(k.cpu_times()[:2])
                except psutil.Error:
                    pass
        except psutil.Error:
            own = children = float("nan")
        out[n] = (own, children)
    return out


def _torch_cpu(sw: LocalSwarm, names: list[str]) -> dict[str, float]:
    """CPU seconds each node's torch thread has spent on its jobs (node metrics)."""
    return {n: sw.scrape(n).get("agora_node_torch_cpu_seconds_total", 0.0) for n in names}


HISTOGRAMS = ("agora_node_microbatch_seconds", "agora_node_serve_seconds")


def _histograms(sw: LocalSwarm, names: list[str]) -> dict[str, dict[str, float]]:
    """Sum and count of each node's round-trip and serve-time histograms."""
    out = {}
    for n in names:
        m = sw.scrape(n)
        out[n] = {f"{h}{x}": m.get(f"{h}{x}", 0.0) for h in HISTOGRAMS for x in ("_sum", "_count")}
    return out


def hop_waits(
    names: dict[int, list[str]],
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
) -> list[float | None]:
    """Per hop s -> s+1: half the mean round trip stage s saw, less the mean time stage
    s+1 held a request (from its arrival, decoded, to its reply): what one message spent
    outside both ends' handlers (the wire, framing, and waiting for a core and the GIL).
    None for a hop with no request in the window."""

    def mean(stage: int, hist: str) -> float | None:
        total = sum(after[n][f"{hist}_sum"] - before[n][f"{hist}_sum"] for n in names[stage])
        count = sum(after[n][f"{hist}_count"] - before[n][f"{hist}_count"] for n in names[stage])
        return total / count if count > 0 else None

    out: list[float | None] = []
    for s in range(len(names) - 1):
        rtt, held = mean(s, HISTOGRAMS[0]), mean(s + 1, HISTOGRAMS[1])
        out.append(None if rtt is None or held is None else (rtt - held) / 2)
    return out


def _round_gaps(sw: LocalSwarm, names: list[str], t0: float, t1: float) -> list[float]:
    gaps: list[float] = []
    for n in names:
        ts = sorted(ev["t"] for ev in sw.events(n, "round_applied"))
        gaps += [b - a for a, b in zip(ts, ts[1:], strict=False) if t0 <= a and b <= t1]
    return gaps


def _path(sw: LocalSwarm, names: dict[int, list[str]], t_kill: float) -> dict[str, Any]:
    """Where the first re-routed micro-batch since `t_kill` spent its time: its
    `forward_rerouted` fields (from its first failure, and its attempt that got through)
    and each stage's `retry_served` of it (queued, held, its forward job's wall and
    CPU seconds), by node."""
    rerouted = min(
        (ev for n in names[0] for ev in sw.events(n, "forward_rerouted") if ev["t"] >= t_kill),
        key=lambda ev: ev["t"],
    )
    mb = rerouted["mb_id"]
    served = {
        n: {k: ev.get(k) for k in ("queued_s", "held_s", "job_s", "job_cpu_s")}
        for n in sw.nodes
        for ev in sw.events(n, "retry_served")
        if ev["t"] >= t_kill and ev["mb_id"] == mb
    }
    return {
        "since_failure_s": rerouted["seconds"],
        "attempt_s": rerouted.get("attempt_s"),
        "served": served,
    }


def _reroute_trial(
    sw: LocalSwarm, names: dict[int, list[str]], trial: int, say: Any
) -> tuple[float, float | None, dict[str, Any]]:
    """SIGKILL stage 1's longest-serving replica; seconds until a stage-0 node's first
    `forward_rerouted`, and until its first `forward_failed` (the kill seen), and that
    micro-batch's path (`_path`). Then a fresh replica takes its place and must serve
    and apply an outer round before the next trial."""
    victim = names[1].pop(0)
    t_kill = time.time()
    sw.nodes[victim].signal(signal.SIGKILL)
    sw.nodes[victim].popen.wait(10)

    def first_reroute() -> float | None:
        ts = [
            ev["t"]
            for n in names[0]
            for ev in sw.events(n, "forward_rerouted")
            if ev["t"] >= t_kill
        ]
        return min(ts) if ts else None

    t_done = sw.wait_for(first_reroute, "a re-routed micro-batch", 120, 0.1)
    del sw.nodes[victim]
    seconds = float(t_done or 0.0) - t_kill
    failed = [
        ev["t"] for n in names[0] for ev in sw.events(n, "forward_failed") if ev["t"] >= t_kill
    ]
    seen = min(failed) - t_kill if failed else None
    path = _path(sw, names, t_kill)
    say(f"re-route trial {trial}: {seconds:.2f} s (the kill seen after {seen or 0:.2f} s)")
    fresh = f"s1x{trial}"
    sw.add_node(fresh, 1)
    names[1].append(fresh)
    sw.wait_for(
        lambda: sw.scrape(fresh).get("agora_p2p_served_total", 0.0) > 0,
        f"the replacement {fresh} serving",
        180,
    )
    sw.wait_for(
        lambda: bool(sw.events(fresh, "round_applied")),
        f"the replacement {fresh} applying an outer round",
        180,
    )
    return seconds, seen, path


def measure_shape(
    workdir: Path,
    *,
    preset: str,
    stages: int,
    replicas: int,
    warmup_s: float,
    window_s: float,
    node_values: dict[str, Any] | None = None,
    reroute_trials: int = 3,
    say: Any = print,
) -> dict[str, Any]:
    """Tokens/s, mean outer-round time and re-route time of a real loopback swarm;
    `node_values` are agora-node settings for every node (a `[node]` TOML table)."""
    sw = LocalSwarm(workdir=workdir, preset=preset, stages=stages)
    if node_values:
        sw.node_args = ["--config", str(sw.write_node_config(**node_values))]
    names = {s: [f"s{s}r{r}" for r in range(replicas)] for s in range(stages)}
    everyone = [n for ns in names.values() for n in ns]
    out: dict[str, Any] = {"stages": stages, "replicas": replicas, "preset": preset}
    try:
        sw.start_coordinator()
        for s, ns in names.items():
            for n in ns:
                sw.add_node(n, s)
        say(f"{stages}x{replicas}: {len(everyone)} nodes starting")
        sw.wait_for(lambda: _trained(sw, names[0]) > 0, "the first trained micro-batch", 300)
        time.sleep(warmup_s)
        for n in everyone:
            if not sw.nodes[n].alive():
                raise RuntimeError(f"node {n} exited:\n{sw.nodes[n].tail()}")
        say(f"{stages}x{replicas}: measuring for {window_s:.0f} s")
        tok0, w0, m0 = _trained(sw, names[0]), time.time(), time.monotonic()
        cpu0, torch0 = _cpu(sw, everyone), _torch_cpu(sw, everyone)
        hist0 = _histograms(sw, everyone)
        time.sleep(window_s)
        tok1, w1, m1 = _trained(sw, names[0]), time.time(), time.monotonic()
        cpu1, torch1 = _cpu(sw, everyone), _torch_cpu(sw, everyone)
        out["hop_wait_s"] = hop_waits(names, hist0, _histograms(sw, everyone))
        out["tokens_per_s"] = (tok1 - tok0) / (m1 - m0)
        out["cpu_s_per_s"] = {
            n: [(cpu1[n][i] - cpu0[n][i]) / (m1 - m0) for i in (0, 1)] for n in everyone
        }
        out["torch_cpu_s_per_s"] = {n: (torch1[n] - torch0[n]) / (m1 - m0) for n in everyone}
        gaps = _round_gaps(sw, everyone, w0, w1)
        out["round_s"] = sum(gaps) / len(gaps) if gaps else None
        out["rounds_seen"] = len(gaps)
        if reroute_trials and replicas > 1 and stages > 1:
            trials = [_reroute_trial(sw, names, t, say) for t in range(reroute_trials)]
            out["reroute_trials_s"] = [t for t, _, _ in trials]
            out["reroute_seen_s"] = [seen for _, seen, _ in trials]
            out["reroute_paths"] = [path for _, _, path in trials]
            out["reroute_s"] = statistics.median(out["reroute_trials_s"])
        sw.stop()
    finally:
        sw.kill_all()
    return out
