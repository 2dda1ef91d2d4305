"""Reduce-scatter + all-gather rounds of real outer-loop processes on loopback: three
replicas end bitwise identical with the reference aggregate, and a member that freezes
mid-round leaves the survivors identical (its part gets no update).

The pytest process only imports `node.outer_link` (no hivemind).
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from node.diloco import DilocoConfig
from node.outer_link import OuterConfig, OuterLink

N = 3000  # parameters per replica: three parts of 1000
CFG = OuterConfig(
    matchmaking_s=2.0,
    request_timeout_s=0.5,
    round_timeout_s=4.0,
    state_timeout_s=10.0,
    averaging="reduce_scatter",
    diloco=DilocoConfig(eta=0.7, mu=0.9, target_tokens=600),
)


@pytest.fixture
def links(child_env: dict[str, str]) -> Iterator[list[OuterLink]]:
    made: list[OuterLink] = []
    yield made
    for link in made:
        try:
            os.killpg(link.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        link.close(timeout=10.0)


def start(links: list[OuterLink], env: dict[str, str], run: str, peers: list[str]) -> OuterLink:
    link = OuterLink.start(run_id=run, stage=0, numel=N, initial_peers=peers, config=CFG, env=env)
    links.append(link)
    return link


def vec(seed: int, scale: float) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)) * scale


def group(
    links: list[OuterLink], env: dict[str, str], n: int
) -> tuple[list[OuterLink], torch.Tensor]:
    run = uuid.uuid4().hex[:8]
    first = start(links, env, run, [])
    members = [first] + [start(links, env, run, first.dht_addrs()) for _ in range(n - 1)]
    theta0 = vec(0, 1.0)
    first.set_initial_state([theta0])
    for m in members[1:]:
        assert m.fetch_state(timeout=15) == 0 and m.digest == first.digest
    return members, theta0


def test_three_replicas_reduce_scatter_to_bitwise_identical_states(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    tokens = [100, 200, 300]
    for attempt in range(3):  # matchmaking may split the three: then a fresh stage retries
        members, theta0 = group(links, child_env, 3)
        works = [theta0 - 0.01 * vec(10 + i, 1.0) for i in range(3)]
        for m, w, t in zip(members, works, tokens, strict=True):
            m.begin_round([w], t)
        results = [m.wait_result(40) for m in members]
        if all(r.group_size == 3 for r in results):
            break
        print(f"attempt {attempt}: groups {[r.group_size for r in results]}")
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
    """C joins the group and freezes before it sends anything: its contributions never
    arrive (its parts are reduced without it) and its own part's reduced bytes never
    come (that part gets no update on both survivors)."""
    members, theta0 = group(links, child_env, 3)
    a, b, c = members
    for m, seed in zip(members, (1, 2, 3), strict=True):
        m.begin_round([theta0 - 0.01 * vec(seed, 1.0)], 100)
    time.sleep(CFG.matchmaking_s * 0.75)  # C has joined a group that has not begun yet
    os.killpg(c.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    ra, rb = a.wait_result(40), b.wait_result(40)
    bound = 2 * CFG.matchmaking_s + 1.0 + CFG.round_timeout_s + 5.0
    assert time.monotonic() - t0 < bound
    assert ra.applied and rb.applied and ra.round == rb.round == 1, (ra, rb)
    assert ra.digest == rb.digest and torch.equal(a.theta_g(), b.theta_g())
    lost = [v for v in ra.rejected.values() if "did not arrive" in v]
    if lost:  # C was in the group: its part kept theta_g as it was
        j = int(re.match(r"part (\d+)", lost[0]).group(1))  # type: ignore[union-attr]
        lo, hi = j * N // 3, (j + 1) * N // 3
        assert torch.equal(a.theta_g()[lo:hi], theta0[lo:hi])
        assert not torch.equal(a.theta_g(), theta0)
        assert ra.rejected == rb.rejected
    print(f"frozen member in the group: {bool(lost)}; A's round took {ra.seconds:.2f}s")
