"""`agora bench convergence`: the statistics and sizing helpers, the central run that is
evaluated at several token counts (it equals `node.baseline.train` at its last step),
several seeds on a user corpus, and one smoke-sized real swarm run compared with the
central run at the swarm's own committed tokens."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from bench.convergence import main, summarise
from bench.convergence_stats import (
    central_losses,
    central_steps,
    heldout_split,
    mean_interval,
    robust_rejections,
    split_shards,
    t975,
)
from node.baseline import TrainConfig, train
from node.config import NodeConfig
from node.data import load_dataset
from node.diloco import Contribution, DilocoConfig, direction_problems, pair_problem

DOCS = Path(__file__).resolve().parent.parent / "docs"
SMALL = ["--batch-size", "4", "--seq-len", "64", "--eval-batches", "2", "--warmup", "2"]


def corpus(tmp_path: Path) -> Path:
    """A text directory no setting was tuned on: a copy of the repository's docs."""
    out = tmp_path / "corpus"
    shutil.copytree(DOCS, out)
    return out


def test_mean_interval_is_a_student_t_95_interval() -> None:
    one = mean_interval([2.5])
    assert (one.mean, one.low, one.high, one.n) == (2.5, None, None, 1)
    iv = mean_interval([1.0, 2.0, 6.0])  # mean 3, s = sqrt(7), t(2) = 4.3027
    half = 4.3027 * math.sqrt(7) / math.sqrt(3)
    assert iv.mean == 3.0 and iv.n == 3
    assert iv.low == pytest.approx(3 - half) and iv.high == pytest.approx(3 + half)
    assert t975(30) == 2.0423 and t975(1000) == pytest.approx(1.9623, abs=1e-4)
    with pytest.raises(ValueError):
        mean_interval([])
    with pytest.raises(ValueError):
        mean_interval([1.0, float("nan")])


def test_central_steps_are_the_nearest_to_each_count() -> None:
    assert central_steps([335_872, 233_600, 1000], 2048) == {335_872: 164, 233_600: 114, 1000: 1}
    with pytest.raises(ValueError):
        central_steps([0], 2048)


def test_central_run_evaluated_on_the_way_equals_train_at_its_last_step() -> None:
    torch.set_num_threads(1)
    dataset = load_dataset()
    cfg = TrainConfig(
        preset="tiny", steps=6, batch_size=2, seq_len=32, warmup=2, eval_every=6,
        eval_batches=1, threads=1, seed=3,
    )  # fmt: skip
    losses, _ = central_losses(cfg, dataset, [2, 6])
    assert set(losses) == {2, 6} and losses[2] != losses[6]
    ref, _ = train(cfg, dataset)
    assert losses[6] == ref.eval_loss


def test_validation_and_test_splits_are_disjoint_halves_of_the_heldout_shards(
    tmp_path: Path,
) -> None:
    dataset = load_dataset(corpus(tmp_path))
    held = dataset.manifest.heldout
    val, test = split_shards(held, "validation"), split_shards(held, "test")
    assert len(held) >= 2 and val and test
    assert {s.shard_id for s in val} | {s.shard_id for s in test} == {s.shard_id for s in held}
    assert not {s.shard_id for s in val} & {s.shard_id for s in test}
    assert heldout_split(dataset, "heldout") is dataset
    v, t = heldout_split(dataset, "validation"), heldout_split(dataset, "test")
    assert v.heldout.numel() + t.heldout.numel() == dataset.heldout.numel()
    assert v.heldout.dtype == dataset.heldout.dtype and torch.equal(v.train, dataset.train)
    with pytest.raises(ValueError, match="at least 2 held-out shards"):
        split_shards(held[:1], "validation")


def test_summarise_reports_each_seed_and_the_interval() -> None:
    rows = [
        {"seed": s, "swarm": {"gap_pct": g, "traffic_ratio": 100.0, "outer_bytes_total": 5.0,
                              "ddp_equivalent_bytes": 500.0, "robust_rejections": s,
                              "robust_clipped": 2 * s, "largest_group": 2}}
        for s, g in ((0, 1.0), (1, 3.0))
    ]  # fmt: skip
    out = summarise(rows)
    assert out["gap_pct_per_seed"] == [1.0, 3.0] and out["gap_pct_mean"] == 2.0
    assert out["outer_bytes_total"] == 10.0 and out["ddp_equivalent_bytes"] == 1000.0
    assert out["gap_pct_ci_low"] < 2.0 < out["gap_pct_ci_high"]
    assert "gap_churn_pct_mean" not in out and "gap_4stage_pct_mean" not in out
    assert out["robust_rejections_per_seed"] == [0, 1] and out["largest_group"] == 2
    assert out["robust_clipped_per_seed"] == [0, 2]
    four = [r | {"4stage": r["swarm"] | {"gap_pct": 2 * r["swarm"]["gap_pct"]}} for r in rows]
    got = summarise(four)
    assert got["gap_4stage_pct_per_seed"] == [2.0, 6.0] and got["gap_4stage_pct_mean"] == 4.0
    assert got["outer_bytes_total_4stage"] == 10.0 and got["gap_pct_mean"] == 2.0
    one = summarise(rows[:1])
    assert one["gap_pct_ci_low"] is None and one["gap_pct_ci_high"] is None


def test_robust_rejections_count_each_group_round_once() -> None:
    pair = pair_problem(
        Contribution(delta=torch.ones(64), tokens=1, staleness=0),
        Contribution(delta=-torch.ones(64), tokens=1, staleness=0),
        DilocoConfig(),
    )
    direction = direction_problems(
        [torch.ones(256), torch.ones(256), -torch.ones(256)], [0, 1, 2], 4.0
    )
    assert pair is not None and 2 in direction
    why = f"part 0: {pair[0]}; part 1: {direction[2][0]}; part 1: norm 9 above 4 x median 1"
    member = {"round": 3, "group_size": 2, "digest": "d", "rejected": {"b": why}}
    events = [
        (0, member),
        (0, member | {"rejected": {"b": why}}),  # its groupmate's event for the same round
        (1, member),  # stage 1's round 3 is another group round
        (0, {"round": 4, "group_size": 1, "digest": "e", "rejected": {}}),  # alone
        (0, {"round": 5, "group_size": 3, "digest": "f", "rejected": {"c": "part 2: pair"}}),
        # each member counts the clipping of the part it reduced: summed, not deduplicated
        (1, {"round": 6, "group_size": 3, "digest": "g", "rejected": {}, "clipped": 1}),
        (1, {"round": 6, "group_size": 3, "digest": "g", "rejected": {}, "clipped": 2}),
    ]
    got = robust_rejections(iter(events))
    assert got == {
        "group_rounds": 4, "largest_group": 3, "part_contributions": 4 + 4 + 9 + 9,
        "robust_rejections": 4, "robust_clipped": 3,
    }  # fmt: skip
    assert robust_rejections([])["largest_group"] == 1


def test_central_runs_at_two_seeds_on_a_user_corpus(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    data = corpus(tmp_path)
    args = ["--runs", "central", "--seeds", "2", "--seed", "5", "--tokens", "1024"]
    rc = main(
        [*args, *SMALL, "--dataset", str(data), "--split", "test", "--json", str(out), "--quiet"]
    )
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["seeds"] == [5, 6] and got["dataset"] == str(data) and got["split"] == "test"
    assert got["central_schedule"] == "constant"  # the nodes' inner schedule
    assert got["outer_compression"] == NodeConfig.__dataclass_fields__["outer_compression"].default
    assert got["outer_compression_source"] == "node default"
    assert [r["seed"] for r in got["runs"]] == [5, 6]
    losses = [r["central"]["at"]["1024"]["eval_loss"] for r in got["runs"]]
    assert all(math.isfinite(v) for v in losses) and losses[0] != losses[1]
    assert all(r["central"]["tokens"] == 1024 for r in got["runs"])


def test_bad_arguments_fail_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seeds", "0"]) == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err
    assert main(["--dataset", str(tmp_path / "missing"), "--runs", "central"]) == 2
    assert "--dataset" in capsys.readouterr().err
    assert main(["--runs", "swarm,everything"]) == 2
    assert "bad --runs" in capsys.readouterr().err
    assert main(["--replicas", "1", "--runs", "central,churn"]) == 2
    assert "--replicas >= 2" in capsys.readouterr().err
    assert main(["--stages", "1", "--runs", "swarm"]) == 2
    assert "--stages must be >= 2" in capsys.readouterr().err
    assert main(["--stages", "5", "--runs", "swarm"]) == 2  # tiny has 4 layers
    assert "too few for 5 stages" in capsys.readouterr().err
    assert main(["--lease-pool", "0", "--runs", "swarm"]) == 2
    assert "--lease-pool must be >= 1" in capsys.readouterr().err
    assert main(["--inner-lr", "0", "--runs", "swarm"]) == 2
    assert "--inner-lr must be > 0" in capsys.readouterr().err
    assert main(["--preset", "nope", "--runs", "central"]) == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)  # four nodes and a coordinator start on a loaded 2-core box
def test_smoke_swarm_against_central_at_its_own_tokens(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    rc = main(
        [
            "--runs", "central,swarm", "--seeds", "1", "--seed", "1", "--tokens", "4096",
            *SMALL, "--micro-batch", "4", "--outer-every-steps", "2", "--inner-lr", "3e-3",
            "--lease-pool", "2", "--grant-tokens", "2048",
            "--dataset", str(corpus(tmp_path)), "--workdir", str(tmp_path / "w"),
            "--run-timeout", "400", "--json", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["seeds"] == [1] and got["outer_compression_source"] == "node default"
    swarm = got["runs"][0]["swarm"]
    assert swarm["audit_clean"] and swarm["tokens_committed"] >= 4096
    # every outer byte counted on the wire: more than the payload and state, none bypassing
    assert swarm["outer_bypassing"] == [], swarm["outer_bypassing"]
    assert swarm["outer_bytes_total"] > swarm["outer_bytes"] + swarm["outer_state_bytes"] > 0
    assert got["outer_bytes_total"] == swarm["outer_bytes_total"]
    # the central reference is at the swarm run's own committed tokens (to half a batch)
    assert abs(swarm["tokens_central"] - swarm["tokens_committed"]) <= 4 * 64 // 2
    central = got["runs"][0]["central"]["at"][str(swarm["tokens_committed"])]
    assert central["eval_loss"] == swarm["eval_loss_central"]
    assert got["gap_pct_per_seed"] == [swarm["gap_pct"]] and math.isfinite(swarm["gap_pct"])
    assert got["gap_pct_mean"] == swarm["gap_pct"] and got["gap_pct_ci_high"] is None
    run_toml = (tmp_path / "w" / "seed1" / "swarm" / "run.toml").read_text()
    assert "seed = 1" in run_toml
    # the swarm's inner lr apart from the central run's
    assert (got["lr"], got["inner_lr"]) == (2e-3, 3e-3)
    node_toml = (tmp_path / "w" / "seed1" / "swarm" / "s0-a.toml").read_text()
    assert "lr = 0.003" in node_toml and "lease_pool = 2" in node_toml
    assert "grant_tokens = 2048" in run_toml and got["lease_pool"] == 2
    # its commits rode in group rounds of two, and what robust aggregation left out of
    # them is counted (honest pairs can trip the pair bound at two inner steps a round)
    assert swarm["group_rounds"] >= 1 and got["largest_group"] == 2
    assert got["robust_rejections_per_seed"] == [swarm["robust_rejections"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_alone_no_codec_no_outer_loop(tmp_path: Path) -> None:
    # The first rung of the attribution ladder: 2 stages x 1 replica, raw boundaries, no
    # outer loop. Its nodes write their trained weights at drain, which the export reads.
    out = tmp_path / "p.json"
    rc = main(
        [
            "--runs", "central,swarm", "--seeds", "1", "--tokens", "4096", *SMALL,
            "--micro-batch", "4", "--stages", "2", "--replicas", "1", "--codec", "raw",
            "--outer-every-steps", "0", "--dataset", str(corpus(tmp_path)),
            "--workdir", str(tmp_path / "w"), "--run-timeout", "240", "--json", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    got = json.loads(out.read_text())
    assert (got["stages"], got["replicas"], got["codec"]) == (2, 1, "raw")
    swarm = got["runs"][0]["swarm"]
    assert swarm["audit_clean"] and swarm["tokens_committed"] >= 4096
    assert swarm["export_rounds"] == {"0": 0, "1": 0}  # no outer loop: round 0, trained
    assert swarm["outer_rounds"] == 0 and swarm["outer_bytes_total"] == 0
    assert swarm["ddp_equivalent_bytes"] == 0 and swarm["traffic_ratio"] is None
    # the trained weights, not the initial ones (about ln 256 = 5.5 nats per byte)
    assert swarm["eval_loss"] < 5.0 and math.isfinite(swarm["gap_pct"])
    # also compared at the tokens its stage 0 trained, to half a central batch
    assert abs(swarm["tokens_central_trained"] - swarm["tokens_trained"]) <= 4 * 64 // 2
    assert got["gap_trained_pct_per_seed"] == [swarm["gap_trained_pct"]]
