"""Stage checkpoints (node.checkpoint): round-trip, atomic replacement, the policy, and
the errors a damaged or foreign file gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from node.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    StageCheckpointer,
    checkpoint_paths,
    find_checkpoints,
    read_checkpoint,
    resume_state,
    split_flat,
    stage_checkpointer,
    write_checkpoint,
)
from node.model import build_stage, preset
from protocol.control import RunInfo

CFG = preset("tiny")


def _run(n_stages: int = 2) -> RunInfo:
    return RunInfo(
        run_id="r1", model_preset="tiny", n_stages=n_stages, codec="subspace_int8", seed=0,
        heartbeat_interval_s=1.0, lease_ttl_s=10.0, dataset_name="stdlib", dataset_hash="0" * 64,
        shards=4, data_epoch=0,
    )  # fmt: skip


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_round_trip_through_the_checkpointer(tmp_path: Path) -> None:
    stage = build_stage(CFG, 1, 2)
    ck = stage_checkpointer(tmp_path, 1, _run(), 1, stage)
    flat = _flat(stage) + 0.25  # a theta_g that differs from the init
    assert ck.due()
    mom = torch.full_like(flat, 0.5)
    meta, tensors, momentum = ck.capture(flat, mom, 7)
    path = ck.write(meta, tensors, momentum)
    assert path == checkpoint_paths(tmp_path, 1)[0] and ck.last_round == 7
    assert ck.on_disk(7, "") and not ck.on_disk(7, "ab12") and not ck.on_disk(8, "")

    got = read_checkpoint(path)
    assert got.meta.round == 7 and got.meta.stage == 1 and got.meta.n_stages == 2
    assert got.meta.run_id == "r1" and got.meta.preset == "tiny" and got.meta.seed == 0
    assert got.meta.momentum and got.momentum is not None
    # Same names as the stage's state dict, same values as the flat vector, in order.
    names = [n for n, _ in stage.named_parameters()]
    assert sorted(got.tensors) == sorted(names) == sorted(got.momentum)
    assert torch.equal(torch.cat([got.tensors[n].flatten() for n in names]), flat)
    assert torch.equal(torch.cat([got.momentum[n].flatten() for n in names]), mom)

    # A node of the same run and stage resumes from it; any other run or stage does not.
    resumed = resume_state(tmp_path, _run(), 1, stage)
    assert resumed is not None and resumed.round == 7 and resumed.momentum is not None
    assert torch.equal(resumed.theta_g, flat) and torch.equal(resumed.momentum, mom)
    assert resume_state(tmp_path, _run(n_stages=3), 1, stage) is None
    assert resume_state(tmp_path, _run(), 0, build_stage(CFG, 0, 2)) is None  # no file
    other = RunInfo.from_wire({**_run().to_wire(), "run_id": "r2"})
    assert resume_state(tmp_path, other, 1, stage) is None
    sidecar = json.loads(checkpoint_paths(tmp_path, 1)[1].read_text())
    assert sidecar["round"] == 7 and len(sidecar["sha256"]) == 64
    # No temporary files are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage1.json", "stage1.safetensors"]


def test_a_state_without_momentum_is_written_and_resumed_without_one(tmp_path: Path) -> None:
    # A node without an outer loop checkpoints its trained weights at drain: round 0, no m.
    stage = build_stage(CFG, 0, 2)
    ck = stage_checkpointer(tmp_path, 1, _run(), 0, stage)
    flat = _flat(stage) - 0.5
    meta, tensors, momentum = ck.capture(flat, None, 0)
    assert momentum is None and not meta.momentum
    got = read_checkpoint(ck.write(meta, tensors, momentum))
    assert got.momentum is None and got.meta.round == 0
    names = [n for n, _ in stage.named_parameters()]
    assert torch.equal(torch.cat([got.tensors[n].flatten() for n in names]), flat)
    resumed = resume_state(tmp_path, _run(), 0, stage)
    assert resumed is not None and resumed.momentum is None


def test_momentum_is_stored_when_given(tmp_path: Path) -> None:
    t = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    m = {"a": torch.ones(2, 3)}
    meta = CheckpointMeta(
        run_id="r", preset="tiny", seed=1, stage=0, n_stages=1, round=2, numel=6, momentum=True
    )
    got = read_checkpoint(write_checkpoint(tmp_path, meta, t, m))
    assert got.momentum is not None and torch.equal(got.momentum["a"], m["a"])
    assert torch.equal(got.tensors["a"], t["a"])


def test_a_newer_checkpoint_replaces_the_old_one(tmp_path: Path) -> None:
    meta = CheckpointMeta(run_id="r", preset="tiny", seed=0, stage=0, n_stages=1, round=1, numel=2)
    write_checkpoint(tmp_path, meta, {"w": torch.zeros(2)})
    write_checkpoint(
        tmp_path, CheckpointMeta(**{**meta.to_dict(), "round": 2}), {"w": torch.ones(2)}
    )
    got = read_checkpoint(checkpoint_paths(tmp_path, 0)[0])
    assert got.meta.round == 2 and torch.equal(got.tensors["w"], torch.ones(2))
    assert find_checkpoints([tmp_path]) == [checkpoint_paths(tmp_path, 0)[0]]


def test_policy_every_n_rounds_and_final() -> None:
    ck = StageCheckpointer(
        Path("unused"), every_rounds=3, run_id="r", preset="tiny", seed=0, stage=0,
        n_stages=1, names=["w"], shapes=[torch.Size([2])],
    )  # fmt: skip
    assert [ck.due() for _ in range(3)] == [False, False, True]
    assert ck.due(final=True)
    with pytest.raises(ValueError, match="every_rounds"):
        StageCheckpointer(
            Path("x"), every_rounds=0, run_id="r", preset="p", seed=0, stage=0, n_stages=1,
            names=[], shapes=[],
        )  # fmt: skip


def test_split_flat_checks_the_size() -> None:
    with pytest.raises(ValueError, match="elements"):
        split_flat(torch.zeros(5), ["a"], [torch.Size([2, 2])])


def test_damaged_or_foreign_files_give_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "stage0.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_checkpoint(bad)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(bad))  # valid safetensors, no agora header
    with pytest.raises(CheckpointError, match="description"):
        read_checkpoint(bad)
    with pytest.raises(CheckpointError, match="no such"):
        read_checkpoint(tmp_path / "stage9.safetensors")
    meta = CheckpointMeta(run_id="r", preset="tiny", seed=0, stage=0, n_stages=1, round=0, numel=2)
    write_checkpoint(tmp_path, meta, {"w": torch.tensor([1.0, float("nan")])})
    with pytest.raises(CheckpointError, match="not finite"):
        read_checkpoint(bad)
