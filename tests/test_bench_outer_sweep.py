"""`agora bench outer-sweep`: a tiny sweep writes one finite row per setting, and one
simulated round applies the real outer step (eta 1, mu 0 and one replica: theta_g becomes
the replica's trained weights, and the replica continues from theta_g)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from bench.outer_sweep import main
from bench.outer_sweep_sim import Common, Setting, Simulation, flat_params
from node.data import load_dataset

ROW_KEYS = {
    "eta", "mu", "H", "p", "churn", "data", "inner_schedule", "eval_loss",
    "central_eval_loss", "gap_pct", "wall_s", "rounds", "tokens",
}  # fmt: skip


def test_tiny_sweep_writes_rows_with_finite_losses(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    rc = main(
        [
            "--tokens", "4096", "--batch-size", "4", "--seq-len", "64", "--H", "2",
            "--eta", "0.7,1.0", "--mu", "0.5", "--churn", "0.5", "--data", "lease",
            "--eval-batches", "2", "--json", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    got = json.loads(out.read_text())
    assert math.isfinite(got["eval_loss_central"])
    assert len(got["rows"]) == 2
    assert [r["eta"] for r in got["rows"]] == [0.7, 1.0]
    for r in got["rows"]:
        assert ROW_KEYS <= set(r)
        assert math.isfinite(r["eval_loss"]) and math.isfinite(r["gap_pct"])
        assert r["central_eval_loss"] == got["eval_loss_central"]
        # 4096 tokens in rounds of 2 replicas x 2 steps x 128 tokens; kills at 1/3 and 2/3
        assert r["rounds"] == 8 and r["tokens"] == 4096 and len(r["events"]) == 2
        assert r["rounds_applied"] <= r["rounds"]


def test_one_round_with_eta_1_mu_0_leaves_the_replica_at_theta_g() -> None:
    torch.set_num_threads(1)
    common = Common(tokens=256, replicas=1, batch_size=2, seq_len=64, eval_batches=1)
    sim = Simulation(common, Setting(eta=1.0, mu=0.0, H=2, churn=0.0), load_dataset())
    before = sim.state.theta_g.clone()
    rep = sim.replicas[0]
    assert rep is not None
    contribs = sim.train(0)
    trained = flat_params(rep.model)
    assert len(contribs) == 1 and contribs[0].tokens == 2 * 128
    log = sim.apply(0, contribs)
    assert log.applied and log.eta_r == 1.0 and sim.state.round == 1
    assert not torch.equal(sim.state.theta_g, before)
    # eta 1, mu 0, alone: theta_g - (theta_g - theta) = theta (up to rounding)
    torch.testing.assert_close(sim.state.theta_g, trained, rtol=0, atol=1e-6)
    assert torch.equal(flat_params(rep.model), sim.state.theta_g)
    assert torch.equal(sim.state.m, contribs[0].delta)  # m <- 0 * m + D
