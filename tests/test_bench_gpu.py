"""`agora bench gpu` on the CPU as its smoke test (same code path, a tiny preset): both
measurements are taken and reported; without CUDA the default device is refused with
exit 2 and a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_the_bench_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(["--seconds", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_smoke_run_on_the_cpu_measures_both_and_reports_them(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--preset", "tiny", "--seconds", "4", "--seq-len", "32",
            "--micro-batch", "2", "--warmup-steps", "1", "--workdir", str(tmp_path / "swarm"),
            "--json", str(out)]  # fmt: skip
    assert gpu.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["central"]["tokens_per_s"] > 0 and result["central"]["steps"] >= 1
    assert result["swarm"]["tokens_per_s"] > 0
    assert result["swarm"]["boundary_bytes_per_token"] > 0 and result["swarm"]["codec"] == "fp16"
    assert result["swarm"]["exit_codes"] == {"s0": 0, "s1": 0, "coordinator": 0}
    assert result["swarm_over_central"] > 0
    assert result["central"]["mfu"] is None  # no peak FLOP/s known for a CPU


def test_mfu_is_six_n_tokens_over_the_peak() -> None:
    assert gpu.mfu(100_000_000, 1000.0, 989.0) == round(6e11 / 989e12, 4)
    assert gpu.mfu(1, 1.0, None) is None
