"""Reduce-scatter + all-gather rounds of real outer-loop processes on loopback: three
replicas end bitwise identical with the reference aggregate, and a member that freezes
mid-round leaves the survivors identical (its part gets no update).

The pytest process only imports `node.outer_link` (no hivemind).
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Callable

import pytest
import torch

from node.diloco import DilocoConfig
from node.outer.sparse import CHUNK, select_topk
from node.outer_link import OuterConfig, OuterLink, RoundResult

N = 3000  # parameters per replica: three parts of 1000
CFG = OuterConfig(
    matchmaking_s=3.0,
    request_timeout_s=0.5,
    round_timeout_s=4.0,
    state_timeout_s=10.0,
    averaging="reduce_scatter",
    diloco=DilocoConfig(eta=0.7, mu=0.9, target_tokens=600),
)


def start(
    links: list[OuterLink],
    env: dict[str, str],
    run: str,
    peers: list[str],
    attack: str = "",
    config: OuterConfig = CFG,
    numel: int = N,
) -> OuterLink:
    honest = ("-m", "node.outer")
    entry = ("-m", "swarmlab.chaos.rogue_outer", "--attack", attack) if attack else honest
    link = OuterLink.start(
        run_id=run,
        stage=0,
        numel=numel,
        initial_peers=peers,
        config=config,
        env=env,
        entry=entry,
    )
    links.append(link)
    return link


def vec(seed: int, scale: float, numel: int = N) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def work(theta0: torch.Tensor, i: int) -> torch.Tensor:
    """Member i's working copy after training: a step shared by every member (they descend
    one loss from one theta_g) plus one of its own, so their deltas point alike, as honest
    ones do (with two contributions to a part, an unrelated one is rejected)."""
    n = theta0.numel()
    return theta0 - 0.01 * (vec(1, 1.0, n) + vec(10 + i, 1.0, n))


def group(
    links: list[OuterLink],
    env: dict[str, str],
    n: int,
    rogue: dict[int, str] | None = None,
    config: OuterConfig = CFG,
    numel: int = N,
) -> tuple[list[OuterLink], torch.Tensor]:
    """A fresh stage of `n` replicas holding one state; member i runs attack `rogue[i]`."""
    run = uuid.uuid4().hex[:8]
    attacks = rogue or {}
    members: list[OuterLink] = []
    for i in range(n):  # each joins every earlier replica's DHT, as nodes do (dht_bootstrap)
        boot = [a for m in members for a in m.dht_addrs()]
        members.append(start(links, env, run, boot, attacks.get(i, ""), config, numel))
    first = members[0]
    theta0 = vec(0, 1.0, numel)
    first.set_initial_state([theta0])
    for m in members[1:]:
        assert m.fetch_state(timeout=15) == 0 and m.digest == first.digest
    return members, theta0


def grouped_round(
    links: list[OuterLink],
    env: dict[str, str],
    rogue: dict[int, str],
    grouped: Callable[[list[RoundResult]], bool],
    config: OuterConfig = CFG,
    numel: int = N,
) -> tuple[list[OuterLink], torch.Tensor, list[RoundResult]]:
    """One round of a fresh 3-replica stage whose members 0..2 train their own work
    (member i: tokens 100 (i + 1)); the honest members' results (a frozen member sends
    none). Matchmaking may split the three under load (`grouped` says whether the
    results came from the group the test needs): then a fresh stage retries."""
    for attempt in range(4):
        members, theta0 = group(links, env, 3, rogue, config, numel)
        for i, m in enumerate(members):
            m.begin_round([work(theta0, i)], 100 * (i + 1))
        honest = [m for i, m in enumerate(members) if rogue.get(i) != "freeze_in_group"]
        results = [m.wait_result(60) for m in honest]
        if grouped(results):
            return members, theta0, results
        print(f"attempt {attempt}: groups {[r.group_size for r in results]}")
    raise AssertionError("the replicas never formed the group the test needs in 4 tries")


def test_three_replicas_reduce_scatter_to_bitwise_identical_states(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    tokens = [100, 200, 300]
    members, theta0, results = grouped_round(
        links, child_env, {}, lambda rs: all(r.group_size == 3 for r in rs)
    )
    works = [work(theta0, i) for i in range(3)]
    assert all(r.group_size == 3 and r.applied and r.contributed for r in results), results
    assert len({r.digest for r in results}) == 1  # theta_g and m bitwise identical
    assert all(torch.equal(members[0].theta_g(), m.theta_g()) for m in members[1:])
    assert all(torch.equal(members[0].momentum(), m.momentum()) for m in members[1:])
    # each member sent 2 of its 3 fp16 parts and its reduced part twice (2 B per element),
    # and received as much; the auditor got the audited part from the other two on top
    part = 2 * N // 3
    outs = sorted(r.bytes_out for r in results)
    ins = sorted(r.bytes_in for r in results)
    assert outs == [4 * part, 5 * part, 5 * part], outs
    assert ins == [4 * part, 4 * part, 6 * part], ins
    # reference: per part, D = token-weighted mean of the fp16 parts, fp16 once more
    deltas = [(theta0 - w).half().float() for w in works]
    d = (sum(t * x for t, x in zip(tokens, deltas, strict=True)) / sum(tokens)).half().float()
    expect = theta0 - 0.7 * (d + 0.9 * d)  # m = d after the first step
    assert torch.allclose(members[0].theta_g(), expect, atol=1e-6)
    assert not any(r.rejected for r in results), [r.rejected for r in results]


def test_a_member_frozen_mid_round_leaves_the_survivors_identical(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """C's averager stops itself (SIGSTOP) once its group formed, before it sends
    anything: its contributions never arrive (its parts are reduced without it) and its
    own part's reduced bytes never come (that part gets no update on both survivors)."""
    members, theta0, (ra, rb) = grouped_round(
        links,
        child_env,
        {2: "freeze_in_group"},
        lambda rs: all(r.group_size == 2 and r.rejected for r in rs),
    )
    a, b, _c = members
    assert ra.applied and rb.applied and ra.round == rb.round == 1, (ra, rb)
    assert ra.group_size == rb.group_size == 2, (ra, rb)  # A's and B's contributions
    assert ra.digest == rb.digest and torch.equal(a.theta_g(), b.theta_g())
    assert ra.rejected == rb.rejected
    assert ra.accused == rb.accused == {}  # a member that dies is no liar
    lost = [v for k, v in ra.rejected.items() if "did not arrive" in v]
    assert len(lost) == 1, ra.rejected
    j = int(re.match(r"part (\d+)", lost[0]).group(1))  # type: ignore[union-attr]
    lo, hi = j * N // 3, (j + 1) * N // 3
    assert torch.equal(a.theta_g()[lo:hi], theta0[lo:hi])  # C's part: no update
    assert not torch.equal(a.theta_g(), theta0)  # the survivors' parts moved


def test_a_reduced_part_resent_after_the_round_ended_is_acknowledged(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """C sends each reduced part again 2 s after A and B acknowledged it, as a member
    whose acknowledgement was lost does. A and B have ended the round by then: each
    acknowledges the copy it accepted, after reading the resend to its end, so that the
    answer reaches C (an answer sent while C still writes a part larger than the socket
    buffers, 1 MB here, never reaches it). C waits for its pushes before its round ends,
    so its round ends seconds after the resend, not at its exchange deadline (20 s)."""
    config = dataclasses.replace(CFG, round_timeout_s=20.0)
    members, _theta0, results = grouped_round(
        links, child_env, {2: "resend_late"}, lambda rs: all(r.group_size == 3 for r in rs),
        config, 1_500_000,
    )  # fmt: skip
    assert all(r.applied for r in results) and len({r.digest for r in results}) == 1, results
    assert [r.clipped for r in results] == [0, 0, 0]  # honest deltas: the plain mean's bits
    # matchmaking (3 s), the exchange, the 2 s wait and the resend: far less than 20 s
    assert results[2].seconds < config.matchmaking_s + 2.0 + 8.0, results[2]


def test_a_reducer_that_leaves_out_acknowledged_contributions_is_caught(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """C reduces its part from its own contribution alone, though it acknowledged A's and
    B's: both catch it by their own entries in its manifest, and stay identical."""
    members, theta0, (ra, rb, _rc) = grouped_round(
        links, child_env, {2: "own_part_only"}, lambda rs: all(r.group_size == 3 for r in rs)
    )
    a, b, c = members
    assert ra.group_size == rb.group_size == 3, (ra, rb)
    assert ra.digest == rb.digest and torch.equal(a.theta_g(), b.theta_g())
    name = c.peer_id
    for r in (ra, rb):
        assert "left out a contribution it acknowledged" in r.rejected.get(name, ""), r.rejected
        assert "left out a contribution it acknowledged" in r.accused.get(name, ""), r.accused


@pytest.mark.parametrize(
    "attack",
    ["scaled_delta", "stretched_delta", "nan_delta", "sign_flip", "noise", "inflated_claims"],
)
def test_a_member_with_a_hostile_contribution_is_rejected_or_bounded(
    links: list[OuterLink], child_env: dict[str, str], attack: str
) -> None:
    """C contributes its delta x 100, with NaNs, negated, or noise of its norm: every
    reducer rejects it (the median check, the finite check, the majority's direction),
    A and B end identical and their own contributions count; all but the noise, which
    points across as an honest delta sometimes does, are reported. C's delta x 5 passes
    every rejection rule, and every reducer's centered clipping scales it down.
    Or C claims round 2**62 and 1e15 tokens: the aggregate counts the upper median round
    (A and B stay fresh, none is rejected) and C's tokens at most 4 x the median claim;
    A and B end identical. (They then do not step: the group's canonical state is still
    the highest claimed round, which only coordinator-attested rounds can settle.)"""
    members, theta0, (ra, rb, _rc) = grouped_round(
        links, child_env, {2: attack}, lambda rs: all(r.group_size == 3 for r in rs[:2])
    )
    a, b, c = members
    assert ra.digest == rb.digest and torch.equal(a.theta_g(), b.theta_g())
    if attack == "inflated_claims":
        assert ra.rejected == rb.rejected == {}, (ra.rejected, rb.rejected)
        assert ra.accused == rb.accused == {}, (ra.accused, rb.accused)
        assert ra.tokens == rb.tokens == 100 + 200 + 4 * 200, (ra, rb)
        return
    assert ra.contributed and rb.contributed, (ra, rb)
    if attack == "stretched_delta":  # within every rejection bound: clipping bounds it
        assert ra.rejected == rb.rejected == {} and ra.clipped >= 1 and rb.clipped >= 1, (ra, rb)
        return
    assert ra.clipped == rb.clipped == 0, (ra, rb)  # the rest are left out, not clipped
    assert c.peer_id in ra.rejected and c.peer_id in rb.rejected, ra.rejected
    assert not any(p in ra.rejected for p in (a.peer_id, b.peer_id)), ra.rejected
    # each reduced C's contribution to its own part and caught it first-hand
    caught = [] if attack == "noise" else [c.peer_id]
    assert list(ra.accused) == list(rb.accused) == caught, (ra.accused, rb.accused)


@pytest.mark.parametrize("attack", ["sign_flip", "noise", "scaled_delta"])
def test_in_a_group_of_two_the_reducer_bounds_the_others_contribution_by_its_own(
    links: list[OuterLink], child_env: dict[str, str], attack: str
) -> None:
    """A group of two has no majority: A, reducing its part, rejects C's contribution when
    it points against or across A's own (a sign flip, noise of A's norm) or is far longer
    (x 100: past the reference norm bound, before the pair's), and reports C (`accused`)
    unless it only pointed across (noise).
    C's own part is C's to reduce: a reducer controls
    its part, which is why a stage of two can be steered for a round and drops nobody."""
    for attempt in range(4):
        (a, c), theta0 = group(links, child_env, 2, {1: attack})
        a.begin_round([work(theta0, 0)], 100)
        c.begin_round([work(theta0, 1)], 100)
        ra = a.wait_result(60)
        if ra.group_size == 2:
            break
        print(f"attempt {attempt}: group size {ra.group_size}")
    else:
        pytest.fail("A and C never formed a group of two in 4 tries")
    # x 100 passes the reference norm bound first (max_rel_norm x ||theta_g||)
    expect = "norm" if attack == "scaled_delta" else "pair: cosine"
    assert expect in ra.rejected.get(c.peer_id, ""), ra.rejected
    # reported when no honest replica sends it; noise points across, as an honest
    # replica's delta sometimes does: rejected, not reported
    assert (c.peer_id in ra.accused) == (attack != "noise"), ra.accused
    assert expect in ra.accused.get(c.peer_id, expect)
    assert ra.contributed and a.peer_id not in ra.accused


def test_sparse_contributions_reduce_to_identical_states_at_a_fraction_of_the_bytes(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """With `topk3` each member contributes the top 3 % of each chunk of its pseudo-gradient;
    the reducers' aggregates travel as nonzeros too, and the members end bitwise identical
    on the weighted mean of the selections, at a fraction of the fp16 bytes. (What the
    residual keeps between rounds: tests/test_outer_topk.py.)"""
    numel = 3 * CHUNK
    config = dataclasses.replace(CFG, compression="topk3")
    tokens = [100, 200, 300]
    members, theta0, results = grouped_round(
        links, child_env, {}, lambda rs: all(r.group_size == 3 for r in rs), config, numel
    )
    assert all(r.applied and r.contributed for r in results), results
    assert not any(r.rejected for r in results), [r.rejected for r in results]
    assert len({r.digest for r in results}) == 1
    assert all(torch.equal(members[0].theta_g(), m.theta_g()) for m in members[1:])
    sent = [select_topk(theta0 - work(theta0, i), 0.03) for i in range(3)]
    d = sum(t * x for t, x in zip(tokens, sent, strict=True)) / sum(tokens)
    d = d.half().float()  # the reducers' aggregates, at fp16 on the wire
    expect = theta0 - 0.7 * (d + 0.9 * d)
    assert torch.allclose(members[0].theta_g(), expect, atol=1e-6)
    fp16_out = 5 * 2 * numel // 3  # what the most a member sends would be at fp16
    assert all(0 < r.bytes_out < fp16_out / 5 for r in results), [r.bytes_out for r in results]


def test_what_a_sparse_round_did_not_send_rides_in_the_next(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """A member's second `topk3` contribution is the top 3 % of what its first one left
    out plus its new pseudo-gradient: the stage steps by exactly that, not by a selection
    of the new pseudo-gradient alone."""
    numel = 3 * CHUNK
    config = dataclasses.replace(CFG, compression="topk3")
    tokens = [100, 200, 300]

    def round_of(members: list[OuterLink], works: list[torch.Tensor]) -> list[RoundResult]:
        for m, w, t in zip(members, works, tokens, strict=True):
            m.begin_round([w], t)
        return [m.wait_result(60) for m in members]

    for attempt in range(4):  # matchmaking may split the three under load: a fresh stage
        members, theta0 = group(links, child_env, 3, None, config, numel)
        works = [work(theta0, i) for i in range(3)]
        if all(r.group_size == 3 for r in round_of(members, works)):
            # copies: the link's tensors are views of buffers the next round rewrites
            theta1, m1 = members[0].theta_g().clone(), members[0].momentum().clone()
            works2 = [
                theta1 - 0.01 * (vec(2, 1.0, numel) + vec(20 + i, 1.0, numel)) for i in range(3)
            ]
            seconds = round_of(members, works2)
            if all(r.group_size == 3 for r in seconds):
                break
        print(f"attempt {attempt}: the three did not group in both rounds")
    else:
        raise AssertionError("the replicas never grouped twice in a row in 4 tries")
    assert all(r.applied and r.contributed for r in seconds), seconds
    assert all(torch.equal(members[0].theta_g(), m.theta_g()) for m in members[1:])

    def step(contribs: list[torch.Tensor]) -> torch.Tensor:
        d = (sum(t * x for t, x in zip(tokens, contribs, strict=True)) / sum(tokens)).half()
        m2 = 0.9 * m1 + d.float()
        return theta1 - 0.7 * (d.float() + 0.9 * m2)

    left = [theta0 - w - select_topk(theta0 - w, 0.03) for w in works]
    with_residual = step(
        [select_topk(e + theta1 - w, 0.03) for e, w in zip(left, works2, strict=True)]
    )
    without = step([select_topk(theta1 - w, 0.03) for w in works2])
    # within one fp16 step of an aggregate value (the reducers round their sums once)
    assert torch.allclose(members[0].theta_g(), with_residual, atol=5e-5)
    assert float((members[0].theta_g() - without).abs().max()) > 1e-3
