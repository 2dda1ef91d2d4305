"""One identity on every plane, and groups of the stage's members only, with real
outer-loop processes on loopback.

An outer process started with a node's key runs its hivemind daemon under it: its DHT
peer id is the node's and every DHT address it announces ends in that id. A round told
the stage's members (`Begin.members`, the coordinator's view) forms no group with a peer
outside them: a stranger that runs a replica of the stage, holds its state and looks for
a group at the same moment stays out, and the members average their own work only. The
same stranger is admitted when the members are not given (the control run). A group
that holds every listed member is full: it averages at once instead of gathering for the
whole matchmaking window.

The pytest process only imports `node.outer_link` (no hivemind).
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from node.diloco import DilocoConfig
from node.outer_link import OuterConfig, OuterLink, RoundResult
from protocol.identity import NodeKey

N = 2000  # parameters per replica
CFG = OuterConfig(
    matchmaking_s=3.0,
    request_timeout_s=0.5,
    round_timeout_s=4.0,
    state_timeout_s=10.0,
    diloco=DilocoConfig(eta=0.7, mu=0.9, target_tokens=600),
)
TOKENS = (100, 200, 400)  # A, B (members) and C (the stranger)
BACKOFF_S = 12.0  # s after a restart before its rounds: dials of a dead address back off


def vec(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def start_replica(
    links: list[OuterLink],
    env: dict[str, str],
    run: str,
    key: NodeKey | None,
    boot: list[str] | None = None,
    *,
    stage: int = 0,
    cfg: OuterConfig = CFG,
) -> OuterLink:
    """An outer process for `stage` of `run` under `key` (None: a key of its own), joined
    to the DHT at `boot`; `links` closes it at the end."""
    link = OuterLink.start(
        run_id=run, stage=stage, numel=N, initial_peers=boot or [], config=cfg, env=env,
        identity=key.libp2p_private_key() if key is not None else b"",
    )  # fmt: skip
    links.append(link)
    return link


def test_the_outer_process_runs_under_the_nodes_key(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    key = NodeKey.generate()
    link = start_replica(links, child_env, uuid.uuid4().hex[:8], key)
    assert link.peer_id == key.peer_id
    assert link.dht_addrs() and all(a.endswith(f"/p2p/{key.peer_id}") for a in link.dht_addrs())


def start_stage(
    links: list[OuterLink], env: dict[str, str], n: int, cfg: OuterConfig
) -> tuple[list[OuterLink], list[NodeKey]]:
    """A fresh stage of `n` outer processes, each under its own key, joined into one DHT;
    the first holds `vec(0)` as the state and the others fetched it."""
    run = uuid.uuid4().hex[:8]
    keys = [NodeKey.generate() for _ in range(n)]
    out: list[OuterLink] = []
    for key in keys:
        boot = [a for m in out for a in m.dht_addrs()]
        out.append(start_replica(links, env, run, key, boot, cfg=cfg))
    out[0].set_initial_state([vec(0)])
    for link in out[1:]:
        assert link.fetch_state(timeout=15) == 0 and link.digest == out[0].digest
    return out, keys


def begin(link: OuterLink, i: int, members: list[str] | None) -> None:
    """Replica `i`'s round: a shared step plus one of its own, so that replicas' deltas
    point alike, as honest ones do."""
    link.begin_round([vec(0) - 0.01 * (vec(1) + vec(10 + i))], TOKENS[i], members=members)


def stage_round(
    links: list[OuterLink], env: dict[str, str], listed: bool
) -> tuple[list[OuterLink], list[RoundResult]]:
    """A fresh stage: A and B are its members, C a stranger with its own key that joined
    their DHT and fetched their state. All three train and begin a round together; A and
    B are told the members (`listed`) or not. Returns the three links and A's and B's
    results (C's round may fail: a group it led lost its followers)."""
    out, keys = start_stage(links, env, 3, CFG)
    members = [keys[0].peer_id, keys[1].peer_id]
    for i, link in enumerate(out):
        begin(link, i, members if listed and i < 2 else None)
    results = [link.wait_result(60) for link in out[:2]]
    try:
        out[2].wait_result(60)
    except Exception as exc:  # a stranger's round that lost its group is its own affair
        print(f"C's round: {exc!r}")
    return out, results


def test_a_stranger_is_kept_out_of_the_stages_groups(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """A and B are told the stage's members: C never joins their group (group size at
    most 2, tokens never C's), and when A and B group they end identical on the mean of
    their own work. Matchmaking may split them under load: a fresh stage retries."""
    for attempt in range(4):
        (a, b, _c), (ra, rb) = stage_round(links, child_env, listed=True)
        assert ra.group_size <= 2 and rb.group_size <= 2, (ra, rb)
        assert max(ra.tokens, rb.tokens) <= TOKENS[0] + TOKENS[1], (ra, rb)  # never C's
        if ra.group_size == rb.group_size == 2:
            assert ra.tokens == rb.tokens == TOKENS[0] + TOKENS[1], (ra, rb)
            assert ra.digest == rb.digest and torch.equal(a.theta_g(), b.theta_g())
            return
        print(f"attempt {attempt}: group sizes {ra.group_size}, {rb.group_size}")
    pytest.fail("A and B never formed a group of two in 4 tries")


def test_without_the_members_the_stranger_joins(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """The control: the same stage with no members given admits C into the group."""
    for attempt in range(4):
        _links, (ra, rb) = stage_round(links, child_env, listed=False)
        if ra.group_size == rb.group_size == 3:
            assert ra.tokens == rb.tokens == sum(TOKENS), (ra, rb)
            return
        print(f"attempt {attempt}: group sizes {ra.group_size}, {rb.group_size}")
    pytest.fail("the three replicas never formed a group of three in 4 tries")


def test_a_group_of_every_listed_member_does_not_wait_out_the_window(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """With a 30 s matchmaking window and room for 8, the two listed members of a stage
    average as soon as both are in: the round ends well inside the window (it ran the
    whole window before, unless 8 replicas joined)."""
    window = 30.0
    cfg = OuterConfig(
        matchmaking_s=window, request_timeout_s=0.5, round_timeout_s=4.0,
        state_timeout_s=10.0, target_group_size=8, diloco=CFG.diloco,
    )  # fmt: skip
    for attempt in range(3):
        pair, keys = start_stage(links, child_env, 2, cfg)
        members = [k.peer_id for k in keys]
        for i, link in enumerate(pair):
            begin(link, i, members)
        ra, rb = (link.wait_result(3 * window) for link in pair)
        if ra.group_size == rb.group_size == 2:
            assert max(ra.seconds, rb.seconds) < window / 2, (ra, rb)
            assert torch.equal(pair[0].theta_g(), pair[1].theta_g())
            return
        print(f"attempt {attempt}: group sizes {ra.group_size}, {rb.group_size}")
    pytest.fail("the two members never formed a group of two in 3 tries")


def test_a_replica_alone_on_its_stage_steps_at_once(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """Listed as the stage's only member, a replica does not wait for a group that cannot
    form (groups admit members only): it steps alone at once, not when its averaging
    would time out (2 x 30 s + 1 s here)."""
    window = 30.0
    cfg = OuterConfig(
        matchmaking_s=window, request_timeout_s=0.5, round_timeout_s=4.0,
        state_timeout_s=10.0, diloco=CFG.diloco,
    )  # fmt: skip
    key = NodeKey.generate()
    link = start_replica(links, child_env, uuid.uuid4().hex[:8], key, cfg=cfg)
    link.set_initial_state([vec(0)])
    begin(link, 0, [key.peer_id])
    result = link.wait_result(3 * window)
    assert result.group_size == 1 and result.applied and result.round == 1, result
    assert result.seconds < window / 2, result


def test_replicas_that_restarted_together_find_each_other(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """Two replicas of a stage restart their outer processes at the same moment (a move
    to the run's DHT): each new process keeps its node's key and bootstraps from the
    run's root and from the other's last announced DHT, which died with its old process.
    Each daemon then holds a dead address for the other's peer id, and a dial of it
    fails ("dial backoff") for as long as it keeps trying. A join request goes to the
    leader at the address it announces on the stage's DHT, so they still form a group."""
    run = uuid.uuid4().hex[:8]
    root = start_replica(links, child_env, run, None, stage=1)
    keys = [NodeKey.generate() for _ in range(2)]
    dead: list[list[str]] = []
    for key in keys:  # the old processes: their addresses outlive them
        old = start_replica(links, child_env, run, key)
        dead.append(old.dht_addrs())
        old.close(timeout=10.0)
    pair = []
    for i, key in enumerate(keys):
        link = start_replica(links, child_env, run, key, [*root.dht_addrs(), *dead[1 - i]])
        link.set_initial_state([vec(0)])
        pair.append(link)
    members = [k.peer_id for k in keys]
    # The rounds begin once each daemon has failed the other's dead address a few times
    # (its DHT keeps trying the peer id): go-libp2p then backs off from that address for
    # 5 s + 1 s x failures^2. A round begun at once can still beat the first backoff.
    time.sleep(BACKOFF_S)
    for attempt in range(3):
        for i, link in enumerate(pair):
            begin(link, i, members)
        ra, rb = (link.wait_result(60) for link in pair)
        if ra.group_size == rb.group_size == 2:
            assert ra.digest == rb.digest and torch.equal(pair[0].theta_g(), pair[1].theta_g())
            return
        print(f"attempt {attempt}: group sizes {ra.group_size}, {rb.group_size}")
    pytest.fail("the two replicas never formed a group of two in 3 rounds")


def test_a_joiner_told_the_members_takes_no_strangers_state(
    links: list[OuterLink], child_env: dict[str, str]
) -> None:
    """A stage with no attested state yet: member A holds round 0; C, a stranger on the
    stage's DHT, holds a state of round 5 (the higher sharing priority). A joiner not
    told the members (the control) downloads C's round 5; a joiner told them (the node
    passes its view with the fetch) downloads A's round 0."""
    run = uuid.uuid4().hex[:8]
    a_key, c_key = NodeKey.generate(), NodeKey.generate()

    a = start_replica(links, child_env, run, a_key)
    a.set_initial_state([vec(0)])
    c = start_replica(links, child_env, run, c_key, a.dht_addrs())
    c.set_initial_state([vec(5)], round_=5)
    for attempt in range(3):  # the control: C's declaration is seen and preferred
        control = start_replica(links, child_env, run, None, a.dht_addrs())
        if control.fetch_state(timeout=15) == 5:
            break
        print(f"attempt {attempt}: the control joiner did not take C's round 5 yet")
    else:
        pytest.fail("a joiner not told the members never took the stranger's state")
    b_key = NodeKey.generate()
    b = start_replica(links, child_env, run, b_key, a.dht_addrs())
    assert b.fetch_state(timeout=15, members=[a_key.peer_id, b_key.peer_id]) == 0
    assert b.digest == a.digest and torch.equal(b.theta_g(), vec(0))


@pytest.mark.parametrize("listed", [True, False])
def test_a_replica_that_seeds_the_state_is_told_the_members_with_it(
    links: list[OuterLink], child_env: dict[str, str], listed: bool
) -> None:
    """A replica that fetched no state (the first of its stage, or a joiner that found
    nothing attested) sets its own, and the node passes its view of the stage with it:
    from then on a stranger's records on the stage's DHT are refused. C, a stranger on
    A's DHT, looks for a group (its round's matchmaking declaration); A, told the
    members as it set its state, never sees it. The control, told nothing, does."""
    run = uuid.uuid4().hex[:8]
    a_key = NodeKey.generate()
    a = start_replica(links, child_env, run, a_key)
    a.set_initial_state([vec(0)], members=[a_key.peer_id] if listed else None)
    c = start_replica(links, child_env, run, None, a.dht_addrs())
    c.set_initial_state([vec(5)])
    c.begin_round([vec(5) + 0.01 * vec(6)], 100)  # declares for CFG.matchmaking_s
    seen, deadline = 0, time.monotonic() + CFG.matchmaking_s + 2.0
    while not seen and time.monotonic() < deadline:
        seen = a.peers_waiting()
        time.sleep(0.1)
    try:
        c.wait_result(60)
    except Exception as exc:  # the stranger's lone round is its own affair
        print(f"C's round: {exc!r}")
    assert seen == (0 if listed else 1)
