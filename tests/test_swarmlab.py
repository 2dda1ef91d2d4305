"""swarmlab's helpers without a swarm: the TOML writer, wait_for, child_env, the audit of
a missing database, and the chaos join analysis over event files."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from node.config import NodeConfig
from swarmlab.chaos.run import joins_during_rounds
from swarmlab.configs import toml_text, write_toml
from swarmlab.coordinator import audit
from swarmlab.procs import REPO, child_env, free_port, wait_for
from swarmlab.swarm import LocalSwarm


def test_toml_round_trips_through_tomllib(tmp_path: Path) -> None:
    values = {
        "run_id": 'a "quoted" run\\with a backslash',
        "n_stages": 2,
        "lease_ttl_s": 2.5,
        "relay": False,
        "allowlist": ["k1", "k2"],
        "dataset": tmp_path / "data",
        "join_token": None,  # left out
        "node": {"outer_every_steps": 0, "outer_compression": "int8", "outer_lr": None},
    }
    got = tomllib.loads(write_toml(tmp_path / "run.toml", values).read_text())
    assert got == {
        "run_id": values["run_id"],
        "n_stages": 2,
        "lease_ttl_s": 2.5,
        "relay": False,
        "allowlist": ["k1", "k2"],
        "dataset": str(tmp_path / "data"),
        "node": {"outer_every_steps": 0, "outer_compression": "int8"},
    }
    with pytest.raises(TypeError):
        toml_text({"bad": object()})


def test_node_config_reads_what_the_swarm_writes(tmp_path: Path) -> None:
    swarm = LocalSwarm(workdir=tmp_path, run_config={"lease_ttl_s": 4.0})
    path = swarm.write_node_config(outer_every_steps=0, micro_batch=3)
    cfg = NodeConfig.load(path, {"coordinator": "127.0.0.1:1"})
    assert cfg.outer_every_steps == 0 and cfg.micro_batch == 3
    run = tomllib.loads(swarm.write_run_config().read_text())
    assert run["lease_ttl_s"] == 4.0 and run["model_preset"] == "tiny"


def test_wait_for_returns_the_value_or_names_what_it_waited_for() -> None:
    calls = iter([0, "", "done"])
    assert wait_for(lambda: next(calls), "a value", 5.0, poll_s=0.0) == "done"
    with pytest.raises(TimeoutError, match="waiting for the impossible\nlog tail"):
        wait_for(lambda: False, "the impossible", 0.05, poll_s=0.01, detail=lambda: "log tail")


def test_child_env_and_free_port() -> None:
    env = child_env(threads=2)
    assert env["OMP_NUM_THREADS"] == "2" and env["PYTHONUNBUFFERED"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
    assert 0 < free_port() < 65536


def test_audit_of_a_missing_database_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="failed"):
        audit(tmp_path / "missing.sqlite")


def _events(path: Path, *events: dict[str, object]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_joins_during_rounds_reads_event_files(tmp_path: Path) -> None:
    joined = {"event": "joined", "peer_id": "p", "n_stages": 2, "run_id": "r"}
    _events(
        tmp_path / "a1.events.jsonl",
        {**joined, "t": 100.0, "stage": 1},
        {"t": 130.0, "event": "round_applied", "round": 1, "group_size": 2, "tokens": 1,
         "seconds": 20.0, "rebased": False},
    )  # fmt: skip
    _events(tmp_path / "j1s1.events.jsonl", {**joined, "t": 115.0, "stage": 1})
    _events(tmp_path / "j2s0.events.jsonl", {**joined, "t": 115.0, "stage": 0})
    got = joins_during_rounds(tmp_path, ["j1s1", "j2s0", "j3s1"])
    assert got["j1s1"] == {"stage": 1, "in_round": True, "rounds_seen": 1}
    assert got["j2s0"] == {"stage": 0, "in_round": False, "rounds_seen": 0}
    assert got["j3s1"] == "never joined"
    swarm = LocalSwarm(workdir=tmp_path)
    assert [e["stage"] for e in swarm.events("j1s1", "joined")] == [1]
    assert swarm.events("nobody") == []
