"""Attested states against a state takeover, in real outer processes on loopback: a rogue
replica (`swarmlab.chaos.rogue_outer --attack state_takeover`) declares DHT sharing
priority 2**62 and serves a forged state of that round. A joiner given the stage's
attested (round, digest) downloads exactly that state, a replica beginning a round
rebases onto the attested state only, and a member behind its group takes the stepped
state from the group's holders: never the rogue's. Without an attested state a joiner
takes the rogue's (what coordinator attestation closes)."""

from __future__ import annotations

import time
import uuid

import torch

from node.outer_link import OuterConfig, OuterLink
from swarmlab.chaos.rogue_outer import FORGED_ROUND

N = 2000
CFG = OuterConfig(
    compression="fp16", matchmaking_s=1.5, request_timeout_s=1.0, round_timeout_s=4.0,
    state_timeout_s=10.0, target_group_size=4,
)  # fmt: skip
DECLARE_S = 5.0  # the averager re-declares its sharing priority this often (s)


def start(
    links: list[OuterLink], env: dict[str, str], run: str, peers: list[str], attack: str = ""
) -> OuterLink:
    entry = ("-m", "swarmlab.chaos.rogue_outer", "--attack", attack) if attack else None
    link = OuterLink.start(
        run_id=run, stage=0, numel=N, initial_peers=peers, config=CFG, env=env,
        **({"entry": entry} if entry else {}),
    )  # fmt: skip
    links.append(link)
    return link


def test_attested_states_are_taken_and_a_forged_one_is_not(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    run = uuid.uuid4().hex[:8]
    a = start(links, child_env, run, [])
    theta0 = torch.randn(N, generator=torch.Generator().manual_seed(0))
    a.set_initial_state([theta0])
    attested = (0, a.digest)
    rogue = start(links, child_env, run, a.dht_addrs(), attack="state_takeover")
    assert rogue.fetch_state(timeout=15, attested=attested) == 0  # it now "holds" a state
    boot = a.dht_addrs() + rogue.dht_addrs()
    time.sleep(DECLARE_S + 1.0)  # the rogue's priority 2**62 is in the DHT

    joiner = start(links, child_env, run, boot)
    assert joiner.fetch_state(timeout=15, attested=attested) == 0
    assert joiner.digest == a.digest and torch.equal(joiner.theta_g(), theta0)

    # the attack, without attestation: the highest declared priority wins (once the
    # rogue's declaration reached the new replica's DHT view: a few tries)
    for _ in range(3):
        naive = start(links, child_env, run, boot)
        if naive.fetch_state(timeout=15) == FORGED_ROUND:
            break
        time.sleep(DECLARE_S)
    assert naive.round == FORGED_ROUND
    assert torch.equal(naive.theta_g(), torch.full((N,), 1e3))

    # A steps alone to round 1; the coordinator attests it (as for a lone replica)
    a.begin_round([theta0 * 0.99], 100, attested=attested)
    ra = a.wait_result(30)
    assert ra.applied and ra.round == 1 and not ra.rebased, ra
    # A served its state to the rogue and the joiner at least (theta_g and m, fp32)
    assert ra.state_bytes_out >= 2 * 8 * N and ra.state_bytes_out % (8 * N) == 0, ra
    # a replica behind (round 0) rebases onto A's state, the attested one, though the
    # rogue declares round 2**62. It bootstraps from every replica, as a node does from
    # the stage's membership: the joiner, now the only honest holder of round 0, must
    # be reachable (its daemon's DHT may not have found it yet: "routing: not found").
    late = start(links, child_env, run, boot + joiner.dht_addrs() + naive.dht_addrs())
    assert late.fetch_state(timeout=15, attested=attested) == 0
    late.begin_round([theta0], 0, attested=(ra.round, ra.digest))
    rl = late.wait_result(40)
    assert rl.rebased and 1 <= rl.round < FORGED_ROUND, rl
    assert (1, ra.digest) in rl.lineage, rl.lineage
    assert rl.state_bytes_in == 2 * 8 * N, rl  # its fetch and its rebase

    # In a group with A the joiner, behind (round 0), is not at the group's canonical
    # state: it takes the state A stepped to from A, the state's holder in the group,
    # never from the rogue that declares the highest priority.
    for _ in range(3):  # a group forms when both matchmake at once
        a.begin_round([a.theta_g() * 0.99], 100)
        joiner.begin_round([joiner.theta_g() * 0.99], 100)
        ra2, rj2 = a.wait_result(40), joiner.wait_result(40)
        if ra2.group_size == 2:
            break
    assert ra2.group_size == 2 and ra2.applied, ra2
    assert rj2.rebased and rj2.digest == ra2.digest and rj2.round == ra2.round, rj2
    assert torch.equal(joiner.theta_g(), a.theta_g())


def test_a_replica_that_holds_the_attested_state_downloads_nothing(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """Replicas of a stage start from the same seeded weights, so a joiner's round 0 is
    the attested round 0: it keeps its own copy instead of downloading the same bytes."""
    run = uuid.uuid4().hex[:8]
    a = start(links, child_env, run, [])
    theta0 = torch.randn(N, generator=torch.Generator().manual_seed(1))
    a.set_initial_state([theta0])
    b = start(links, child_env, run, a.dht_addrs())
    b.set_initial_state([theta0.clone()])
    assert b.digest == a.digest
    assert b.fetch_state(timeout=15, attested=(0, a.digest)) == 0
    a.begin_round([theta0 * 0.99], 100, attested=(0, a.digest))
    ra = a.wait_result(30)
    assert ra.applied and ra.state_bytes_out == 0, ra  # A served no state to B
    # a replica that holds another state still downloads the attested one
    c = start(links, child_env, run, a.dht_addrs() + b.dht_addrs())
    c.set_initial_state([theta0 + 1.0])
    assert c.fetch_state(timeout=15, attested=(0, b.digest)) == 0
    assert c.digest == b.digest and torch.equal(c.theta_g(), theta0)
