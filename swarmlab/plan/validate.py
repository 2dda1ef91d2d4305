"""`agora plan --validate`: the simulator against real swarms on this machine.

A real node spends CPU that the stage profile (torch compute, `profile.measure_cpu`)
does not see, and on a two-core machine that decides the throughput:
- `msg_cpu_s`, CPU per end of a pipeline message (py-libp2p, msgpack, trio), is
  calibrated from a real 2 x 1 swarm: each node process's CPU per micro-batch less its
  torch thread's (`agora_node_torch_cpu_seconds_total`), over the two ends of the one
  hop. 2 x 1 is not among the validated shapes. Each swarm's stage profile is the mean
  of two timings in a process of its own, just before the swarm and just after (this
  box's speed drifts over the half hour), and every profile is scaled by the 2 x 1
  swarm's torch thread CPU per micro-batch over its profile's (`profile_scale`: the
  same work costs a little more beside a network).
- A node's outer process and p2p daemon take CPU beside it: the simulator counts them
  as `node_bg_threads` always-runnable threads per node, calibrated on the same 2 x 1
  swarm from the CPU its outer processes took. When hivemind's leader search spun
  (before `node.outer.paced_leaders`) that was about one thread a node (0.66 of a core
  each, measured); paced, far less.
- The same torch work may cost more CPU when more runnable threads than cores share the
  box (switching, caches). The host charges `cpu_contention` more CPU per runnable
  thread beyond its cores, per core (`engine.Host`), measured on a 4 x 1 swarm (four
  processes on the two cores, not validated either): its torch threads' CPU per
  micro-batch over the scaled profile's, less one, over the mean oversubscription the
  simulated 4 x 1 swarm's work ran under (`measure_contention`).

Then each loopback shape (stages x replicas: 2x2, 3x2, 2x3) runs for real
(`measure.measure_shape`: node defaults but rounds every `outer_every_steps`, so that a
short window holds many) and in the simulator with the CPU profile measured here and
every node on one host of this machine's cores. The shaped row is the 2x2 swarm with
every node behind `bench.shaping_proxy` (80 Mbit/s, 20 ms each way), measured as
`agora bench efficiency` does. Each row gives measured, predicted and the error of
tokens/s, round time and re-route time (loopback rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from protocol.model_config import ModelConfig
from swarmlab.plan.fleet import Churn, Fleet, NodeSettings, PeerGroup, Timings
from swarmlab.plan.measure import measure_shape
from swarmlab.plan.profile import Profile, measure_cpu
from swarmlab.plan.sim import SwarmSim

SHAPES = ((2, 2), (3, 2), (2, 3))
CALIBRATION = ((2, 1), (4, 1))  # the calibration swarms: none of them is validated
KILL_AFTER_S = 30.0  # simulated seconds after the window before the re-route kill
CONTENTION_MAX = 2.0  # the largest cpu_contention measure_contention gives (fraction)
REROUTE_TRIALS = 11  # kills per shape in the real swarms (the median is compared)
SIM_SEEDS = REROUTE_TRIALS  # simulated runs per shape, each with a kill of its own
LOOPBACK = {"up_mbit": 4000.0, "down_mbit": 4000.0, "rtt_ms": (0.2, 0.2)}
SHAPED = {"up_mbit": 80.0, "down_mbit": 80.0, "rtt_ms": (40.0, 40.0)}
METRICS = ("tokens_per_s", "round_s", "reroute_s")
# the node settings of every validation swarm: defaults, but a round every 5 inner steps
NODE = NodeSettings(outer_every_steps=5, codec="subspace_int4")
Say = Callable[[str], None]


def loopback_fleet(
    stages: int, replicas: int, node: NodeSettings, link: dict[str, Any], timings: Timings
) -> Fleet:
    return Fleet(
        groups=[PeerGroup(count=stages * replicas, device="cpu", host="local", **link)],
        churn=Churn(),
        timings=timings,
        node=node,
    )


def _error(measured: float | None, predicted: float | None) -> float | None:
    if not measured or predicted is None:
        return None
    return (predicted - measured) / measured


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for k in METRICS:
        m, p = measured.get(k), predicted.get(k)
        row[k] = {"measured": m, "predicted": p, "error": _error(m, p)}
    return row


def _started(fleet: Fleet, profile: Profile, stages: int, replicas: int, seed: int) -> SwarmSim:
    sim = SwarmSim(fleet, {"cpu": profile}, stages, seed=seed)
    sim.start([(fleet.groups[0], s) for s in range(stages) for _ in range(replicas)])
    return sim


def predict_shape(
    profile: Profile,
    stages: int,
    replicas: int,
    node: NodeSettings,
    link: dict[str, Any],
    timings: Timings,
    *,
    window_s: float,
    warmup_s: float,
    reroute: bool,
) -> dict[str, Any]:
    """The simulated swarm's tokens/s and round time, each the mean over SIM_SEEDS seeds
    (seeds alone spread a 3 x 2 round time over 5 %), and with `reroute` the median
    re-route time over as many kills, each at its own moment `KILL_AFTER_S` after the
    window; the other figures are seed 0's."""
    fleet = loopback_fleet(stages, replicas, node, link, timings)
    kill_at = warmup_s + window_s + KILL_AFTER_S
    runs, times = [], []
    for seed in range(SIM_SEEDS):
        at = kill_at + seed * 0.37
        f = dataclasses.replace(fleet, churn=Churn(kills=((at, 1),))) if reroute else fleet
        sim = _started(f, profile, stages, replicas, seed)
        runs.append(sim.measure(warmup_s, window_s))
        if reroute:  # run on past the kill
            sim.eng.run(at + 120)
            times += [min(sim.reroutes)] if sim.reroutes else []
    result = dict(runs[0])
    for k in ("tokens_per_s", "round_s"):
        values = [r[k] for r in runs if r[k] is not None]
        result[k] = statistics.fmean(values) if values else None
    if reroute:
        result["reroute_trials_s"] = times
        result["reroute_s"] = statistics.median(times) if times else None
    return result


def compute_per_mb(profile: Profile, node: NodeSettings) -> list[float]:
    """Torch seconds per micro-batch of each stage, inner steps amortised."""
    share = node.micro_batch * node.seq_len / node.inner_batch_tokens
    return [c.fwd_s + c.bwd_s + c.step_s * share for c in profile.stages]


def calibrate(
    node: NodeSettings, one: dict[str, Any], profile: Profile, cores: int
) -> dict[str, float]:
    """From the 2 x 1 swarm `one` (a measure_shape result; `profile`: the 2-stage profile)
    on `cores` cores:
    - `profile_scale`: the swarm's torch thread CPU per micro-batch over the profile's
      (1 when the run did not read it): the profile is taken minutes before the swarms,
      and this box's speed moved by a third between the two;
    - `msg_cpu_s`: each node's CPU per micro-batch less its torch thread's (the profile's
      compute when not read), less each received message's per-MB cost (`Timings`'
      default);
    - `node_bg_threads`: the runnable weight w that gives each node's outer process and
      p2p daemon the c cores they took. With one worker runnable at a time (the pipeline
      alternates) and two background weights, the host is saturated once 1 + 2 w >
      cores; below that each weight runs at full speed (c = w), above it processor
      sharing gives it w cores / (1 + 2 w)."""
    mb_rate = one["tokens_per_s"] / (node.micro_batch * node.seq_len)  # micro-batches/s
    compute = compute_per_mb(profile, node)
    scale = 1.0
    if "torch_cpu_s_per_s" in one:  # the torch thread's own CPU in the swarm
        in_swarm = [one["torch_cpu_s_per_s"][f"s{s}r0"] / mb_rate for s in range(2)]
        scale = sum(in_swarm) / sum(compute)
        compute = in_swarm
    received = [profile.stages[1].bwd_bytes, profile.stages[0].fwd_bytes]  # by stage 0, 1
    per_mb = Timings().msg_cpu_s_per_mb
    extra = [
        one["cpu_s_per_s"][f"s{s}r0"][0] / mb_rate - compute[s] - per_mb * received[s] / 1e6
        for s in range(2)
    ]
    c = min(0.45 * cores, sum(one["cpu_s_per_s"][f"s{s}r0"][1] for s in range(2)) / 2)
    w = c if c <= (cores - 1) / 2 else c / (cores - 2 * c)
    return {"msg_cpu_s": max(0.0, sum(extra) / 2), "node_bg_threads": w, "profile_scale": scale}


def measure_contention(
    profile: Profile, many: dict[str, Any], timings: Timings, *, window_s: float, warmup_s: float
) -> float:
    """The `cpu_contention` k the 4 x 1 swarm `many` (a measure_shape result; `profile`:
    its 4-stage profile, already scaled by the 2 x 1 swarm's `profile_scale`) shows: its
    torch threads' CPU per micro-batch over the profile's is 1 + k x the mean
    oversubscription its work ran under, read from the same swarm simulated without
    contention. Clamped to [0, CONTENTION_MAX]. (Fitting k to the swarm's tokens/s
    instead made it absorb this box's drift between swarms: 0.045 in a run whose torch
    CPU per micro-batch was 1.3 % over the profile.)"""
    stages, replicas = CALIBRATION[1]
    mb_rate = many["tokens_per_s"] / (NODE.micro_batch * NODE.seq_len)
    in_swarm = sum(many["torch_cpu_s_per_s"].values()) / mb_rate
    ratio = in_swarm / sum(compute_per_mb(profile, NODE))
    calm = dataclasses.replace(timings, cpu_contention=0.0)
    sim = _started(
        loopback_fleet(stages, replicas, NODE, LOOPBACK, calm), profile, stages, replicas, 0
    )
    sim.measure(warmup_s, window_s)
    host = next(iter(sim.hosts.values()))
    over = host.over_s / host.busy_s if host.busy_s else 0.0
    return min(CONTENTION_MAX, max(0.0, ratio - 1.0) / over) if over > 0 else 0.0


def measure_all(
    model: ModelConfig,
    preset: str,
    *,
    window_s: float,
    warmup_s: float,
    shaped: bool,
    say: Say,
    keep: Path | None = None,
) -> dict[str, dict[str, Any]]:
    """Every real swarm the validation needs: 2x1 and 4x1 (calibration), the loopback
    shapes and (with `shaped`) the shaped 2x2; keyed by shape name. Each swarm runs in
    a directory of its own under `keep` (its logs, events and coordinator database are
    left there), or under a temporary one that is removed."""
    values = {"outer_every_steps": NODE.outer_every_steps}
    out: dict[str, dict[str, Any]] = {}

    def profiled(name: str, stages: int, run: Callable[[], dict[str, Any]]) -> None:
        """out[name] = run(), with the stages' torch costs timed alone just before and
        just after it: this box's speed drifts by 10-25 % within the half hour."""
        before = measure_cpu(model, stages, NODE).to_dict()
        say(f"real swarm {name}")
        try:
            out[name] = run()
        except (RuntimeError, TimeoutError) as exc:  # reported, and the rest still run
            say(f"real swarm {name} failed: {str(exc)[:2000]}")
            out[name] = {"error": str(exc)[:2000]}
        out[name]["profile"] = before
        out[name]["profile_after"] = measure_cpu(model, stages, NODE).to_dict()

    if keep is not None:
        if keep.exists() and any(keep.iterdir()):  # a swarm's database there would resume
            raise ValueError(f"--keep-swarms {keep}: give a new or empty directory")
        keep.mkdir(parents=True, exist_ok=True)
    with (
        contextlib.nullcontext(str(keep))
        if keep is not None
        else tempfile.TemporaryDirectory(prefix="agora-plan-")
    ) as tmp:
        for stages, replicas in (*CALIBRATION, *SHAPES):
            name = f"{stages}x{replicas}"
            profiled(
                name, stages,
                partial(
                    measure_shape, Path(tmp) / name, preset=preset, stages=stages,
                    replicas=replicas, warmup_s=warmup_s, window_s=window_s,
                    node_values=values, reroute_trials=REROUTE_TRIALS if replicas > 1 else 0,
                    say=say,
                ),
            )  # fmt: skip
        if shaped:  # the shaped link: 80 Mbit/s, 40 ms RTT
            profiled(
                "2x2 shaped", 2,
                partial(measure_shaped, preset, Path(tmp) / "shaped", NODE, window_s),
            )  # fmt: skip
    out["window"] = {"window_s": window_s, "warmup_s": warmup_s}
    return out


def validate(measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The simulator's predictions for each measured shape, with the errors."""
    window_s, warmup_s = measured["window"]["window_s"], measured["window"]["warmup_s"]

    def profile(name: str) -> Profile:
        """The stages' costs measured around swarm `name`: the mean of before and after
        (earlier reports kept one before it, or one per stage count before all swarms)."""
        m = measured[name]
        if "profile" not in m:
            return Profile.from_dict(measured["profiles"][name.split("x")[0]])
        before = Profile.from_dict(m["profile"])
        return (
            before.averaged(Profile.from_dict(m["profile_after"]))
            if "profile_after" in m
            else before
        )

    solo, many = (f"{s}x{r}" for s, r in CALIBRATION)
    for name in (solo, many):
        if "error" in measured.get(name, {}):
            raise ValueError(f"the {name} calibration swarm failed: {measured[name]['error']}")
    cores = os.cpu_count() or 2
    cal: dict[str, Any] = calibrate(NODE, measured[solo], profile(solo), cores)
    cal["swarms"] = [solo]
    timings = Timings(
        host_cores=cores,
        msg_cpu_s=cal["msg_cpu_s"],
        node_bg_threads=cal["node_bg_threads"],
    )
    if many in measured:  # older reports have no 4x1
        cal["cpu_contention"] = measure_contention(
            profile(many).scaled(cal["profile_scale"]), measured[many], timings,
            window_s=window_s, warmup_s=warmup_s,
        )  # fmt: skip
        timings = dataclasses.replace(timings, cpu_contention=cal["cpu_contention"])
        cal["swarms"].append(many)
    rows = []
    for name, link in [
        *[(f"{s}x{r}", LOOPBACK) for s, r in SHAPES],
        *([("2x2 shaped", SHAPED)] if "2x2 shaped" in measured else []),
    ]:
        stages, replicas = (int(x) for x in name.split()[0].split("x"))
        if "error" in measured[name]:
            rows.append({"shape": name, "error": measured[name]["error"]})
            continue
        predicted = predict_shape(
            profile(name).scaled(cal["profile_scale"]), stages, replicas, NODE, link, timings,
            window_s=window_s, warmup_s=warmup_s, reroute=link is LOOPBACK,
        )  # fmt: skip
        rows.append({"shape": name, **compare(measured[name], predicted)})
    return {
        "rows": rows,
        "calibration": cal,
        "measured": measured,
    }


def measure_shaped(
    preset: str, workdir: Path, node: NodeSettings, window_s: float
) -> dict[str, Any]:
    from bench.efficiency import Shaping, measure_swarm

    r = measure_swarm(
        preset, workdir, warmup_s=20.0, window_s=window_s, shaping=Shaping(80.0, 20.0),
        outer_every_steps=node.outer_every_steps, quiet=True,
    )  # fmt: skip
    return {"tokens_per_s": r["trained_tokens_per_s"], "round_s": None, "reroute_s": None}
