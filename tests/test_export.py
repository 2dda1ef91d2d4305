"""`agora export` from stage checkpoints: the assembled model computes what the chained
stages compute, foreign or incomplete sets are refused, and `agora baseline --init DIR
--eval-only` evaluates the export."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from node.baseline import evaluate_weights
from node.checkpoint import stage_checkpointer
from node.data import load_dataset
from node.export import main
from node.export_assembly import ExportError, assemble_checkpoints, export_checkpoints
from node.model import Stage, build_stage, load_export, preset
from node.subspace import project_
from protocol.control import RunInfo
from swarmlab.procs import child_env
from swarmlab.swarm import LocalSwarm

REPO = Path(__file__).resolve().parent.parent
CFG = preset("tiny")


def _run(run_id: str = "r1", n_stages: int = 2, seed: int = 0) -> RunInfo:
    return RunInfo(
        run_id=run_id, model_preset="tiny", n_stages=n_stages, codec="subspace_int8",
        seed=seed, heartbeat_interval_s=1.0, lease_ttl_s=10.0, dataset_name="stdlib",
        dataset_hash="0" * 64, shards=4, data_epoch=0,
    )  # fmt: skip


def _perturbed_stages(n_stages: int, seed: int = 0) -> list[Stage]:
    """Stages whose weights moved off the init (as trained ones would), in the subspace."""
    gen = torch.Generator().manual_seed(1234)
    stages = []
    for s in range(n_stages):
        st = build_stage(CFG.replace(seed=seed), s, n_stages)
        with torch.no_grad():
            for p in st.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        project_(st)
        stages.append(st)
    return stages


def _write(
    directory: Path, stage: Stage, s: int, round_: int, run: RunInfo, digest: str = ""
) -> None:
    ck = stage_checkpointer(directory, 1, run, s, stage)
    flat = torch.cat([p.detach().flatten() for p in stage.parameters()])
    ck.write(*ck.capture(flat, torch.zeros_like(flat), round_, digest))


def test_export_equals_the_chained_stages(tmp_path: Path) -> None:
    stages = _perturbed_stages(2)
    for s, st in enumerate(stages):
        _write(tmp_path / f"node{s}", st, s, 3 + s, _run())
    out = tmp_path / "export"
    assert main(["--checkpoints", str(tmp_path / "node0"), str(tmp_path / "node1"),
                 "--out", str(out), "--json", str(tmp_path / "e.json")]) == 0  # fmt: skip
    assert json.loads((tmp_path / "e.json").read_text())["rounds"] == {"0": 3, "1": 4}

    config, tensors = load_export(out)
    full = build_stage(config, 0, 1)
    full.load_state_dict(tensors)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chained = stages[1](stages[0](tokens))
        assert torch.allclose(full(tokens), chained, atol=1e-5, rtol=0)
        assert not torch.allclose(full(tokens), build_stage(config, 0, 1)(tokens), atol=1e-3)


def test_newest_round_of_each_stage_wins(tmp_path: Path) -> None:
    old, new = _perturbed_stages(2), _perturbed_stages(2, seed=0)
    with torch.no_grad():
        for p in new[0].parameters():
            p.add_(1.0)
    project_(new[0])  # keep it a state a run could hold (load_stage_weights projects too)
    _write(tmp_path / "a", old[0], 0, 5, _run())
    _write(tmp_path / "b", new[0], 0, 6, _run())
    _write(tmp_path / "c", old[1], 1, 5, _run())
    got = assemble_checkpoints([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert got.rounds == {0: 6, 1: 5} and got.sources[0].startswith(str(tmp_path / "b"))
    assert torch.allclose(got.model.embed.weight, new[0].embed.weight, atol=1e-5)


def test_of_two_states_of_one_round_the_one_more_replicas_hold_wins(tmp_path: Path) -> None:
    # One replica stepped alone to round 4 while two others stepped together; the lone
    # state is written last, yet the stage's lineage runs through the pair's state.
    pair, lone = _perturbed_stages(2), _perturbed_stages(2, seed=0)
    with torch.no_grad():
        for p in lone[0].parameters():
            p.add_(1.0)
    project_(lone[0])
    a, b, c, d = (tmp_path / n for n in "abcd")
    _write(b, pair[0], 0, 4, _run(), digest="bb")
    _write(c, pair[0], 0, 4, _run(), digest="bb")
    _write(a, lone[0], 0, 4, _run(), digest="aa")
    _write(d, pair[1], 1, 4, _run())
    assert Path(assemble_checkpoints([a, b, c, d]).sources[0]).parent in (b, c)
    # One holder each: the state written last wins (a replica that rebases onto its
    # group's state writes it after its own).
    _write(c, lone[0], 0, 4, _run(), digest="cc")
    _write(b, lone[0], 0, 4, _run(), digest="bb")
    assert Path(assemble_checkpoints([a, b, c, d]).sources[0]).parent == b


def test_incomplete_or_mixed_sets_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stages = _perturbed_stages(2)
    _write(tmp_path / "a", stages[0], 0, 1, _run())
    with pytest.raises(ExportError, match=r"no checkpoint of stage\(s\) \[1\]"):
        assemble_checkpoints([tmp_path / "a"])
    _write(tmp_path / "b", stages[1], 1, 1, _run(run_id="other"))
    with pytest.raises(ExportError, match="another run: run_id"):
        assemble_checkpoints([tmp_path / "a", tmp_path / "b"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no stage checkpoints"):
        assemble_checkpoints([tmp_path / "empty"])
    assert main(["--checkpoints", str(tmp_path / "a"), "--out", str(tmp_path / "o")]) == 2
    assert "stage(s) [1]" in capsys.readouterr().err


def test_baseline_eval_only_evaluates_the_export(tmp_path: Path) -> None:
    for s, st in enumerate(_perturbed_stages(2)):
        _write(tmp_path / "ck", st, s, 1, _run())
    assert main(["--checkpoints", str(tmp_path / "ck"), "--out", str(tmp_path / "m")]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "swarmlab.cli", "baseline", "--init", str(tmp_path / "m"),
         "--eval-only", "--batch-size", "4", "--seq-len", "64", "--threads", "1",
         "--json", str(tmp_path / "eval.json")],
        env=child_env(), capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    loss = json.loads((tmp_path / "eval.json").read_text())["eval_loss"]
    # An almost untrained byte model: near log(256) = 5.55 nats, and finite.
    assert 4.0 < loss < 7.0, loss


# --- end to end: a real swarm writes the checkpoints ----------------------------------------


def _poll(predicate: Callable[[], Any], timeout_s: float, what: str, swarm: LocalSwarm) -> Any:
    """`LocalSwarm.wait_for`: poll until truthy; on timeout fail with the log tails."""
    return swarm.wait_for(predicate, what, timeout_s)


@pytest.mark.timeout(900)  # five interpreters importing torch + hivemind on a loaded 2-core box
def test_swarm_sigkill_stage0_replica_then_audit_and_export(tmp_path: Path) -> None:
    """2 stages x 2 replicas with DiLoCo (commit at the outer step) and checkpoints: a
    stage-0 replica is SIGKILLed after ranges were committed; training goes on, a clean
    stop leaves an audit with no lost and no duplicated range, and the checkpoints the
    nodes wrote export to a model that is better than the initial one."""
    swarm = LocalSwarm(workdir=tmp_path / "run", preset="tiny")
    toml = swarm.write_node_config(
        outer_every_steps=3, inner_batch_tokens=2048, outer_matchmaking_s=3.0
    )
    swarm.node_args = ["--config", str(toml)]
    names = {"a0": 0, "b0": 0, "a1": 1, "b1": 1}
    try:
        swarm.start_coordinator()
        for name, stage in names.items():
            swarm.add_node(name, stage, "--checkpoint-dir", str(tmp_path / "ckpt" / name))
        # Commits happen only once an outer round applied: committed > 0 means one did.
        _poll(lambda: swarm.status().committed_tokens > 0, 300, "a first commit", swarm)
        swarm.nodes["b0"].signal(signal.SIGKILL)
        assert swarm.nodes["b0"].popen.wait(10) == -signal.SIGKILL
        # Read after b0 is gone (a commit of b0's could land between a read and the kill),
        # so every commit past this is a0's, made after an applied round it checkpointed.
        at_kill = swarm.status().committed_tokens
        _poll(
            lambda: swarm.status().committed_tokens > at_kill + 8 * 1024,
            240,
            f"commits past {at_kill + 8 * 1024} after the kill",
            swarm,
        )
        ckpt = tmp_path / "ckpt"
        _poll(
            lambda: (
                (ckpt / "a0" / "stage0.safetensors").is_file()
                and any(ckpt.glob("*/stage1.safetensors"))
            ),
            240,
            "a0's stage-0 checkpoint and a stage-1 checkpoint (their applied outer rounds)",
            swarm,
        )
        codes = swarm.stop(timeout_s=120)
    finally:
        swarm.kill_all()
    assert codes.pop("b0") == -signal.SIGKILL
    assert codes == {"a0": 0, "a1": 0, "b1": 0, "coordinator": 0}, {
        n: p.tail(30) for n, p in swarm.nodes.items()
    }

    audit = swarm.audit()
    assert audit.exit_code == 0, audit.stdout
    epochs = audit.epochs
    assert epochs and all(e["lost"] == [] and e["duplicated"] == [] for e in epochs), epochs
    assert sum(e["committed_tokens"] for e in epochs) > at_kill + 8 * 1024

    # The survivors checkpointed at their outer steps and at drain: export and evaluate.
    # (b0 may have died before its first checkpoint: only directories that exist count)
    dirs = [tmp_path / "ckpt" / n for n in names if (tmp_path / "ckpt" / n).is_dir()]
    got = export_checkpoints(dirs, tmp_path / "model")
    assert set(got.rounds) == {0, 1} and min(got.rounds.values()) >= 1, got.rounds
    config, tensors = load_export(tmp_path / "model")
    data = load_dataset()
    kw = {"batch_size": 8, "seq_len": 128, "n_batches": 4}
    trained = evaluate_weights(config, tensors, data, **kw)
    untrained = evaluate_weights(config, build_stage(config, 0, 1).state_dict(), data, **kw)
    assert trained < untrained - 0.3, (trained, untrained)
