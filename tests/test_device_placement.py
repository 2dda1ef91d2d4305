"""Every tensor of a stage's compute lives where it should: the stage's parameters and
activations on the stage's device, the wire's and the outer loop's copies on the CPU,
with explicit moves at those boundaries. On a CPU box `DeviceGuard` (tests/device_guard.py)
runs the stage on `cpu:0` and raises on any op that mixes the two, as CUDA would; the
first tests show that it catches the bugs that once crashed `--device cuda`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from device_guard import STAGE_DEVICE, DeviceGuard, DeviceMix, virtual_device

from node.checkpoint import flat_copy
from node.compression import BoundaryCodec, over_the_wire
from node.diloco import merge_local_progress
from node.model import preset, save_export
from node.stage_compute import InnerConfig, StageCompute, throughput_probe

SEQ = 16
ROWS = 2
INNER = InnerConfig(lr=1e-3, warmup_steps=1, weight_decay=0.1, inner_batch_tokens=ROWS * SEQ,
                    cache_size=4)  # fmt: skip


def _stage(stage: int, codec: str, device: str = str(STAGE_DEVICE)) -> StageCompute:
    compute = StageCompute(preset("tiny"), stage, 2, codec, INNER, device=device)
    DeviceGuard.adopt(compute.model)
    return compute


def _flat(compute: StageCompute) -> torch.Tensor:
    return torch.cat([p.detach().flatten().to("cpu", torch.float32) for p in compute.parameters()])


# --- the guard catches what CUDA would refuse ----------------------------------------------


def test_the_guard_catches_a_cpu_input_fed_to_the_stage() -> None:
    with DeviceGuard():
        s1 = _stage(1, "fp16")
        with pytest.raises(DeviceMix, match="cpu"):
            s1.model(torch.zeros(ROWS, SEQ, s1.model.config.d_model))


def test_the_guard_catches_cpu_coefficients_times_the_stage_basis() -> None:
    with DeviceGuard():
        s1 = _stage(1, "subspace_int4")
        sub = s1.model.subspace
        assert sub is not None and virtual_device(sub.basis) == "stage"
        coeffs = torch.from_numpy(np.ones((ROWS, SEQ, sub.rank), dtype=np.float32))
        with pytest.raises(DeviceMix):
            sub.expand_grad(coeffs)


def test_the_guard_catches_a_cpu_snapshot_subtracted_from_stage_parameters() -> None:
    with DeviceGuard():
        s0 = _stage(0, "fp16")
        p = s0.parameters()[0]
        with pytest.raises(DeviceMix):
            p.detach().flatten() - torch.zeros(p.numel())
        with pytest.raises(DeviceMix, match="numpy"):
            p.detach().numpy()


# --- the stage's whole path under the guard -----------------------------------------------


def stage_path(codec: str, device: str, out: Path) -> None:
    """Two stages on `device`: the probe, a micro-batch through the wire both ways (and
    one recomputed after a cache miss), an inner step, an outer merge from CPU buffers,
    the state server's copy and an export."""
    torch.manual_seed(0)
    tokens = np.random.default_rng(1).integers(0, 256, size=(ROWS, SEQ + 1), dtype=np.uint8)
    s0, s1 = _stage(0, codec, device), _stage(1, codec, device)
    for s in (s0, s1):
        assert throughput_probe(s, ROWS, SEQ) > 0
    hidden = over_the_wire(s0.forward("mb", tokens, None))  # type: ignore[arg-type]
    grad, loss = s1.forward("mb", tokens, hidden)  # type: ignore[misc]
    assert np.isfinite(loss) and grad is not None
    before = _flat(s0)
    assert s0.backward("mb", tokens, None, over_the_wire(grad)) is None
    assert s0.inner_steps == 1 and s1.inner_steps == 1
    # A cache miss recomputes the forward from the wire's copy.
    hidden = over_the_wire(s0.forward("mb2", tokens, None))  # type: ignore[arg-type]
    s0.drop("mb2")
    grad, _ = s1.forward("mb2", tokens, hidden)  # type: ignore[misc]
    s0.backward("mb2", tokens, hidden, over_the_wire(grad))  # type: ignore[arg-type]
    assert s0.recomputes == 1
    # The outer merge: CPU snapshot and theta_g (the outer process's shared memory)
    # into the stage's parameters.
    theta_g, progressed = before * 0.5, _flat(s0)
    merge_local_progress(s0.parameters(), before, theta_g)
    s0.weights_changed()
    after = flat_copy(s0.parameters())  # the state server's and checkpoint's copy
    assert virtual_device(after) in ("cpu", None) and after.device.type == "cpu"
    torch.testing.assert_close(after, theta_g + (progressed - before))
    save_export(s0.model, s0.model.config, out / "export")
    assert s0.parameters()[0].device.type == torch.device(device).type


@pytest.mark.parametrize("codec", ["subspace_int4", "subspace_int8", "fp16", "int8", "raw"])
def test_a_micro_batch_an_inner_step_and_an_outer_merge_stay_on_their_devices(
    codec: str, tmp_path: Path
) -> None:
    with DeviceGuard() as guard:
        stage_path(codec, str(STAGE_DEVICE), tmp_path)
    assert guard.ops > 1000  # the guard saw the stage's work, not a few calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("codec", ["subspace_int4", "fp16"])
def test_the_stage_path_runs_on_cuda(codec: str, tmp_path: Path) -> None:
    stage_path(codec, "cuda", tmp_path)


def test_a_boundary_codec_decodes_onto_the_device_of_its_basis() -> None:
    with DeviceGuard():
        s1 = _stage(1, "subspace_int4")
        codec = s1.codec_in
        assert isinstance(codec, BoundaryCodec)
        tokens = torch.zeros(ROWS, SEQ, dtype=torch.int64, device=STAGE_DEVICE)
        x = torch.randn(ROWS, SEQ, s1.model.config.d_model, device=STAGE_DEVICE)
        enc = over_the_wire(codec.encode_forward(x, tokens))
        assert virtual_device(codec.decode_forward(enc, tokens)) == "stage"
        genc = over_the_wire(codec.encode_backward(x, tokens))
        assert virtual_device(codec.decode_backward(genc, tokens)) == "stage"
