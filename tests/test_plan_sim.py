"""The swarm simulator against what can be worked out by hand, and its fleet files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmlab.plan.fleet import Churn, Fleet, NodeSettings, PeerGroup, Timings, fleet_from_dict
from swarmlab.plan.profile import Profile, StageCost
from swarmlab.plan.sim import SwarmSim

REPO = Path(__file__).resolve().parent.parent


def profile(fwd0: float = 0.1, bwd0: float = 0.2, last: float = 0.3) -> Profile:
    return Profile(
        device="cpu",
        source="test",
        stages=[
            StageCost(fwd_s=fwd0, bwd_s=bwd0, step_s=0.0, fwd_bytes=1000, bwd_bytes=0, params=10),
            StageCost(fwd_s=last, bwd_s=0.0, step_s=0.0, fwd_bytes=0, bwd_bytes=1000, params=10),
        ],
    )


def fleet(count: int = 4, *, outer: int = 0, churn: Churn | None = None, host: str = "") -> Fleet:
    return Fleet(
        groups=[
            PeerGroup(
                count=count, device="cpu", up_mbit=1e4, down_mbit=1e4, rtt_ms=(0.0, 0.0), host=host
            )  # fmt: skip
        ],
        churn=churn or Churn(),
        timings=Timings(msg_cpu_s=0.0, msg_cpu_s_per_mb=0.0, host_cores=2),
        node=NodeSettings(outer_every_steps=outer, in_flight=4),
    )


def run(f: Fleet, stages: list[int], seconds: float = 120.0, seed: int = 0) -> dict:
    sim = SwarmSim(f, {"cpu": profile()}, 2, seed=seed)
    sim.start([(f.groups[0], s) for s in stages])
    return sim.measure(20.0, seconds)


def test_dedicated_devices_reach_the_bottleneck_rate() -> None:
    # each peer needs 0.3 s of its own device per micro-batch (stage 0: 0.1 + 0.2, the
    # last stage: 0.3); two replicas per stage finish 2 / 0.3 micro-batches a second
    r = run(fleet(), [0, 0, 1, 1])
    tokens = 8 * 128
    assert r["tokens_per_s"] == pytest.approx(2 / 0.3 * tokens, rel=0.05)
    # without an outer loop a micro-batch commits as it finishes
    assert r["committed_tokens_per_s"] == pytest.approx(r["tokens_per_s"], rel=0.05)


def test_a_message_costs_its_receiver_cpu_per_message_and_per_mb() -> None:
    # 2 x 1 on dedicated devices, 1 MB each way: stage 0 spends 0.1 + 0.2 of torch plus
    # 0.05 + 0.1 x 1 MB on the gradient it receives, the last stage 0.3 + 0.15 on the
    # activations: 0.45 s a micro-batch on each, the pipeline's rate
    f = fleet(count=2)
    f.timings = Timings(msg_cpu_s=0.05, msg_cpu_s_per_mb=0.1, host_cores=2)
    p = profile()
    for c in p.stages:
        c.fwd_bytes, c.bwd_bytes = (1e6 if c.fwd_bytes else 0), (1e6 if c.bwd_bytes else 0)
    sim = SwarmSim(f, {"cpu": p}, 2, seed=0)
    sim.start([(f.groups[0], 0), (f.groups[0], 1)])
    r = sim.measure(20.0, 120.0)
    assert r["tokens_per_s"] == pytest.approx(8 * 128 / 0.45, rel=0.05)


def test_stage0_keeps_the_nodes_lease_pool_open() -> None:
    """A stage-0 peer holds `lease_pool` leases with windows left, as the node does."""
    for pool in (2, 16):
        f = fleet(count=2)
        f.node = NodeSettings(outer_every_steps=0, in_flight=4, lease_pool=pool)
        sim = SwarmSim(f, {"cpu": profile()}, 2, seed=0)
        sim.start([(f.groups[0], 0), (f.groups[0], 1)])
        sim.measure(5.0, 10.0)
        (first,) = [p for p in sim.peers.values() if p.stage == 0]
        assert sum(1 for ls in first.leases.values() if ls.next < ls.limit) == pool
    with pytest.raises(ValueError, match="lease_pool"):
        dataclasses.replace(fleet(), node=NodeSettings(lease_pool=0))


def test_a_micro_batch_larger_than_a_grant_carries_all_its_tokens() -> None:
    f = fleet(count=2)
    f.node = NodeSettings(outer_every_steps=0, in_flight=4, micro_batch=128)  # 16,384 tokens
    assert f.node.micro_batch * f.node.seq_len > f.timings.grant_tokens
    sim = SwarmSim(f, {"cpu": profile()}, 2, seed=0)
    sim.start([(f.groups[0], 0), (f.groups[0], 1)])
    r = sim.measure(20.0, 120.0)
    assert r["tokens_per_s"] == pytest.approx(128 * 128 / 0.3, rel=0.05)


@pytest.mark.parametrize(("background", "cores_for_workers"), [(0.0, 2.0), (1.0, 1.0)])
def test_a_shared_host_is_cpu_bound(background: float, cores_for_workers: float) -> None:
    # four nodes on two cores, 0.6 core-seconds per micro-batch; each node's outer
    # process counted as `background` always-runnable threads takes its share
    f = fleet(host="local")
    f.timings.node_bg_threads = background
    r = run(f, [0, 0, 1, 1])
    assert r["tokens_per_s"] == pytest.approx(cores_for_workers / 0.6 * 8 * 128, rel=0.05)


def test_outer_rounds_commit_in_lumps_and_time_rounds() -> None:
    r = run(fleet(outer=5), [0, 0, 1, 1], seconds=300.0)
    assert r["round_s"] is not None and r["round_s"] > 0
    assert r["committed_tokens_per_s"] == pytest.approx(r["tokens_per_s"], rel=0.15)


@pytest.mark.parametrize(
    ("stages", "group_size", "low", "high"),
    [
        # a group closes once it holds every replica of its stage, well inside the 6 s
        # matchmaking window: a pair, three, and a replica alone on its stage at once
        # (not when its averaging would time out, 13 s)
        ([0, 0, 1, 1], 8, 0.0, 4.0),
        ([0, 0, 0, 1, 1, 1], 8, 0.0, 4.0),
        ([0, 1], 8, 0.0, 4.0),
    ],
)
def test_a_round_lasts_as_long_as_the_node_gathers_its_group(
    stages: list[int], group_size: int, low: float, high: float
) -> None:
    f = fleet(count=len(stages), outer=1)  # a step takes far less than a round: back to back
    f = dataclasses.replace(
        f, node=dataclasses.replace(f.node, outer_matchmaking_s=6.0, outer_group_size=group_size)
    )
    r = run(f, stages, seconds=300.0)
    assert low <= r["round_s"] <= high


def test_a_profile_averaged_with_a_second_timing_keeps_its_sizes() -> None:
    a, b = profile(0.1, 0.2, 0.3), profile(0.3, 0.4, 0.5)
    m = a.averaged(b)
    assert [t for c in m.stages for t in (c.fwd_s, c.bwd_s)] == pytest.approx([0.2, 0.3, 0.4, 0])
    assert [(c.fwd_bytes, c.params) for c in m.stages] == [(1000, 10), (0, 10)]


def test_a_kill_is_rerouted_and_its_work_continues() -> None:
    f = fleet(churn=Churn(kills=((60.0, 1),)))
    sim = SwarmSim(f, {"cpu": profile()}, 2)
    sim.start([(f.groups[0], s) for s in (0, 0, 1, 1)])
    sim.eng.run(59.0)
    before = sim.stage0_trained
    sim.eng.run(120.0)
    # At once to the survivor, ahead of its fresh work: the kill seen (`kill_detect_s`), at
    # most the job it is running and then the retried one (0.3 s each), and back at stage
    # 0 at most a job in progress and the retried backward (0.2 s each).
    seen = f.timings.kill_detect_s
    assert sim.reroutes
    assert seen + 0.3 + 0.2 <= min(sim.reroutes) <= seen + 0.3 + 0.3 + 0.2 + 0.2
    assert sim.stage0_trained > before
    assert sum(1 for p in sim.peers.values() if p.alive and p.stage == 1) == 1


def test_a_dead_stage0_nodes_leases_expire_and_are_granted_again() -> None:
    f = fleet(churn=Churn(kills=((30.0, 0),)))
    sim = SwarmSim(f, {"cpu": profile()}, 2)
    sim.start([(f.groups[0], s) for s in (0, 0, 1, 1)])
    sim.eng.run(29.9)
    dead = [p for p in sim.peers.values() if p.stage == 0][-1]  # the newest: kill_one's pick
    sim.eng.run(30.5)
    assert not dead.alive
    held = sim.book.holder_leases(dead.pid)
    assert held
    sim.eng.run(30.0 + f.timings.lease_ttl_s + f.timings.heartbeat_s + 1)
    assert not sim.book.holder_leases(dead.pid)  # expired by the sweep, not before the TTL


def test_churn_replaces_leavers_and_the_same_seed_repeats() -> None:
    f = fleet(count=6, churn=Churn(mean_session_min=1.0, startup_s=5.0))
    a = run(f, [0, 0, 0, 1, 1, 1], seconds=300.0, seed=3)
    b = run(f, [0, 0, 0, 1, 1, 1], seconds=300.0, seed=3)
    assert a == b
    assert a["departures"] > 5 and a["joins"] > 6 and a["tokens_per_s"] > 0


def test_the_shipped_fleet_files_load() -> None:
    from swarmlab.plan.fleet import load_fleet

    f = load_fleet(REPO / "deploy/plan/consumer-330.toml")
    assert f.n_peers == 330


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({}, "at least one"),
        ({"group": [{"count": 0}]}, "count=0"),
        ({"group": [{"count": 1, "device": "tpu"}]}, "device='tpu'"),
        ({"group": [{"count": 1, "rtt_ms": [50, 10]}]}, "rtt_ms"),
        ({"group": [{"count": 1, "colour": "red"}]}, "unknown keys ['colour']"),
        ({"group": [{"count": 1}], "timings": {"lease_ttl_s": 1.0}}, "twice heartbeat_s"),
        ({"group": [{"count": 1}], "extra": {}}, "unknown tables"),
    ],
)
def test_bad_fleets_are_refused_by_name(data: dict, words: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        fleet_from_dict(data)
    assert words in str(info.value)


_values = st.one_of(st.integers(-5, 500), st.floats(allow_nan=True), st.text(max_size=5), st.lists(st.integers(-1, 300), max_size=3))  # fmt: skip
_tables = st.dictionaries(st.sampled_from(["count", "device", "rtt_ms", "loss", "up_mbit", "x"]), _values, max_size=5)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["group", "churn", "node", "timings"]), st.one_of(_tables, st.lists(_tables, max_size=3)), max_size=4))  # fmt: skip
def test_any_fleet_table_loads_or_is_refused_with_a_value_error(data: dict) -> None:
    try:
        fleet_from_dict(data)
    except ValueError:
        pass


@pytest.mark.parametrize(("children", "weight"), [(0.66, 0.97), (0.5, 0.5), (0.025, 0.025)])
def test_the_calibration_gives_the_outer_processes_the_weight_that_took_their_cpu(
    children: float, weight: float
) -> None:
    """Two cores, one worker runnable at a time, two background weights w: each runs at
    full speed up to w = 0.5, and gets 2 w / (1 + 2 w) cores beyond."""
    from swarmlab.plan.validate import NODE, calibrate

    stored = json.loads((REPO / "docs/plan/validation.json").read_text())["validation"]
    one = {**stored["measured"]["2x1"]}
    one["cpu_s_per_s"] = {k: [v[0], children] for k, v in one["cpu_s_per_s"].items()}
    cal = calibrate(NODE, one, Profile.from_dict(stored["measured"]["profiles"]["2"]), 2)
    assert cal["node_bg_threads"] == pytest.approx(weight, abs=0.01)
    w = cal["node_bg_threads"]
    assert min(w, 2 * w / (1 + 2 * w)) == pytest.approx(children, abs=1e-9)
    assert 0.03 < cal["msg_cpu_s"] < 0.05  # the stored run's messaging, docs/plan.md


def test_the_calibration_scales_the_profile_to_the_torch_cpu_seen_in_the_swarm() -> None:
    """With the torch thread's CPU read in the 2 x 1 swarm, the profile is scaled to it
    and the messaging cost is what the node spent beyond it."""
    from swarmlab.plan.validate import NODE, calibrate, compute_per_mb

    stored = json.loads((REPO / "docs/plan/validation.json").read_text())["validation"]
    profile = Profile.from_dict(stored["measured"]["profiles"]["2"])
    one = {**stored["measured"]["2x1"]}
    mb_rate = one["tokens_per_s"] / (NODE.micro_batch * NODE.seq_len)
    compute = compute_per_mb(profile, NODE)
    base = calibrate(NODE, one, profile, 2)
    assert base["profile_scale"] == 1.0  # not read: the profile stands
    one["torch_cpu_s_per_s"] = {f"s{s}r0": 1.3 * compute[s] * mb_rate for s in range(2)}
    cal = calibrate(NODE, one, profile, 2)
    assert cal["profile_scale"] == pytest.approx(1.3)
    assert cal["msg_cpu_s"] == pytest.approx(max(0.0, base["msg_cpu_s"] - 0.3 * sum(compute) / 2))
    scaled = profile.scaled(1.3)
    assert compute_per_mb(scaled, NODE) == pytest.approx([1.3 * c for c in compute])
    assert [s.fwd_bytes for s in scaled.stages] == [s.fwd_bytes for s in profile.stages]


def test_contention_is_the_4x1_swarms_extra_torch_cpu_per_unit_of_oversubscription() -> None:
    """The 4 x 1 swarm's torch threads took `ratio` x the profile's CPU per micro-batch:
    the contention is (ratio - 1) over the mean oversubscription of the simulated swarm,
    which lies in (0, 1] for four nodes on two cores; no extra CPU gives none. And the
    model bites: contention costs tokens/s."""
    from swarmlab.plan.validate import (
        LOOPBACK,
        NODE,
        compute_per_mb,
        measure_contention,
        predict_shape,
    )

    three = Profile.from_dict(
        json.loads((REPO / "docs/plan/validation.json").read_text())["validation"]["measured"][
            "profiles"
        ]["3"]
    )
    four = Profile(device="cpu", source="test", stages=[three.stages[i] for i in (0, 1, 1, 2)])
    base = Timings(host_cores=2, msg_cpu_s=0.0025, node_bg_threads=0.023)
    window = {"window_s": 30.0, "warmup_s": 5.0}
    tokens_per_s = 6000.0
    mb_rate = tokens_per_s / (NODE.micro_batch * NODE.seq_len)

    def contention(ratio: float) -> float:
        torch_s = ratio * sum(compute_per_mb(four, NODE)) * mb_rate
        many = {
            "tokens_per_s": tokens_per_s,
            "torch_cpu_s_per_s": {f"s{s}r0": torch_s / 4 for s in range(4)},
        }
        return measure_contention(four, many, base, **window)

    assert contention(0.95) == 0.0 and contention(1.0) == 0.0
    k = contention(1.1)
    assert 0.1 / 1.05 <= k < 1.0  # mean oversubscription at most (4 + 4 x 0.023) / 2 - 1
    assert contention(1.2) == pytest.approx(2 * k)

    def tps(c: float) -> float:
        t = dataclasses.replace(base, cpu_contention=c)
        return float(
            predict_shape(four, 4, 1, NODE, LOOPBACK, t, reroute=False, **window)["tokens_per_s"]
        )

    assert tps(0.4) < 0.9 * tps(0.0)  # four processes on two cores: the model bites


def test_a_round_comes_one_step_early_as_the_nodes_tick_does() -> None:
    """A due round begins at the node's next outer tick, and its snapshot waits for the
    micro-batch the worker took up meanwhile: stepping it counts as the next round's
    first step, so a round every 5 steps of 4,096 tokens carries 4 x 4,096 + 1,024."""
    f = fleet(count=2, outer=5)
    r = run(f, [0, 1], seconds=300.0)
    tokens_per_round = r["round_s"] * r["tokens_per_s"]
    assert tokens_per_round == pytest.approx(4 * 4096 + 8 * 128, rel=0.05)


def test_a_hops_message_wait_is_half_its_round_trip_less_what_its_server_held() -> None:
    from swarmlab.plan.measure import hop_waits

    def hist(rtt: tuple[float, float], held: tuple[float, float]) -> dict[str, float]:
        return {
            "agora_node_microbatch_seconds_sum": rtt[0],
            "agora_node_microbatch_seconds_count": rtt[1],
            "agora_node_serve_seconds_sum": held[0],
            "agora_node_serve_seconds_count": held[1],
        }

    names = {0: ["a"], 1: ["b", "c"], 2: ["d"]}
    before = {n: hist((0, 0), (0, 0)) for n in "abcd"}
    after = {
        "a": hist((10.0, 10), (0, 0)),  # stage 0 waited 1.0 s a micro-batch
        "b": hist((2.0, 4), (3.2, 4)),  # stage 1 held them 0.8 s (b and c together)
        "c": hist((4.0, 6), (4.8, 6)),
        "d": hist((0, 0), (0.0, 0)),  # stage 2 saw none in the window
    }
    assert hop_waits(names, before, after) == [pytest.approx(0.1), None]
