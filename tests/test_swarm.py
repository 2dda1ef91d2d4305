"""Multi-process swarm tests: a real coordinator and real nodes on loopback (tiny preset).

One swarm of 2 stages x 2 replicas is shared by the tests of this module (starting one
costs five interpreters importing torch), and they run in file order:

1. it trains and the stage-0 loss falls;
2. a rogue peer attacks a stage-1 node (non-member forward, garbage, NaN, wrong shape,
   a frame claiming 2 GiB): each is refused or banned, with counters, and the honest
   swarm keeps training;
3. a stage-1 replica is SIGKILLed mid-run: training continues through the other replica;
   then every node is stopped with SIGINT (exit 0) and `agora audit` finds no lost and
   no duplicated range.

The nodes run without the DiLoCo outer loop (`outer_every_steps = 0`, where the node
has that setting): these tests are about the data plane, and without outer rounds a
finished micro-batch is committed at once, so "committed tokens keep rising" is a crisp
signal. Every wait polls with a deadline; the swarm is killed whatever happens.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from node.config import NodeConfig
from protocol.identity import NodeKey
from swarmlab.procs import child_env, workdir_path
from swarmlab.swarm import LocalSwarm, scrape_metrics

REPO = Path(__file__).resolve().parent.parent
NODES = (("a0", 0), ("b0", 0), ("a1", 1), ("b1", 1))
START_S = 150.0  # seconds for five processes to import torch and build stages (loaded box)
TRAIN_S = 120.0  # seconds for the loss to fall / tokens to rise


def test_workdir_path_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Benches hand nodes paths of files in --workdir, and nodes run with their own cwd:
    a relative --workdir (bench convergence's default) must become absolute."""
    monkeypatch.chdir(tmp_path)
    assert workdir_path("bench-out") == tmp_path.resolve() / "bench-out"


def poll(predicate: Callable[[], Any], timeout_s: float, what: str, swarm: LocalSwarm) -> Any:
    """`LocalSwarm.wait_for`: poll until truthy; on timeout fail with the log tails."""
    return swarm.wait_for(predicate, what, timeout_s)


def committed(swarm: LocalSwarm) -> int:
    return swarm.status().committed_tokens


def metric(swarm: LocalSwarm, name: str, key: str) -> float:
    return swarm.scrape(name).get(key, 0.0)


def bad_frames(scraped: dict[str, float]) -> float:
    return sum(v for k, v in scraped.items() if k.startswith("agora_p2p_bad_frames_total{"))


def assert_alive(swarm: LocalSwarm, names: list[str]) -> None:
    for name in names:
        proc = swarm.nodes[name]
        assert proc.alive(), f"{name} exited with {proc.popen.returncode}:\n{proc.tail(30)}"
    assert swarm.coordinator is not None and swarm.coordinator.alive()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = tmp_path_factory.mktemp("swarm")
    sw = LocalSwarm(workdir=workdir, preset="tiny", stages=2, metrics=True)
    pipeline_only = "outer_every_steps" in NodeConfig.__dataclass_fields__
    node_toml = sw.write_node_config(**({"outer_every_steps": 0} if pipeline_only else {}))
    sw.node_args = ["--config", str(node_toml)]
    try:
        sw.start_coordinator()
        for name, stage in NODES:
            sw.add_node(name, stage)
        poll(
            lambda: (
                all(st.peers == 2 for st in sw.status().stages) and len(sw.status().stages) == 2
            ),
            START_S,
            "2 peers on each of 2 stages",
            sw,
        )
        yield sw
    finally:
        sw.kill_all()


def test_swarm_trains_and_loss_falls(swarm: LocalSwarm) -> None:
    early = poll(lambda: metric(swarm, "a0", "agora_node_loss"), START_S, "a first loss", swarm)
    assert early > 4.0, f"the first loss {early} is already low: not an untrained model"
    target = early - 1.5
    poll(
        lambda: (
            0 < metric(swarm, "a0", "agora_node_loss") < target
            and 0 < metric(swarm, "b0", "agora_node_loss") < target
        ),
        TRAIN_S,
        f"stage-0 loss below {target:.2f} (first seen {early:.2f}) on a0 and b0",
        swarm,
    )
    # Both stage-1 replicas took traffic: routing spreads the load.
    for name in ("a1", "b1"):
        poll(
            partial(metric, swarm, name, "agora_p2p_served_total"),
            TRAIN_S,
            f"{name} serving forwards",
            swarm,
        )
    assert committed(swarm) > 0
    assert_alive(swarm, [n for n, _ in NODES])


def test_members_report_the_work_they_saw_each_other_do(swarm: LocalSwarm) -> None:
    # every node reports, every 15 s, the tokens adjacent members worked on with it; the
    # coordinator checks claimed throughput against them (coordinator/witness.py)
    assert swarm.coordinator is not None and swarm.coordinator.metrics_port is not None
    address = f"127.0.0.1:{swarm.coordinator.metrics_port}"
    poll(
        lambda: scrape_metrics(address).get("agora_coordinator_witnessed_tokens", 0.0) > 0,
        TRAIN_S,
        "witnessed work reported to the coordinator",
        swarm,
    )


def test_rogue_peer_is_refused_and_banned(swarm: LocalSwarm, tmp_path: Path) -> None:
    victim = NodeKey((swarm.workdir / "a1.key").read_bytes()).peer_id
    before = swarm.scrape("a1")
    tokens_before = committed(swarm)
    out = tmp_path / "rogue.json"
    proc = subprocess.run(
        [sys.executable, "-m", "swarmlab.chaos.rogue",
         "--attacks", "not_member,garbage,nan,shape,huge,control",
         "--coordinator", swarm.address, "--victim", victim, "--json", str(out)],
        env=child_env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    after = swarm.scrape("a1")

    # A peer that is not in the run gets nothing.
    assert results["not_member"] == {"outcome": "refused", "reason": "not_member"}, results
    # Members that misbehave are dropped at once, and a good request afterwards is not
    # served either: they are banned.
    for attack in ("garbage", "nan", "shape", "huge"):
        r = results[attack]
        assert r["outcome"] == "dropped", (attack, r)
        assert r["after"]["outcome"] != "answered", (attack, r)
    # The control: a member's well-formed Forward is served, before and after.
    assert results["control"]["outcome"] == "answered", results["control"]
    assert results["control"]["after"]["outcome"] == "answered", results["control"]

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta('agora_p2p_refused_total{reason="not_member"}') >= 1
    assert delta("agora_p2p_bans_total") == 4, (before, after)
    assert bad_frames(after) - bad_frames(before) >= 4, (before, after)
    assert delta('agora_p2p_bad_frames_total{kind="oversized"}') >= 1
    assert delta('agora_p2p_bad_frames_total{kind="malformed"}') >= 1  # garbage
    assert delta('agora_p2p_bad_frames_total{kind="invalid"}') >= 2  # NaN, wrong shape

    # The honest swarm keeps training, and nobody honest crashed.
    poll(lambda: committed(swarm) > tokens_before + 8 * 1024, TRAIN_S, "tokens after", swarm)
    assert_alive(swarm, [n for n, _ in NODES])


def test_sigkill_stage1_replica_then_clean_stop_and_audit(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    poll(lambda: metric(swarm, "b1", "agora_p2p_served_total") > 0, TRAIN_S, "b1 serving", swarm)
    served_a1 = metric(swarm, "a1", "agora_p2p_served_total")
    at_kill = committed(swarm)
    swarm.nodes["b1"].signal(signal.SIGKILL)
    assert swarm.nodes["b1"].popen.wait(10) == -signal.SIGKILL

    # Training goes on through a1: committed tokens keep rising, a1 serves more.
    poll(
        lambda: committed(swarm) > at_kill + 16 * 1024,
        TRAIN_S,
        f"committed tokens past {at_kill + 16 * 1024} after the kill",
        swarm,
    )
    assert metric(swarm, "a1", "agora_p2p_served_total") > served_a1
    assert_alive(swarm, ["a0", "b0", "a1"])

    codes = swarm.stop()
    assert codes.pop("b1") == -signal.SIGKILL
    assert codes == {"a0": 0, "b0": 0, "a1": 0, "coordinator": 0}, {
        n: p.tail(30) for n, p in swarm.nodes.items()
    }

    audit = swarm.audit()
    assert audit.exit_code == 0, audit.stdout
    data = audit.epochs
    epochs = data  # one report per data epoch
    assert epochs, data
    for epoch in epochs:
        assert epoch["lost"] == [] and epoch["duplicated"] == [], epoch
    # Every committed token is distinct (no micro-batch counted twice), and covers at
    # least what the coordinator reported while the swarm ran.
    assert sum(e["committed_tokens"] for e in epochs) >= at_kill + 16 * 1024
