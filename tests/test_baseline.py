"""`agora baseline`: short real runs on the tiny preset write JSON, CSV and PNG with a
finite, falling loss; a run can start from an export and can simulate compressed stages."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from node.baseline import TrainConfig, lr_at, main

FAST = ["--preset", "tiny", "--batch-size", "8", "--seq-len", "64", "--threads", "1", "--quiet"]


def _run(tmp: Path, name: str, *extra: str) -> dict:  # type: ignore[type-arg]
    out = tmp / name
    rc = main([*FAST, "--out", str(out), "--json", str(out / "r.json"), *extra])
    assert rc == 0
    return json.loads((out / "r.json").read_text())  # type: ignore[no-any-return]


def test_short_run_writes_json_csv_png_with_falling_loss(tmp_path: Path) -> None:
    r = _run(tmp_path, "a", "--steps", "40", "--eval-every", "10", "--lr", "3e-3")
    assert {"eval_loss", "tokens", "tokens_per_s"} <= set(r)
    assert r["tokens"] == 40 * 8 * 64 and r["tokens_per_s"] > 0
    rows = list(csv.DictReader(Path(r["csv"]).open()))
    assert len(rows) == 40
    evals = [float(x["eval_loss"]) for x in rows if x["eval_loss"]]
    train = [float(x["train_loss"]) for x in rows]
    assert len(evals) == 4 and all(math.isfinite(v) for v in evals + train)
    assert evals[-1] == pytest.approx(r["eval_loss"])
    assert evals[-1] < evals[0] - 0.3 and evals[-1] < math.log(256) - 1.0
    assert sum(train[-5:]) / 5 < train[0] - 1.0
    assert Path(r["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the trained weights are an export that a new run can start from
    again = _run(tmp_path, "b", "--steps", "1", "--lr", "1e-9", "--init", r["export"])
    fresh = _run(tmp_path, "c", "--steps", "1", "--lr", "1e-9")
    assert again["eval_loss"] < fresh["eval_loss"] - 0.3
    assert again["eval_loss"] == pytest.approx(r["eval_loss"], abs=0.05)


def test_compressed_stages_and_user_dataset(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    line = json.dumps({"text": "def f(x):\n    return x + 1\n" * 4})
    data.write_text("\n".join([line] * 300))
    r = _run(
        tmp_path, "s", "--steps", "20", "--eval-every", "10",
        "--compress", "subspace_int4", "--stages", "2", "--dataset", str(data),
    )  # fmt: skip
    assert r["dataset"] == "d.jsonl" and math.isfinite(r["eval_loss"])
    (b,) = r["boundaries"]
    assert b["tokens"] == 20 * 8 * 64 and b["ratio"] > 20  # tiny: d=128, k=32 at 4 bits


def test_bad_options_exit_2_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*FAST, "--compress", "int8", "--stages", "1", "--out", str(tmp_path)]) == 2
    assert "--stages" in capsys.readouterr().err
    assert main([*FAST, "--dataset", str(tmp_path / "missing.txt"), "--out", str(tmp_path)]) == 2
    toml = tmp_path / "run.toml"
    toml.write_text("[baseline]\nsteps = 2\nbogus = 1\n")
    assert main([*FAST, "--config", str(toml), "--out", str(tmp_path)]) == 2
    assert "bogus" in capsys.readouterr().err


def test_learning_rate_schedule() -> None:
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1)
    assert lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 99) == pytest.approx(0.1, abs=1e-3)
    lrs = [lr_at(cfg, s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
