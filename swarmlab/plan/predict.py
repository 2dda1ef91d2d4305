"""Questions `agora plan` asks the simulator: one prediction, the data-centre reference,
the recommended stage count, and the sweeps behind the plots.

Every answer is a `SwarmSim` run over `minutes` of simulated time after a warm-up; the
data-centre reference is the same shape and devices with 100 Gbit/s, 20 us links, no
churn and no per-message CPU ("the same GPUs in one data centre", whose pipeline moves
activations device to device, not through a Python transport).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from protocol.memory import NodeSettings as MemorySettings
from protocol.memory import stage_needs
from protocol.model_config import ModelConfig
from swarmlab.plan.fleet import DEVICES, Churn, Fleet, PeerGroup
from swarmlab.plan.profile import Profile, device_profile, measure_cpu
from swarmlab.plan.sim import SwarmSim

DC_MBIT = 100_000.0  # a data centre's links (Mbit/s)
DC_MINUTES = 10.0  # longest data-centre reference run (simulated minutes): its rate is steady
DC_RTT_MS = 0.02  # and RTT (ms)
GIB = 1 << 30


def profiles_for(model: ModelConfig, fleet: Fleet, n_stages: int) -> dict[str, Profile]:
    """One profile per device class in the fleet (cpu: measured here)."""
    out: dict[str, Profile] = {}
    for g in fleet.groups:
        if g.device in out:
            continue
        if g.device == "cpu":
            out["cpu"] = measure_cpu(model, n_stages, fleet.node)
        else:
            out[g.device] = device_profile(model, n_stages, fleet.node, g.device)
    return out


def simulate(
    fleet: Fleet,
    profiles: dict[str, Profile],
    n_stages: int,
    *,
    minutes: float,
    warmup_s: float = 60.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the fleet, placed by the coordinator's rule, for warm-up + `minutes`."""
    sim = SwarmSim(fleet, profiles, n_stages, seed=seed)
    sim.start([(g, None) for g in fleet.groups for _ in range(g.count)])
    return sim.measure(warmup_s, minutes * 60)


def data_centre(fleet: Fleet) -> Fleet:
    groups = [
        dataclasses.replace(
            g, up_mbit=DC_MBIT, down_mbit=DC_MBIT, rtt_ms=(DC_RTT_MS, DC_RTT_MS), loss=0.0,
            relayed=0.0,
        )
        for g in fleet.groups
    ]  # fmt: skip
    timings = dataclasses.replace(fleet.timings, msg_cpu_s=0.0, msg_cpu_s_per_mb=0.0)
    return dataclasses.replace(fleet, groups=groups, churn=Churn(), timings=timings)


def predict(
    model: ModelConfig, fleet: Fleet, n_stages: int, *, minutes: float, seed: int = 0
) -> dict[str, Any]:
    profiles = profiles_for(model, fleet, n_stages)
    swarm = simulate(fleet, profiles, n_stages, minutes=minutes, seed=seed)
    dc_minutes = min(minutes, DC_MINUTES)
    dc = simulate(data_centre(fleet), profiles, n_stages, minutes=dc_minutes, seed=seed)
    swarm["dc_tokens_per_s"] = dc["tokens_per_s"]
    # trained, not committed, tokens: commits come in outer-round lumps (a round can be
    # longer than the window); over a long run the two agree
    swarm["efficiency"] = swarm["tokens_per_s"] / max(dc["tokens_per_s"], 1e-9)
    swarm["stages"] = n_stages
    swarm["replicas_per_stage"] = fleet.n_peers / n_stages
    swarm["profiles"] = {k: p.to_dict() for k, p in profiles.items()}
    return swarm


def fitting_stage_counts(model: ModelConfig, fleet: Fleet) -> list[int]:
    """Stage counts from 2 (dividing the layers, at most one stage per peer) whose every stage
    fits the smallest device of the fleet at the fleet's node settings."""
    n = fleet.node
    mem = min(DEVICES[g.device]["memory_gb"] if g.device != "cpu" else 1e9 for g in fleet.groups)
    gpu = all(g.device != "cpu" for g in fleet.groups)
    settings = MemorySettings(
        micro_batch=n.micro_batch, seq_len=n.seq_len, in_flight=n.in_flight,
        activation_cache=n.activation_cache, precision=n.precision if gpu else "fp32",
        cuda=gpu, recompute=n.recompute,
    )  # fmt: skip
    out = []
    for k in range(2, min(model.n_layers, fleet.n_peers) + 1):  # a pipeline: 2 or more
        if model.n_layers % k:
            continue
        if max(x.total for x in stage_needs(model, k, settings)) <= mem * GIB:
            out.append(k)
    return out


def recommend(
    model: ModelConfig, fleet: Fleet, *, minutes: float, seed: int = 0, say: Callable[[str], None]
) -> dict[str, Any]:
    """Simulate each stage count that fits and pick the highest trained tokens/s."""
    rows = []
    for k in fitting_stage_counts(model, fleet):
        profiles = profiles_for(model, fleet, k)
        r = simulate(fleet, profiles, k, minutes=minutes, seed=seed)
        say(f"  {k:>3} stages x {fleet.n_peers / k:5.1f} replicas: {r['tokens_per_s']:,.0f} tokens/s")  # fmt: skip
        rows.append({"stages": k, **r})
    if not rows:
        raise ValueError("no stage count fits the fleet's smallest device; add memory or stages")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    return {"stages": best["stages"], "candidates": rows}


def sweep(
    fleet: Fleet,
    profiles: dict[str, Profile],
    n_stages: int,
    *,
    minutes: float,
    seed: int = 0,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, list[dict[str, float]]]:
    """Efficiency against the data centre as RTT, bandwidth, churn and replicas vary."""
    dc_cache: dict[int, float] = {}

    def eff(f: Fleet) -> float:
        if f.n_peers not in dc_cache:
            dc = simulate(
                data_centre(f), profiles, n_stages, minutes=min(minutes, DC_MINUTES), seed=seed
            )
            dc_cache[f.n_peers] = dc["tokens_per_s"]
        r = simulate(f, profiles, n_stages, minutes=minutes, seed=seed)
        return float(r["tokens_per_s"]) / max(dc_cache[f.n_peers], 1e-9)

    def groups(**changes: Any) -> list[PeerGroup]:
        return [dataclasses.replace(g, **changes) for g in fleet.groups]

    out: dict[str, list[dict[str, float]]] = {"rtt_ms": [], "mbit": [], "churn": [], "replicas": []}
    for rtt in (10.0, 40.0, 100.0, 200.0, 400.0):
        f = dataclasses.replace(fleet, groups=groups(rtt_ms=(rtt, rtt)))
        out["rtt_ms"].append({"x": rtt, "efficiency": eff(f)})
        say(f"  rtt_ms {rtt:g}: efficiency {out['rtt_ms'][-1]['efficiency']:.3f}")
    for mbit in (20.0, 80.0, 200.0, 1000.0):
        f = dataclasses.replace(fleet, groups=groups(up_mbit=mbit, down_mbit=mbit))
        out["mbit"].append({"x": mbit, "efficiency": eff(f)})
        say(f"  mbit {mbit:g}: efficiency {out['mbit'][-1]['efficiency']:.3f}")
    for session in (0.0, 480.0, 120.0, 30.0):
        churn = dataclasses.replace(fleet.churn, mean_session_min=session)
        f = dataclasses.replace(fleet, churn=churn)
        rate = 60.0 / session if session else 0.0  # departures per peer-hour
        out["churn"].append({"x": rate, "efficiency": eff(f)})
        say(f"  churn {rate:g}: efficiency {out['churn'][-1]['efficiency']:.3f}")
    for reps in (1, 2, 4, 8, 16):
        total = reps * n_stages
        scale = total / fleet.n_peers
        gs = [dataclasses.replace(g, count=max(1, round(g.count * scale))) for g in fleet.groups]
        f = dataclasses.replace(fleet, groups=gs)
        out["replicas"].append({"x": float(reps), "efficiency": eff(f)})
        say(f"  replicas {float(reps):g}: efficiency {out['replicas'][-1]['efficiency']:.3f}")
    return out
