"""A real swarm trains one complete data epoch through faults, and the audit proves it.

A coordinator and 2 stages x 2 replicas (tiny preset, DiLoCo rounds, stage checkpoints)
train a small dataset the test writes (a directory of text files: 6 training shards of
4,096 tokens and one held out) while:
- a stage-0 replica is SIGKILLed and a fresh node takes its place (it downloads the
  stage's state; the dead holder's leases expire and are granted again);
- a stage-1 replica is SIGSTOPped past the lease TTL (its membership lapses, it is a
  zombie), then SIGCONTed (it is told it is no member, re-joins, and trains on).
Once the coordinator rolls over to data epoch 1, every node drains, the model is
exported from the checkpoints (`agora export --checkpoints`), and `agora audit --db DB
--export DIR` must report mode `full_epoch` and no finding: every token of epoch 0 was
committed exactly once, each by a lease granted for it, and every stage-0 commit rode
in a state the exported stage-0 state descends from.

Every wait polls the coordinator's status or the nodes' event files with a deadline; the
swarm is killed whatever happens.
"""

from __future__ import annotations

import json
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.audit import main as audit_main
from node.export import main as export_main
from swarmlab.swarm import LocalSwarm

SHARD_TOKENS = 4096
TRAIN_SHARDS = 6
TTL_S = 6.0  # lease and peer TTL (s)
START_S = 240.0  # five interpreters import torch and build stages, a first round
EPOCH_S = 240.0  # the whole epoch, faults included


def write_dataset(root: Path) -> Path:
    """A directory of small text files, one per shard (bytes are tokens): TRAIN_SHARDS
    training shards and, as the last (`heldout_every` = TRAIN_SHARDS + 1), a held-out one.
    Each file is a token short of a shard, so with the separators between files the
    shards fall where the files do."""
    root.mkdir()
    rng = random.Random(0)
    words = "the a of to in stage replica round lease shard token epoch audit".split()
    for i in range(TRAIN_SHARDS + 1):
        text = " ".join(rng.choice(words) for _ in range(SHARD_TOKENS))[: SHARD_TOKENS - 1]
        (root / f"part{i}.txt").write_text(text)
    return root


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    sw = LocalSwarm(
        workdir=tmp_path / "run",
        preset="tiny",
        stages=2,
        run_config={
            "dataset": str(write_dataset(tmp_path / "data")),
            "shard_tokens": SHARD_TOKENS,
            "heldout_every": TRAIN_SHARDS + 1,
            "grant_tokens": 2048,
            "lease_ttl_s": TTL_S,
            "heartbeat_interval_s": 1.0,
        },
    )
    toml = sw.write_node_config(
        outer_every_steps=3,
        inner_batch_tokens=1024,
        drain_timeout_s=20.0,
    )
    sw.node_args = ["--config", str(toml)]
    try:
        yield sw
    finally:
        sw.kill_all()


@pytest.mark.timeout(600)  # start-up of five interpreters on a loaded 2-core box, the epoch
def test_a_full_epoch_under_kills_and_zombies_audits_clean(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"

    def add(name: str, stage: int) -> None:
        swarm.add_node(name, stage, "--checkpoint-dir", str(checkpoints / name))

    swarm.start_coordinator()
    for name, stage in (("a0", 0), ("b0", 0), ("a1", 1), ("b1", 1)):
        add(name, stage)
    status = swarm.wait_for(
        lambda: (s := swarm.status()).committed_tokens > 0 and s,
        "first commits",
        START_S,
    )
    assert status.epoch_tokens == TRAIN_SHARDS * SHARD_TOKENS, status
    assert status.data_epoch == 0, "the epoch ended before the faults: make the data larger"

    # A stage-0 replica dies with leases in hand; a fresh node takes its place.
    swarm.nodes["b0"].signal(signal.SIGKILL)
    assert swarm.nodes["b0"].popen.wait(10) == -signal.SIGKILL
    add("c0", 0)

    # A stage-1 replica freezes past the TTL (a zombie), then wakes up.
    zombie = swarm.nodes["b1"]
    zombie.signal(signal.SIGSTOP)
    swarm.wait_for(
        lambda: next(s.peers for s in swarm.status().stages if s.stage == 1) == 1,
        "the zombie's membership lapses",
        START_S,
    )
    zombie.signal(signal.SIGCONT)
    # Woken, it is told it is no member and re-joins.
    swarm.wait_for(
        lambda: next(s.peers for s in swarm.status().stages if s.stage == 1) == 2,
        "the zombie re-joins",
        START_S,
    )
    swarm.wait_for(lambda: swarm.events("c0", "joined"), "the replacement joins", START_S)

    swarm.wait_for(lambda: swarm.status().data_epoch >= 1, "data epoch 0 complete", EPOCH_S)
    assert all(swarm.nodes[n].alive() for n in ("a0", "c0", "a1", "b1")), swarm.tails()
    codes = swarm.stop(timeout_s=90)
    assert codes.pop("b0") == -signal.SIGKILL
    assert codes == {"a0": 0, "c0": 0, "a1": 0, "b1": 0, "coordinator": 0}, swarm.tails(30)

    # `agora export --checkpoints` and `agora audit --export`, in this process (their
    # command-line entry points, without two more interpreters importing torch)
    export = tmp_path / "export"
    dirs = [str(p) for p in sorted(checkpoints.iterdir())]
    summary = tmp_path / "export.json"
    assert export_main(["--out", str(export), "--checkpoints", *dirs, "--json", str(summary)]) == 0
    rounds = json.loads(summary.read_text())["rounds"]
    assert set(rounds) == {"0", "1"} and all(r >= 1 for r in rounds.values()), rounds

    report_path = tmp_path / "audit.json"
    code = audit_main(["--db", str(swarm.db), "--export", str(export), "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0 and report["findings"] == [], report["findings"]
    assert report["mode"] == "full_epoch", report
    [first, *_] = report["epochs"]
    assert first["lost"] == [] and first["duplicated"] == [], first
    assert first["committed_tokens"] == TRAIN_SHARDS * SHARD_TOKENS, first
    assert report["lineage"]["commits_on_lineage"] >= 1, report["lineage"]
