"""Claimed throughput checked against witnessed work (coordinator/witness.py): who may
witness whom, a liar counted at its share of the work, young members capped by their
stage, the property that a majority of honest replicas keeps every honest claim
(hypothesis), the signed credits the book issues; then over the wire, against a real
coordinator process: a member that claims a million tokens/s and does a quarter of its
stage's work is counted at what the work backs, and every member's credit, signed by
the key derived from the coordinator's TLS key, names the rate witnessed for it."""

from __future__ import annotations

from pathlib import Path

import trio
from coordinator_harness import write_config
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.membership import Peer
from coordinator.tls import credit_key
from coordinator.witness import CREDIT_HOLD_S, MIN_MEASURED, Member, WitnessBook, witnesses
from node.coordinator_client import ClientConfig, CoordinatorClient
from protocol import control as c
from protocol.credit import open_credit
from protocol.identity import NodeKey
from swarmlab.coordinator import start_coordinator

WINDOW = 80.0


def book(**kw: float) -> WitnessBook:
    return WitnessBook(**({"window_s": WINDOW, "slack": 2.0, "claim_ratio": 4.0} | kw))


def stage_of(stages: dict[str, int]):  # type: ignore[no-untyped-def]
    return stages.get


def test_who_witnesses_whom() -> None:
    assert witnesses(0, 1) and witnesses(1, 2) and witnesses(1, 0)
    assert not witnesses(1, 1) and not witnesses(2, 1) and not witnesses(0, 2)
    w = book()
    stages = {"a": 0, "b": 1, "c": 1, "d": 2}
    # a reporter's own entry, a stranger's and one for a stage it does not see are dropped
    entries = [("b", 10), ("a", 10), ("zz", 10), ("c", 5)]
    assert w.report("a", 0, entries, stage_of(stages), now=100.0) == 2
    assert w.report("d", 2, [("b", 99)], stage_of(stages), now=100.0) == 0
    assert w.report("b", 1, [("a", 40), ("d", 8)], stage_of(stages), now=100.0) == 2
    assert w.tokens_total == 10 + 5 + 40 + 8
    assert w.rate("b", 100.0) == 10 / WINDOW and w.rate("c", 100.0) == 5 / WINDOW
    assert w.rate("a", 100.0) == 40 / WINDOW and w.rate("d", 100.0) == 8 / WINDOW
    # a window later it no longer counts
    assert w.rate("b", 100.0 + WINDOW + WINDOW / 8) == 0.0
    w.forget("b")
    assert w.rate("b", 100.0) == 0.0


def member(peer_id: str, stage: int, joined_at: float, observer: bool = False) -> Peer:
    return Peer(
        peer_id=peer_id, public_key=b"", stage=stage, addrs=(), dht_addrs=(), device="cpu",
        throughput=1.0, deadline=None, metrics_host=None, metrics_port=None,
        fixed_stage=False, joined_at=joined_at, expires_at=joined_at + 60, observer=observer,
    )  # fmt: skip


def test_credits_name_the_rate_witnessed_over_the_time_a_member_was_measured() -> None:
    key = NodeKey.generate()
    w = book(key=key, run="r")  # type: ignore[arg-type]
    stages = {"up": 0, "old": 1, "young": 1}
    w.report("up", 0, [("old", 800), ("young", 200)], stage_of(stages), now=100.0)
    old, young = member("old", 1, joined_at=0.0), member("young", 1, joined_at=50.0)
    assert w.witnessed_rate("old", 0.0, 100.0) == 800 / WINDOW  # a whole window
    assert w.witnessed_rate("young", 50.0, 100.0) == 200 / 50.0  # its own 50 s
    assert w.witnessed_rate("young", 99.0, 100.0) == 200 / (WINDOW / 8)  # at least a bucket
    # measured for less than half a window: its witnessed work lags too much to credit
    assert w.credit(member("young", 1, joined_at=70.0), 100.0) == b""
    first = w.credit(young, 100.0)
    got = open_credit(first, "r")
    assert (got.peer, got.stage, got.rate, got.key) == ("young", 1, 4.0, key.public_key)
    # handed out again for a bucket; then re-signed when its rate moved (a young
    # member's measured time grows), or when it is CREDIT_HOLD_S old, or names a stage
    # the member left
    bucket = WINDOW / 8
    assert w.credit(young, 100.0 + bucket / 2) == first
    assert open_credit(w.credit(young, 100.0 + bucket), "r").rate == 200 / (50.0 + bucket)
    assert open_credit(w.credit(old, 100.0), "r").rate == 800 / WINDOW
    # a rate that stays: the same credit past a bucket, a new one at CREDIT_HOLD_S
    long = book(window_s=4 * CREDIT_HOLD_S, started=-1e4, key=key, run="r")  # type: ignore[arg-type]
    veteran = member("old", 1, joined_at=-1e4)  # measured for a whole window
    long.report("up", 0, [("old", 800)], stage_of(stages), now=100.0)
    settled = long.credit(veteran, 100.0)
    assert long.credit(veteran, 100.0 + CREDIT_HOLD_S - 1) == settled  # past a bucket
    later = open_credit(long.credit(veteran, 100.0 + CREDIT_HOLD_S), "r")
    assert later.issued_at == 100.0 + CREDIT_HOLD_S
    assert later.rate == open_credit(settled, "r").rate == 800 / (4 * CREDIT_HOLD_S)
    young.stage = 0
    assert open_credit(w.credit(young, 101.0 + bucket), "r").stage == 0
    assert w.credit(member("obs", 2, 0.0, observer=True), 100.0) == b""
    assert w.credit(member("idle", 1, 0.0), 100.0) == b""  # nothing witnessed
    assert book().credit(old, 100.0) == b""  # no key: no credits


def _stage_one(w: WitnessBook, work: dict[str, int], now: float) -> None:
    stages = {"up": 0} | {p: 1 for p in work}
    w.report("up", 0, list(work.items()), stage_of(stages), now)


def test_a_liar_counts_what_its_work_backs_and_honest_claims_stand() -> None:
    w = book()
    claims = {"h1": 100.0, "h2": 120.0, "h3": 80.0, "liar": 1e6}
    # routing spreads work by speed: the honest ones in proportion to their claims, the
    # liar about as fast as h1
    work = {"h1": 4000, "h2": 4800, "h3": 3200, "liar": 4000}
    _stage_one(w, work, now=100.0)
    members = [Member(p, 1, 0.0, claim) for p, claim in claims.items()]
    got = dict(w.counted(members, now=100.0))
    assert got["h1"] == 100.0 and got["h2"] == 120.0 and got["h3"] == 80.0
    # median claim/rate is 2,000 s (ratio of claims to tokens per window), x slack 2
    assert abs(got["liar"] - 2.0 * (100.0 / (4000 / WINDOW)) * (4000 / WINDOW)) < 1e-6
    # one that did nothing for a whole window counts 0
    got = dict(w.counted([*members, Member("idle", 1, 0.0, 100.0)], now=100.0))
    assert got["idle"] == 0.0 and got["h1"] == 100.0


def test_young_members_and_small_stages() -> None:
    w = book()
    work = {"h1": 4000, "h2": 4000, "h3": 4000}
    _stage_one(w, work, now=100.0)
    members = [Member(p, 1, 0.0, 100.0) for p in work]
    young = Member("new", 1, 90.0, 1e9)  # joined 10 s ago: nothing witnessed yet
    got = dict(w.counted([*members, young], now=100.0))
    assert got["new"] == 4.0 * 100.0  # claim_ratio x the stage's median
    assert w.admit("new2", 1, 1e9) == 400.0 and w.claims["new2"] == 1e9
    assert w.cap_young(0, 1e9) == 1e9  # stage 0 has no measured member: not capped
    # fewer than MIN_MEASURED measured replicas: claims are not checked
    w2 = book()
    _stage_one(w2, {"a": 10, "b": 4000}, now=100.0)
    pair = [Member("a", 1, 0.0, 1e6), Member("b", 1, 0.0, 100.0)]
    assert MIN_MEASURED > 2 and dict(w2.counted(pair, now=100.0)) == {"a": 1e6, "b": 100.0}
    # a restarted coordinator measures everyone afresh: all young for one window
    w3 = book(started=100.0)
    assert w3.young(0.0, 150.0) and not w3.young(0.0, 100.0 + WINDOW)


@settings(max_examples=200, deadline=None)
@given(
    # (claim, claim / witnessed rate): honest replicas within a band narrower than slack
    honest=st.lists(st.tuples(st.floats(1.0, 1e4), st.floats(1.0, 1.9)), min_size=3, max_size=9),
    # a liar claims anything and gets anything witnessed (a Sybil upstream backs it)
    liars=st.lists(st.tuples(st.floats(0.0, 1e12), st.integers(0, 10**9)), max_size=8),
)
def test_a_majority_of_honest_replicas_keeps_every_honest_claim(
    honest: list[tuple[float, float]], liars: list[tuple[float, int]]
) -> None:
    liars = liars[: len(honest) - 1]  # a strict minority of the stage
    w = book()
    claims = {f"h{i}": claim for i, (claim, _) in enumerate(honest)}
    claims |= {f"x{i}": claim for i, (claim, _) in enumerate(liars)}
    stages = {"up": 0} | {p: 1 for p in claims}
    entries = [(f"h{i}", round(claim * WINDOW / ratio)) for i, (claim, ratio) in enumerate(honest)]
    entries += [(f"x{i}", tokens) for i, (_, tokens) in enumerate(liars) if tokens > 0]
    w.report("up", 0, entries, stage_of(stages), now=100.0)
    got = dict(w.counted([Member(p, 1, 0.0, claim) for p, claim in claims.items()], now=100.0))
    for i, (claim, _) in enumerate(honest):
        assert got[f"h{i}"] >= claim * (1 - 1e-9), (got, honest, liars)


def test_a_liar_over_the_wire_is_counted_at_what_its_work_backs(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, n_stages=2, lease_ttl_s=20.0, heartbeat_interval_s=0.5,
        witness_window_s=2.0, rebalance_interval_s=0.5,
    )  # fmt: skip
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    keys = [NodeKey.generate() for _ in range(5)]
    fast = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0, witness_report_s=0.0)

    async def go() -> None:
        port, pin = coord.port, coord.fingerprint
        clients = [CoordinatorClient("127.0.0.1", port, k, config=fast, pin=pin) for k in keys]
        async with clients[0] as up, clients[1] as h1, clients[2] as h2, clients[3] as h3:
            async with clients[4] as liar:
                await up.join(c.JoinRequest(throughput=100.0, stage=0))
                for cl in (h1, h2, h3):
                    await cl.join(c.JoinRequest(throughput=100.0, stage=1))
                await liar.join(c.JoinRequest(throughput=1e6, stage=1))
                stage1 = [h1, h2, h3, liar]
                with trio.fail_after(30):
                    while True:  # the stage's work, seen from stage 0, 100 tokens/s each
                        for cl in stage1:
                            up.witness(cl.peer_id, 50)
                            await cl.heartbeat()
                        await up.heartbeat()
                        await trio.sleep(0.5)
                        status = await up.status()
                        if status.stages[1].throughput < 1000.0:
                            break
                # 100 + 100 + 100 + the liar at slack x its work: about 500 in all
                assert 300.0 < status.stages[1].throughput < 700.0, status.stages[1]
                # each credit names what stage 0 saw it do (100 tokens/s), signed by the
                # coordinator's credit key, whatever the member claims
                signer = credit_key(tmp_path / "c.sqlite.tls-key.pem").public_key
                for cl in stage1:
                    await cl.heartbeat()
                    got = open_credit(cl.credit, status.run_id)
                    assert (got.peer, got.stage, got.key) == (cl.peer_id, 1, signer)
                    assert 50.0 < got.rate < 200.0, got

    try:
        trio.run(go)
    finally:
        coord.stop()
