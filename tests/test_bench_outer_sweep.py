"""`agora bench outer-sweep`: a tiny sweep writes one finite row per setting, and one
simulated round applies the real outer step (eta 1, mu 0 and one replica: theta_g becomes
the replica's trained weights, and the replica continues from theta_g)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from pathlib import Path

import torch

from bench.convergence import CENTRAL_FLOOR
from bench.convergence_stats import central_losses
from bench.outer_sweep import main
from bench.outer_sweep_data import GrantQueue, PooledBatches
from bench.outer_sweep_sim import Common, Setting, Simulation, central, flat_params
from coordinator.config import CoordinatorConfig
from coordinator.journal import Journal
from coordinator.leases import Lease, LeaseBook, Shard
from node.baseline import TrainConfig
from node.config import NodeConfig
from node.data import Dataset, load_dataset, split_dataset
from node.lease_pool import Window
from protocol.control import LeaseInfo
from protocol.corpus import ShardInfo

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


# --- pooled data: the lease data path ------------------------------------------------------


def _pooled(
    dataset: Dataset, *, grant: int, pool: int, seed: int | None, order_seed: int = 0
) -> PooledBatches:
    grants = GrantQueue(dataset.manifest.train, grant_tokens=grant, seed=order_seed)
    rng = None if seed is None else random.Random(seed)
    return PooledBatches(grants, dataset, rows=4, seq_len=64, lease_pool=pool, rng=rng)


def _small_dataset() -> Dataset:
    data = random.Random(7).randbytes(16 * 4096)
    return split_dataset(data, "random-bytes", shard_tokens=4096)


def test_the_grant_model_grants_what_the_coordinators_lease_book_grants() -> None:
    shards = [
        ShardInfo(shard_id=i, start=0, tokens=t, sha256="0" * 64)
        for i, t in enumerate([3000, 1000, 2500, 700, 4096])
    ]
    model = GrantQueue(shards, grant_tokens=1024, seed=5)
    book = LeaseBook(
        [Shard(shard_id=s.shard_id, tokens=s.tokens) for s in shards],
        journal=Journal(), ttl_s=1e9, order_seed=5,
    )  # fmt: skip
    rng = random.Random(1)
    held: list[tuple[LeaseInfo, Lease]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.5 or not held:
            mine, theirs = model.acquire(), book.acquire("peer", 0.0, max_tokens=1024)[0]
            if mine is None:
                assert theirs is None
                continue
            assert theirs is not None
            got = (theirs.shard_id, theirs.committed, theirs.limit, theirs.data_epoch)
            assert (mine.shard_id, mine.committed, mine.limit, mine.data_epoch) == got
            held.append((mine, theirs))
            continue
        mine, theirs = held.pop(rng.randrange(len(held)))
        if op < 0.85:  # commit the whole range, sometimes in two parts
            cuts = [mine.committed, mine.limit]
            if mine.limit - mine.committed > 1 and rng.random() < 0.5:
                cuts.insert(1, rng.randrange(mine.committed + 1, mine.limit))
            for a, b in itertools.pairwise(cuts):
                model.commit(mine.lease_id, a, b)
                book.commit("peer", theirs.lease_id, theirs.epoch, a, b, 0.0)
        else:  # released: part committed, then given back
            if mine.limit - mine.committed > 1:
                cut = rng.randrange(mine.committed + 1, mine.limit)
                model.commit(mine.lease_id, mine.committed, cut)
                book.commit("peer", theirs.lease_id, theirs.epoch, theirs.committed, cut, 0.0)
            model.release(mine.lease_id)
            book.release("peer", theirs.lease_id, theirs.epoch, 0.0)
    assert model.data_epoch == book.data_epoch >= 2


def test_pooled_data_trains_every_window_of_an_epoch_once_and_commits_every_token() -> None:
    torch.set_num_threads(1)
    ds = _small_dataset()
    src = _pooled(ds, grant=640, pool=3, seed=1)
    taken: list[tuple[int, int]] = []
    committed: dict[int, list[tuple[int, int]]] = {}
    take, commit = src.pool.take, src.grants.commit

    def record_take(n: int, rng: random.Random | None = None) -> list[Window]:
        got = take(n, rng)
        taken.extend((w.lease.shard_id, w.start) for w in got)
        return got

    def record_commit(lease_id: int, start: int, end: int) -> None:
        if src.grants.data_epoch == 0:
            committed.setdefault(src.grants.leases[lease_id].shard_id, []).append((start, end))
        commit(lease_id, start, end)

    src.pool.take = record_take  # type: ignore[method-assign]
    src.grants.commit = record_commit  # type: ignore[method-assign]
    while src.grants.data_epoch == 0:
        inputs, targets = next(src)
        assert inputs.shape[1] == 64 and torch.equal(inputs[:, 1:], targets[:, :-1])
        # a round after every inner step, applied with this replica: its windows commit
        src.round_start()
        src.round_end(applied=True, contributed=True)
    train = {s.shard_id: s.tokens for s in ds.manifest.train}
    assert len(train) == 15  # 16 shards, one held out
    # every window of every training shard exactly once (a shard's last 64 tokens have no
    # window: its last window's targets end at the shard's end)
    expected = sorted((i, s) for i, n in train.items() for s in range(0, n - 64, 64))
    assert sorted(taken) == expected
    for i, n in train.items():  # committed ranges tile each shard, in order
        ranges = committed[i]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_pooled_data_is_seeded_shuffled_across_leases_or_in_lease_order() -> None:
    torch.set_num_threads(1)
    ds = _small_dataset()

    def first(src: PooledBatches, n: int = 6) -> list[torch.Tensor]:
        return [next(src)[0] for _ in range(n)]

    a = first(_pooled(ds, grant=640, pool=3, seed=1))
    b = first(_pooled(ds, grant=640, pool=3, seed=1))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    c = first(_pooled(ds, grant=640, pool=3, seed=2))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    d = first(_pooled(ds, grant=640, pool=3, seed=1, order_seed=1))
    assert not all(torch.equal(x, y) for x, y in zip(a, d, strict=True))
    # in lease order a micro-batch is 4 consecutive windows of one lease
    in_order = _pooled(ds, grant=640, pool=3, seed=None)
    win = next(in_order)[0]
    stream = torch.cat(list(win))
    lease = in_order.pool.leases[min(in_order.pool.leases)]
    shard = in_order.pool.shard(lease.shard_id)
    assert shard is not None
    start = lease.committed
    assert torch.equal(stream, torch.from_numpy(shard[start : start + 256].astype("int64")))


def test_pooled_defaults_are_the_coordinators_and_the_nodes(tmp_path: Path) -> None:
    s = Setting()
    assert s.grant_tokens == CoordinatorConfig().grant_tokens
    node = {f.name: f.default for f in dataclasses.fields(NodeConfig)}
    assert (s.lease_pool, s.shuffle_windows) == (node["lease_pool"], node["shuffle_windows"])
    assert s.shuffle_windows
    out = tmp_path / "sweep.json"
    rc = main(
        [
            "--tokens", "2048", "--batch-size", "4", "--seq-len", "64", "--H", "2",
            "--data", "pooled", "--grant-tokens", "1024", "--lease-pool", "2",
            "--shuffle-windows", "on,off", "--eval-batches", "1", "--json", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["data"], r["grant_tokens"], r["lease_pool"], r["shuffle_windows"]) for r in rows] == [
        ("pooled", 1024, 2, True), ("pooled", 1024, 2, False)
    ]  # fmt: skip
    assert all(math.isfinite(r["eval_loss"]) for r in rows)


def test_robust_aggregation_is_a_switch_the_sweep_compares(tmp_path: Path) -> None:
    """`--robust on,off`: the node's robust aggregation (its default) against the plain
    weighted mean, each row counting the contributions its outer steps left out."""
    node = {f.name: f.default for f in dataclasses.fields(NodeConfig)}
    assert Setting().robust == node["outer_robust"]
    out = tmp_path / "sweep.json"
    rc = main(
        [
            "--tokens", "3072", "--batch-size", "6", "--seq-len", "64", "--H", "2",
            "--replicas", "3", "--robust", "on,off", "--eval-batches", "1",
            "--json", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["robust"] for r in rows] == [True, False]
    assert all(r["rejected_contributions"] >= 0 and math.isfinite(r["eval_loss"]) for r in rows)
    assert rows[1]["rejected_contributions"] == 0  # the plain mean leaves nothing out


def test_the_simulations_central_run_is_the_convergence_benchs() -> None:
    """Both benches measure gaps against a central run; with the same steps, seed and
    schedule they must be the same run (before, the simulation's decayed its lr by
    cosine while the convergence bench's stayed constant, as the nodes' does)."""
    torch.set_num_threads(1)
    dataset = load_dataset()
    common = Common(preset="tiny", batch_size=2, seq_len=32, warmup=2, eval_batches=1, seed=3)
    loss, tokens, _ = central(common, dataset, 6 * common.central_tokens)
    cfg = TrainConfig(
        preset="tiny", steps=6, batch_size=2, seq_len=32, warmup=2, eval_every=6,
        eval_batches=1, threads=1, seed=3, min_lr_ratio=CENTRAL_FLOOR["constant"],
        weight_decay=common.weight_decay, lr=common.lr,
    )  # fmt: skip
    losses, _ = central_losses(cfg, dataset, [6])
    assert tokens == 6 * common.central_tokens and loss == losses[6]
    cosine, _, _ = central(
        dataclasses.replace(common, central_schedule="cosine"), dataset, 6 * common.central_tokens
    )
    assert cosine != loss
