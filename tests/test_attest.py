"""Attested global states (coordinator.attest): the newest state a majority of a stage's
reporting replicas hold or held, never one a minority claims alone; and through the real
`Service` on a real SQLite file: heartbeats report states, replies name the stage's
attested state, and a member that leaves no longer counts."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

from coordinator_harness import SHARD_TOKENS, CountingStore, small_dataset
from hypothesis import given
from hypothesis import strategies as st

from coordinator.attest import Attestations, newest_majority
from coordinator.config import CoordinatorConfig
from coordinator.dataset import load_dataset
from coordinator.metrics import CoordinatorMetrics
from coordinator.server import build_state
from coordinator.service import Service
from protocol import control as c
from protocol.codec import encode
from protocol.identity import NodeKey
from protocol.signing import sign_request

RUN = "attest-run"
ALL = {"a", "b", "c", "d", "e"}


def test_a_lone_replica_attests_its_own_state() -> None:
    att = Attestations()
    att.report("a", 0, (3, "aa"))
    assert att.attested(0, ALL) == (3, "aa")
    assert att.attested(1, ALL) is None


def test_a_minority_claiming_a_higher_round_is_not_attested() -> None:
    att = Attestations()
    att.report("a", 0, (5, "aa"))
    att.report("b", 0, (5, "aa"))
    att.report("c", 0, (2**62, "ff"))
    assert att.attested(0, ALL) == (5, "aa")
    att.report("c", 0, (5, "ee"))  # the attested round, with another digest
    assert att.attested(0, ALL) == (5, "aa") and att.disagreeing == 1


def test_a_replica_that_stepped_on_still_vouches_for_the_state_it_left() -> None:
    att = Attestations()
    for p in "abc":
        att.report(p, 0, (4, "44"))
    att.report("a", 0, (5, "55"))
    assert att.attested(0, ALL) == (4, "44")  # only a holds round 5
    att.report("b", 0, (5, "55"))
    assert att.attested(0, ALL) == (5, "55")
    att.report("a", 0, (6, "66"))  # a alone again: round 5 is still held by a majority
    att.report("b", 0, (6, "67"))  # a and b disagree on round 6
    assert att.attested(0, ALL) == (5, "55")


def test_the_last_attested_state_stays_while_none_has_a_majority() -> None:
    att = Attestations(history=1)
    att.report("a", 0, (1, "11"))
    att.report("b", 0, (1, "11"))
    assert att.attested(0, ALL) == (1, "11")
    att.report("a", 0, (2, "2a"))
    att.report("b", 0, (2, "2b"))
    assert att.attested(0, ALL) == (1, "11")


def test_a_replica_holds_its_last_distinct_states_and_counts_once() -> None:
    att = Attestations(history=2)
    for s in [(1, "11"), (2, "22"), (1, "11"), (3, "33")]:  # (1) again: moves to the end
        att.report("a", 0, s)
    att.report("b", 0, (1, "11"))
    att.report("c", 0, (2, "22"))
    # a holds (1) and (3); b (1); c (2): (1) has 2 of 3
    assert att.attested(0, ALL) == (1, "11")
    att.report("a", 0, (4, "44"))  # a drops (1): no state has a majority now
    assert att.attested(0, ALL) == (1, "11")  # the last attested state stays
    att.report("b", 0, (3, "33"))
    assert att.attested(0, ALL) == (3, "33")  # a held it, b holds it


def test_a_commit_naming_another_state_of_an_attested_round_is_found_out() -> None:
    att = Attestations()
    for p, state in (("a", (4, "44")), ("b", (4, "44")), ("c", (4, "4f"))):
        att.report(p, 0, state)
    assert att.contradicts(0, (4, "4f"), ALL) == "44"  # a minority's state of round 4
    assert att.contradicts(0, (4, "44"), ALL) is None
    assert att.contradicts(0, (5, "55"), ALL) is None  # a round never attested: taken
    assert att.contradicts(1, (4, "4f"), ALL) is None  # another stage
    for p in "ab":  # the majority steps on: round 4's attested digest is kept
        att.report(p, 0, (5, "55"))
    assert att.attested(0, ALL) == (5, "55")
    assert att.contradicts(0, (4, "4f"), ALL) == "44" and att.contradicted == 2


def test_replicas_that_left_or_moved_no_longer_count() -> None:
    att = Attestations()
    att.report("a", 0, (7, "77"))
    att.report("b", 0, (7, "77"))
    att.report("c", 0, (8, "88"))
    assert att.attested(0, ALL) == (7, "77")
    att.forget("a")
    att.report("b", 1, (0, "00"))  # b now serves stage 1
    assert att.attested(0, ALL) == (8, "88")  # c is the stage's only replica
    assert att.attested(1, ALL) == (0, "00")
    att.report("d", 0, (9, "99"))
    assert att.attested(0, {"d"}) == (9, "99")  # c is not live any more: d alone


states = st.tuples(st.integers(0, 6), st.sampled_from(["aa", "bb", "cc"]))


@given(st.lists(st.lists(states, min_size=1, max_size=4), min_size=1, max_size=7))
def test_the_attested_state_is_held_by_a_majority_and_none_newer_is(
    histories: list[list[tuple[int, str]]],
) -> None:
    found = newest_majority(Counter(s for h in histories for s in set(h)), len(histories))
    holders = {s: sum(s in h for h in histories) for h in histories for s in h}
    majority = [s for s, n in holders.items() if 2 * n > len(histories)]
    if found is None:
        assert not majority
    else:
        assert 2 * holders[found] > len(histories)
        assert all(s[0] <= found[0] for s in majority)


# --- through the real Service ---------------------------------------------------------


def service(tmp: Path) -> Service:
    cfg = CoordinatorConfig(
        run_id=RUN, dataset=str(small_dataset(tmp)), shard_tokens=SHARD_TOKENS,
        db=str(tmp / "unused.sqlite"), token_cache="", n_stages=2,
    )  # fmt: skip
    manifest, corpus = load_dataset(cfg)
    journal, membership, book, paused = build_state(
        cfg, CountingStore(tmp / "c.sqlite"), manifest, time.time()
    )
    return Service(
        cfg, manifest=manifest, corpus=corpus, journal=journal, membership=membership,
        book=book, metrics=CoordinatorMetrics(), paused=paused,
    )  # fmt: skip


def call(svc: Service, key: NodeKey, body: object) -> object:
    raw = encode(sign_request(key, body, now=svc.started, run=RUN))  # type: ignore[arg-type]
    return svc.handle(raw, "127.0.0.1", svc.started).reply


def beat(svc: Service, key: NodeKey, state: tuple[int, str] | None) -> c.HeartbeatReply:
    ref = c.StateRef(round=state[0], digest=state[1]) if state is not None else None
    reply = call(svc, key, c.HeartbeatRequest(state=ref))
    assert isinstance(reply, c.HeartbeatReply), reply
    return reply


def joined(svc: Service, n: int, stage: int) -> list[NodeKey]:
    """Keys of `n` new members of `stage`."""
    keys = [NodeKey.generate() for _ in range(n)]
    for key in keys:
        reply = call(svc, key, c.JoinRequest(stage=stage))
        assert isinstance(reply, c.JoinReply) and reply.stage == stage, reply
    return keys


def test_heartbeats_report_states_and_replies_name_the_attested_one(tmp_path: Path) -> None:
    svc = service(tmp_path)
    keys = joined(svc, 3, stage=1)
    honest, rogue = keys[:2], keys[2]
    assert beat(svc, honest[0], None).attested is None
    got = beat(svc, honest[0], (3, "abc0"))
    assert got.attested == c.StateRef(round=3, digest="abc0")  # the only reporter
    beat(svc, rogue, (2**62, "ffff"))
    got = beat(svc, honest[1], (3, "abc0"))
    assert got.attested == c.StateRef(round=3, digest="abc0")
    assert beat(svc, rogue, (2**62, "ffff")).attested == got.attested
    status = svc.status(svc.started)
    assert status.stages[1].attested == got.attested and status.stages[0].attested is None
    # the honest replicas leave: the rogue is the stage's only replica, and attests alone
    for key in honest:
        assert isinstance(call(svc, key, c.LeaveRequest()), c.OkReply)
    assert beat(svc, rogue, (2**62, "ffff")).attested == c.StateRef(round=2**62, digest="ffff")


def test_a_commit_that_rode_in_no_attested_state_is_refused_and_its_range_requeued(
    tmp_path: Path,
) -> None:
    """Two of stage 0's three replicas hold round 3 as "abc0"; the third says its range
    rode in round 3 as "ffff". Its commit is refused as fenced, its lease ends at the
    committed offset and the range goes to the next replica that asks. A commit that
    names the attested state, or a round not attested, is taken."""
    svc = service(tmp_path)
    keys = joined(svc, 3, stage=0)
    honest, rogue = keys[:2], keys[2]
    for key in honest:
        beat(svc, key, (3, "abc0"))
    beat(svc, rogue, (3, "ffff"))

    def lease(key: NodeKey) -> c.LeaseInfo:
        got = call(svc, key, c.LeaseAcquire(max_tokens=64))
        assert isinstance(got, c.LeaseGrant) and got.lease is not None, got
        return got.lease

    def commit(key: NodeKey, x: c.LeaseInfo, n: int, rnd: int, digest: str) -> object:
        return call(svc, key, c.LeaseCommit(
            lease_id=x.lease_id, epoch=x.epoch, start=x.committed, end=x.committed + n,
            stage=0, round=rnd, digest=digest,
        ))  # fmt: skip

    mine = lease(rogue)
    assert isinstance(commit(rogue, mine, 8, 7, "7777"), c.LeaseReply)  # round 7: not attested
    mine = dataclasses.replace(mine, committed=mine.committed + 8)
    refused = commit(rogue, mine, 8, 3, "ffff")
    assert isinstance(refused, c.ErrorReply) and refused.code == "fenced", refused
    assert "abc0" in refused.detail and svc.attest.contradicted == 1
    again = lease(honest[0])  # the range is back in the queue, from the committed offset
    assert (again.shard_id, again.committed) == (mine.shard_id, mine.committed)
    assert isinstance(commit(honest[0], again, 8, 3, "abc0"), c.LeaseReply)
    assert isinstance(commit(rogue, mine, 8, 3, "abc0"), c.ErrorReply)  # its lease is gone
