"""Outer-loop processes of one stage on loopback: real hivemind in real subprocesses.

The pytest process only imports `node.outer_link` (no hivemind): each replica is an
`OuterLink` whose outer process runs the DHT and averager.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import torch
import trio

from node.checkpoint import GlobalState
from node.diloco import DilocoConfig
from node.events import EventLog, read_events
from node.lease_pool import CommitRange, LeasePool, RoundFacts, RoundMark, RoundVerdict
from node.outer_link import SHM_DIR, OuterConfig, OuterLink
from node.outer_loop import LONE_ROUNDS_TO_MOVE, OuterLoop
from node.p2p.inproc import InProcessNetwork
from node.peer_view import PeerView
from node.routing import Router
from node.worker import TorchWorker
from protocol.control import LeaseInfo, PeerInfo, RunInfo
from protocol.credit import sign_credit
from protocol.identity import NodeKey
from protocol.lineage import Link
from swarmlab.procs import wait_for

DECLARE_STATE_PERIOD_S = 5.0  # node.outer.process: the averager's declare_state_period (s)

N = 4096  # parameters per replica: small, the tests are about the protocol
CFG = OuterConfig(
    matchmaking_s=2.0,
    request_timeout_s=0.5,
    round_timeout_s=4.0,
    state_timeout_s=10.0,
    diloco=DilocoConfig(eta=0.7, mu=0.9, target_tokens=400),
)


def start(links: list[OuterLink], env: dict[str, str], run: str, peers: list[str]) -> OuterLink:
    link = OuterLink.start(run_id=run, stage=0, numel=N, initial_peers=peers, config=CFG, env=env)
    links.append(link)
    return link


def two_replicas(
    links: list[OuterLink], env: dict[str, str]
) -> tuple[OuterLink, OuterLink, list[torch.Tensor]]:
    """A fresh stage of two replicas: A seeds round 0 from `params(0, 1.0)`, B downloads it."""
    run = uuid.uuid4().hex[:8]
    a = start(links, env, run, [])
    b = start(links, env, run, a.dht_addrs())
    theta0 = params(0, 1.0)
    a.set_initial_state(theta0)
    assert b.fetch_state(timeout=15) == 0
    return a, b, theta0


def params(seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N // 2, generator=g) * scale, torch.randn(N // 2, generator=g) * scale]


def trained(theta0: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A replica's working copy after a little training: a step shared by every replica
    (they descend one loss from one theta_g) plus one of its own, so replicas' deltas
    point alike, as honest ones do (a groupmate's unrelated delta is rejected)."""
    common = params(99, 1.0)
    return [p - 0.01 * (c + q) for p, c, q in zip(theta0, common, params(seed, 1.0), strict=True)]


def test_group_round_gives_identical_state_and_a_joiner_downloads_it(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    run = uuid.uuid4().hex[:8]
    a = start(links, child_env, run, [])
    b = start(links, child_env, run, a.dht_addrs())
    theta0 = params(0, 1.0)
    a.set_initial_state(theta0)
    seeded = (0, a.digest)
    assert b.fetch_state(timeout=15) == 0 and b.digest == a.digest
    got = [torch.empty(N // 2), torch.empty(N // 2)]
    b.load_into(got)
    assert all(torch.equal(x, y) for x, y in zip(got, theta0, strict=True))

    # each replica trained a little; B saw three times the tokens of A, and counts the
    # stage's replicas differently (a join it saw first): the group steps with one target
    wa, wb = trained(theta0, 1), trained(theta0, 2)
    a.begin_round(wa, 100)
    b.begin_round(wb, 300, target_tokens=600)
    ra, rb = a.wait_result(30), b.wait_result(30)
    assert (ra.group_size, rb.group_size) == (2, 2), (ra, rb)
    assert ra.round == rb.round == 1 and ra.applied and rb.applied
    assert ra.contributed and rb.contributed  # both weighted above zero
    assert ra.digest == rb.digest  # theta_g and m bitwise identical
    # both held the seeded state as the round began: the stage agreed on it
    assert ra.agreed == rb.agreed == seeded and seeded in ra.lineage
    assert torch.equal(a.theta_g(), b.theta_g())
    assert ra.bytes_out == ra.raw_bytes // 2  # fp16 on the wire

    # reference: D = (100 (theta0 - wa) + 300 (theta0 - wb)) / 400, fp16 on the wire both
    # ways: each member's part, then each reducer's result (reduce-scatter, the default)
    flat0 = torch.cat(theta0)
    da = (flat0 - torch.cat(wa)).half().float()
    db = (flat0 - torch.cat(wb)).half().float()
    d = ((100 * da + 300 * db) / 400).half().float()
    expect = flat0 - 0.7 * (d + 0.9 * d)
    assert torch.allclose(a.theta_g(), expect, atol=1e-6)
    assert torch.allclose(a.momentum(), d, atol=1e-6)  # m = mu * 0 + d
    assert torch.equal(a.momentum(), b.momentum())

    # a joiner mid-run receives (theta_g, m, round) from a live replica
    c = start(links, child_env, run, b.dht_addrs())
    assert c.fetch_state(timeout=15) == 1
    assert c.digest == ra.digest and torch.equal(c.theta_g(), a.theta_g())
    assert torch.equal(c.momentum(), a.momentum())


def test_a_stage_seeded_from_a_checkpoint_keeps_its_round_and_momentum(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """The first replica of a stage that resumes from its checkpoint (node.checkpoint
    resume_state) seeds the outer process with the checkpoint's round and momentum; the
    next round (alone) continues from them with the Nesterov update."""
    a = start(links, child_env, uuid.uuid4().hex[:8], [])
    theta0, m0 = torch.cat(params(3, 1.0)), torch.cat(params(4, 0.01))
    a.set_initial_state([theta0], momentum=m0, round_=5)
    assert a.round == 5 and torch.equal(a.momentum(), m0) and torch.equal(a.theta_g(), theta0)
    w = theta0 - 0.01 * torch.cat(params(5, 1.0))
    a.begin_round([w], 400)  # a full round's tokens: eta_r = eta
    r = a.wait_result(30)
    assert r.round == 6 and r.group_size == 1
    d = theta0 - w  # alone: no wire compression
    m1 = 0.9 * m0 + d
    assert torch.allclose(a.momentum(), m1, atol=1e-6)
    assert torch.allclose(a.theta_g(), theta0 - 0.7 * (d + 0.9 * m1), atol=1e-5)


def test_frozen_replica_does_not_hold_the_other_and_is_rebased(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    a, b, theta0 = two_replicas(links, child_env)
    wa = [p * 0.99 for p in theta0]
    a.begin_round(wa, 100)
    b.begin_round(wa, 100)
    time.sleep(0.5)  # both are matchmaking now
    os.killpg(b.pid, signal.SIGSTOP)  # B and its hivemind helpers freeze mid-round
    t0 = time.monotonic()
    ra = a.wait_result(30)
    bound = 2 * CFG.matchmaking_s + 1.0 + CFG.round_timeout_s + 5.0
    assert time.monotonic() - t0 < bound and ra.applied and ra.round == 1
    # A goes on alone: a lone replica still steps
    a.begin_round([p * 0.98 for p in theta0], 100)
    ra2 = a.wait_result(30)
    round2_at = time.monotonic()
    assert ra2.applied and ra2.round == 2 and ra2.group_size == 1 and ra2.contributed
    assert 0.0 < ra2.eta_r < CFG.diloco.eta  # 100 of 400 target tokens: a smaller step

    os.killpg(b.pid, signal.SIGCONT)
    b.wait_result(40)  # whatever its interrupted round produced
    assert b.round < 2
    # B comes back: its next round with A puts both in one group, where B's state (round
    # < 2, not the group's canonical one) is replaced by A's before it steps again. (The
    # other path, B seeing A's newer round in the DHT before it matchmakes, can miss right
    # after a freeze; then B would step alone once, level with A, and the next group
    # round still reconciles them.)
    time.sleep(max(0.0, round2_at + 2 * DECLARE_STATE_PERIOD_S - time.monotonic()))
    a.begin_round([p * 0.97 for p in theta0], 100)
    b.begin_round(wa, 100)
    ra3, rb = a.wait_result(40), b.wait_result(40)
    assert rb.rebased, rb  # B adopted the stage's newest state
    assert ra3.round == 3 and rb.round >= 2, (ra3, rb)
    # Both now hold one lineage: their next group round ends bitwise identical.
    a.begin_round([p * 0.96 for p in theta0], 100)
    b.begin_round([p * 0.96 for p in theta0], 100)
    ra4, rb4 = a.wait_result(40), b.wait_result(40)
    assert ra4.digest == rb4.digest and ra4.round == rb4.round, (ra4, rb4)
    print(f"frozen-peer bound {bound:.1f}s; A waited {ra.seconds:.2f}s", file=sys.stderr)


def test_lone_rounds_ride_in_the_group_round_that_steps_the_state_they_left(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """A steps twice alone from round 0, the attested state, while B (holding round 0 too)
    is in no round. When they next form a group, the group steps round 0 (one holder
    each; the attested state breaks the tie) and A adopts the result. A's contribution
    carries its lone progress from round 0, weighted by the lone rounds' tokens and not
    counted stale, so what A trained alone is in the stage's state instead of dropped."""
    a, b, theta0 = two_replicas(links, child_env)
    attested = (0, a.digest)
    common, lone = params(99, 1.0), params(7, 1.0)
    for k in (1, 2):  # A's working copy moves along `lone` (and the shared direction)
        halves = a.theta_g().clone().split(N // 2)
        a.begin_round([p - 0.01 * (c + q) for p, c, q in zip(halves, common, lone, strict=True)],
                      100, attested=attested)  # fmt: skip
        ra = a.wait_result(30)
        assert ra.applied and ra.group_size == 1 and ra.round == k and not ra.carried, ra
    theta_lone = a.theta_g().clone()
    a.begin_round(trained(list(theta_lone.split(N // 2)), 20), 100, attested=attested)
    b.begin_round(trained(theta0, 21), 100, attested=attested)
    ra, rb = a.wait_result(40), b.wait_result(40)
    assert ra.group_size == rb.group_size == 2, (ra, rb)
    assert ra.carried and ra.rebased and not rb.carried and not rb.rebased, (ra, rb)
    assert ra.round == rb.round == 1 and ra.digest == rb.digest, (ra, rb)
    assert ra.tokens == rb.tokens == 400, (ra, rb)  # 2 lone rounds + 2 contributions
    flat0, u = torch.cat(theta0), torch.cat(lone)
    u = u / u.norm()
    # how far each state moved along A's own lone direction (B's, the shared one and
    # A's group-round one are orthogonal to it up to ~1/sqrt(N)): without the carry the
    # group's state would not move along it at all
    moved_alone = float(torch.dot(flat0 - theta_lone, u))
    moved_group = float(torch.dot(flat0 - b.theta_g(), u))
    assert moved_alone > 0.0 and moved_group > 0.5 * moved_alone, (moved_alone, moved_group)


def test_members_that_tie_and_name_different_attested_states_do_not_split_the_stage(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """A stepped a lone round; as they meet, A has heard its round attested and B (its
    view a heartbeat behind) still round 0. Each holds one of the tied states: had each
    broken the tie with its own view, A would step its state and B round 0, two group
    rounds of one group with two results. The group breaks it only by an attested state
    more than half its members name; here none, so neither steps a group round."""
    a, b, theta0 = two_replicas(links, child_env)
    at0 = (0, a.digest)
    a.begin_round([p * 0.99 for p in theta0], 100, attested=at0)  # B is in no round
    ra = a.wait_result(30)
    assert ra.applied and ra.group_size == 1 and ra.round == 1
    for k in range(3):
        mine = (ra.round, ra.digest)
        a.begin_round(trained(list(a.theta_g().clone().split(N // 2)), 30 + k), 100, attested=mine)
        b.begin_round(trained(list(b.theta_g().clone().split(N // 2)), 40 + k), 100, attested=at0)
        ra, rb = a.wait_result(40), b.wait_result(40)
        assert ra.group_size == rb.group_size == 1, (k, ra, rb)


def test_a_token_claim_counts_only_what_the_coordinators_credit_backs(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """Three replicas; each shows the credit a coordinator key signed for it. Two claim
    6,000 tokens at 100 witnessed tokens/s; the third claims 10**6 at 50 tokens/s. The
    group counts it at 2 x 50 x 60 s = 6,000 (not 4 x the median claim, 24,000): every
    member's result names 18,000 tokens and one state."""
    coordinator = NodeKey.generate()
    keys = [NodeKey.generate() for _ in range(3)]
    run = uuid.uuid4().hex[:8]
    members = [k.peer_id for k in keys]
    first = OuterLink.start(run_id=run, stage=0, numel=N, config=CFG, env=child_env,
                            identity=keys[0].libp2p_private_key())  # fmt: skip
    links.append(first)
    reps = [first] + [
        OuterLink.start(run_id=run, stage=0, numel=N, initial_peers=first.dht_addrs(),
                        config=CFG, env=child_env, identity=k.libp2p_private_key())
        for k in keys[1:]
    ]  # fmt: skip
    links.extend(reps[1:])
    theta0 = params(0, 1.0)
    reps[0].set_initial_state(theta0)
    for r in reps[1:]:
        assert r.fetch_state(timeout=15) == 0
    claims, rates = (6000, 6000, 10**6), (100.0, 100.0, 50.0)
    for attempt in range(4):  # until all three meet in one group (a pair may form first)
        for i, r in enumerate(reps):
            credit = sign_credit(coordinator, run=run, peer=members[i], stage=0, rate=rates[i],
                                 issued_at=time.time())  # fmt: skip
            mine = trained(list(r.theta_g().clone().split(N // 2)), 10 * attempt + i)
            r.begin_round(mine, claims[i], members=members, credit=credit)
        results = [r.wait_result(40) for r in reps]
        if all(x.group_size == 3 for x in results):
            break
    assert all(x.group_size == 3 for x in results), results
    assert [x.tokens for x in results] == [18000] * 3, results
    assert len({x.digest for x in results}) == 1 and all(x.applied for x in results)


def test_a_group_with_nothing_to_average_settles_on_the_canonical_state(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """Replicas out of data begin rounds with no tokens: nothing to average, but the group
    still settles which state is the stage's. A (a lone round ahead) keeps its state and
    reports the round applied by a group of 2; B ends on A's state. Each state was held
    by one member, so that round agrees on none; the next group, where both hold A's
    state, agrees on it (A's held lone round can then commit)."""
    a, b, theta0 = two_replicas(links, child_env)
    a.begin_round([p * 0.99 for p in theta0], 100)  # B is in no round: A steps alone
    ra = a.wait_result(30)
    assert ra.applied and ra.group_size == 1 and ra.round == 1
    for _ in range(3):  # a group forms when both matchmake at once
        a.begin_round([a.theta_g().clone()], 0)
        b.begin_round([b.theta_g().clone()], 0)
        ra2, rb2 = a.wait_result(30), b.wait_result(30)
        if ra2.group_size == 2:
            break
    assert ra2.group_size == 2 and ra2.applied and not ra2.contributed, ra2
    assert ra2.round == 1 and ra2.digest == ra.digest  # A kept its state
    assert rb2.applied and rb2.rebased and rb2.digest == ra.digest, rb2  # B took it
    assert torch.equal(a.theta_g(), b.theta_g())
    assert ra2.agreed is None and rb2.agreed is None
    for _ in range(3):
        a.begin_round([a.theta_g().clone()], 0)
        b.begin_round([b.theta_g().clone()], 0)
        ra3, rb3 = a.wait_result(30), b.wait_result(30)
        if ra3.group_size == 2:
            break
    assert ra3.agreed == rb3.agreed == (1, ra.digest), (ra3, rb3)


def test_the_stage_side_never_loaded_hivemind() -> None:
    assert "hivemind" not in sys.modules


def test_an_outer_process_whose_stage_process_died_exits_with_all_its_helpers(
    child_env: dict[str, str],
) -> None:
    """A stage process killed by SIGKILL sends no stop: its outer process, hivemind's DHT
    and averager processes and their p2p daemons (one process group) are all gone soon
    after, and the shared buffers are unlinked."""
    code = (
        "import signal\n"
        "from node.outer_link import OuterConfig, OuterLink\n"
        "link = OuterLink.start(run_id='orphan', stage=0, numel=64, initial_peers=[],"
        " config=OuterConfig())\n"
        "print(link.pid, flush=True)\n"
        "signal.pause()  # until the test's SIGKILL\n"
    )
    stage = subprocess.Popen(
        [sys.executable, "-c", code], env=child_env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert stage.stdout is not None
        pgid = stage.stdout.readline().strip()  # after OuterLink.start's own deadline
        assert pgid.isdigit(), f"the stage process started no outer process: {pgid!r}"
        buffers = list(SHM_DIR.glob(f"agora-{stage.pid}-*"))  # OuterLink.start's names
        group = [q for q in psutil.process_iter() if _pgid(q.pid) == int(pgid)]
        names = sorted(q.name() for q in group)
        assert len(group) >= 3 and any("p2pd" in n for n in names), names
        assert len(buffers) == 3, buffers
        stage.kill()
        stage.wait(10)
        wait_for(
            lambda: not any(q.is_running() and q.status() != "zombie" for q in group),
            "every process of the outer process's group to exit",
            15,
            detail=lambda: str([(q.pid, q.name()) for q in group if q.is_running()]),
        )
        assert not any(b.exists() for b in buffers), buffers
    finally:
        stage.kill()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_wire_codecs_round_trip_in_the_outer_interpreter(child_env: dict[str, str]) -> None:
    """fp16 and 8-bit pseudo-gradients decode to within their codec's error, a sparse one
    exactly, and a message of another size than expected is refused before decoding (in
    a fresh interpreter, since it imports hivemind)."""
    code = (
        "import pytest, torch\n"
        "from hivemind.compression import CompressionInfo\n"
        "from node.outer.sparse import select_topk\n"
        "from node.outer.wire import compression, decode_tensor, round_trip\n"
        "x = torch.randn(10000) * 1e-3\n"
        "for name, tol in (('fp16', 1e-3), ('uint8', 3e-2)):\n"
        "    codec = compression(name)\n"
        "    msg = codec.compress(x, CompressionInfo.from_tensor(x), allow_inplace=False)\n"
        "    y = decode_tensor(msg, x.numel())\n"
        "    err = float((y - x).norm() / x.norm())\n"
        "    assert y.shape == x.shape and err < tol, (codec, err)\n"
        "    assert torch.equal(round_trip(x, name), y)\n"
        "    print(type(codec).__name__, len(msg.buffer), err)\n"
        "    with pytest.raises(ValueError, match='expected 9999 values'):\n"
        "        decode_tensor(msg, 9999)\n"
        "assert torch.equal(round_trip(x, 'none'), x)\n"
        "s = select_topk(x, 0.03)\n"
        "codec = compression('topk3')\n"
        "msg = codec.compress(s, CompressionInfo.from_tensor(s), allow_inplace=False)\n"
        "assert torch.equal(decode_tensor(msg, s.numel()), s) and torch.equal(round_trip(s, 'topk3'), s)\n"
        "print(type(codec).__name__, len(msg.buffer), int((s != 0).sum()))\n"
        "msg.size[0] = 2**30\n"
        "with pytest.raises(ValueError, match='expected 10000 values'):\n"
        "    decode_tensor(msg, 10000)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # 8-bit: int64 codebook size + 256 fp32 codebook entries + one byte per element
    assert "Uniform8BitQuantization 11032" in out.stdout, out.stdout
    # 3 % of each chunk of 4,096 (the last one padded): 123 a chunk, three chunks, 4 bytes
    # a nonzero plus one block count
    assert "NonzerosCompression 1480 369" in out.stdout, out.stdout


class Compute:
    """The part of `StageCompute` that `OuterLoop` and `OuterRounds` use: the test trains
    by moving the weights and counting steps."""

    def __init__(self, seed: int) -> None:
        self.weights = torch.cat(params(seed, 1.0))
        self.inner_steps = 0
        self.tokens_trained = 0

    def parameters(self) -> list[torch.Tensor]:
        return [self.weights]

    def weights_changed(self) -> None:
        pass

    def step(self) -> None:
        pass

    def train(self, steps: int, seed: int) -> None:
        self.weights -= 1e-3 * (torch.cat(params(99, 1.0)) + torch.cat(params(seed, 1.0)))
        self.inner_steps += steps
        self.tokens_trained += 100 * steps


def test_a_replica_that_rounded_alone_on_its_own_dht_moves_and_its_ranges_commit(
    tmp_path: Path,
) -> None:
    """B starts before A announced its DHT, so B's outer process starts a DHT of its own,
    and B steps rounds alone there while A exists: the commit rule holds their ranges.
    Once B learns A's DHT (the run's root, as the coordinator assigns it) it moves there after
    `LONE_ROUNDS_TO_MOVE` lone rounds, although it has applied rounds already; it takes
    A's state, so the held lone rounds' ranges go back; the stage's next round is a group
    round and B's ranges commit. Real outer processes, OuterLoop, PeerView and LeasePool."""
    net = InProcessNetwork()
    run = RunInfo(
        run_id=uuid.uuid4().hex[:8], model_preset="tiny", n_stages=1, codec="none", seed=0,
        heartbeat_interval_s=1.0, lease_ttl_s=10.0, dataset_name="t", dataset_hash="0",
        shards=1, data_epoch=0,
    )  # fmt: skip
    every = 5
    announced: dict[str, list[str]] = {}
    keys = {k.peer_id: k for k in (NodeKey.generate(), NodeKey.generate())}
    ids = tuple(keys)  # A's DHT is the run's root
    # each outer process runs under its node's key: the members its rounds admit

    def view(known: dict[str, list[str]]) -> dict[str, PeerInfo]:
        return {
            p: PeerInfo(peer_id=p, stage=0, addrs=[], dht_addrs=known.get(p, []),
                        device="cpu", throughput=0.0)
            for p in ids
        }  # fmt: skip

    pool = LeasePool(seq_len=4, max_open=1, shard_cache=1)
    lease = LeaseInfo(
        lease_id=1, shard_id=0, epoch=1, data_epoch=0, committed=0, limit=400,
        shard_tokens=400, expires_at=0.0, state="active",
    )  # fmt: skip
    pool.open(lease, bytes(401))
    verdicts: list[tuple[RoundFacts, RoundVerdict]] = []
    returned: list[CommitRange] = []

    async def on_state_b(_state: GlobalState, facts: RoundFacts | None) -> None:
        if facts is not None:
            verdicts.append((facts, pool.round_result(facts)))

    async def on_replaced_b(lineage: tuple[Link, ...]) -> None:
        returned.extend(pool.state_replaced(lineage))

    async def on_state_a(_state: GlobalState, _facts: RoundFacts | None) -> None:
        pass

    computes = {p: Compute(seed=10) for p in ids}
    workers = {p: TorchWorker() for p in ids}
    views = {p: PeerView(net.transport(p), Router(), stage=0) for p in ids}

    def attested() -> tuple[int, str] | None:
        """The coordinator's attested state: A's, which B also held (round 0) before its
        lone rounds, so it vouched for it too."""
        held = loops[ids[0]].state
        return None if held is None else (held.round, held.digest)

    def loop(p: str) -> OuterLoop:
        b = p == ids[1]  # only B's rounds feed the lease pool
        return OuterLoop(
            workers[p], computes[p], views[p], run=run, config=CFG,  # type: ignore[arg-type]
            every_steps=every, tokens_per_step=100,
            snapshot=pool.snapshot if b else (lambda: RoundMark(0)),
            on_state=on_state_b if b else on_state_a, on_replaced=on_replaced_b if b else None,
            announce_dht=lambda addrs: announced.__setitem__(p, addrs),
            events=EventLog(tmp_path / f"{p}.jsonl"), identity=keys[p].libp2p_private_key(),
            attested=attested,
        )  # fmt: skip

    loops: dict[str, OuterLoop] = {}
    loops.update((p, loop(p)) for p in ids)
    a, b = (loops[p] for p in ids)

    def train_b(windows: int, seed: int) -> None:
        pool.finish(pool.take(windows), final=False)
        computes[ids[1]].train(every, seed)

    async def until(what: str, done: Callable[[], bool], timeout_s: float) -> None:
        with trio.fail_after(timeout_s):
            while not done():
                await trio.sleep(0.1)
        assert done(), what

    async def main() -> None:
        for v in views.values():
            v.update(1, view({}))  # both members, no DHT announced yet
        await a.start()
        await b.start()  # no DHT to join: a DHT of its own
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run)
            nursery.start_soon(b.run)
            train_b(2, seed=20)  # windows [0, 8)
            await until("B's first round", lambda: len(verdicts) == 1, 30)
            # now B knows A's DHT, which the coordinator assigns as the root (A announced first)
            views[ids[1]].update(2, view(announced), dht_root=ids[0])
            views[ids[0]].update(2, view(announced), dht_root=ids[0])
            for i in range(1, LONE_ROUNDS_TO_MOVE):
                train_b(2, seed=20 + i)
                await until("B's lone rounds", lambda i=i: len(verdicts) == i + 1, 30)  # type: ignore[misc]
            assert all(f.agreed is None and f.applied and not f.sole for f, _ in verdicts)
            assert not any(v.commits for _, v in verdicts)  # lone rounds: held, not committed
            assert verdicts[-1][1].held == LONE_ROUNDS_TO_MOVE
            # The old rule (move only before the first round) would leave B here for good.
            moves = tmp_path / f"{ids[1]}.jsonl"
            await until("B moves", lambda: bool(read_events(moves, "dht_move")), 30)
            await until("B reloaded", lambda: b.rounds is not None and bool(returned), 60)
            # A's state replaced B's lineage: the held lone rounds' ranges went back
            assert [(r.start, r.end) for r in returned] == [(0, 4 * 2 * LONE_ROUNDS_TO_MOVE)]
            assert b._bootstrap == ids[0]
            # Both train and round together: group rounds, and B's ranges commit once a
            # group agrees on a state that holds them
            for attempt in range(6):
                seen = len(verdicts)
                train_b(2 * LONE_ROUNDS_TO_MOVE + 2, seed=40 + attempt)
                computes[ids[0]].train(every, seed=50 + attempt)
                await until("a round", lambda seen=seen: len(verdicts) > seen, 40)  # type: ignore[misc]
                if any(v.commits for _, v in verdicts[seen:]):
                    break
            facts, verdict = next((f, v) for f, v in verdicts[seen:] if v.commits)
            assert facts.agreed is not None and facts.agreed in facts.lineage, facts
            assert verdict.commits[0].start == 0 and verdict.rode_in == facts.agreed, verdict
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        for loop in loops.values():
            loop.close()
        for w in workers.values():
            w.close()
    [move] = read_events(tmp_path / f"{ids[1]}.jsonl", "dht_move")
    assert move["root"] == ids[0] and move["rounds"] == LONE_ROUNDS_TO_MOVE
    # B's rounds, across the move, claim each token it trained once: the new outer
    # process's first round claims from where the old one's last round began
    claims = [e["tokens"] for e in read_events(tmp_path / f"{ids[1]}.jsonl", "round_begun")]
    assert 0 < sum(claims) <= computes[ids[1]].tokens_trained, claims


def test_a_replica_sees_a_groupmate_looking_for_a_group_and_joins_its_round(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """Between rounds a replica can see that another replica of its stage is forming a
    group (its live matchmaking declaration in the DHT) and begin its own round early:
    the two form a group although they began seconds apart."""
    a, b, theta0 = two_replicas(links, child_env)
    assert a.peers_waiting() == 0 and b.peers_waiting() == 0  # nobody is in a round
    wa, wb = trained(theta0, 1), trained(theta0, 2)
    a.begin_round(wa, 100)
    deadline = time.monotonic() + 10.0
    while b.peers_waiting() == 0:
        assert time.monotonic() < deadline, "no groupmate seen looking for a group in 10 s"
        time.sleep(0.1)
    b.begin_round(wb, 100)
    ra, rb = a.wait_result(30), b.wait_result(30)
    assert (ra.group_size, rb.group_size) == (2, 2), (ra, rb)
    assert ra.digest == rb.digest
    assert b.peers_waiting() == 0  # the declaration is withdrawn once the group formed
