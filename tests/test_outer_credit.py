"""Token claims bounded by the coordinator's credits (node/outer/credit.py): which
credits a group counts (the key most members' credits name, the member's own, this
stage's, fresh), what a credit backs, and the property that with an honest majority a
liar counts at most `slack` x the work witnessed for it while every honest claim stands
(hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node.outer.credit import MAX_CREDIT_AGE_S, credit_caps, credited_rates
from node.outer.parts import group_claims
from node.outer.settings import MAX_COUNT
from protocol.credit import sign_credit
from protocol.identity import NodeKey

COORD = NodeKey.generate()
PEERS = ["12D3KooWa", "12D3KooWb", "12D3KooWc"]


def credit(peer: str, rate: float, *, key: NodeKey = COORD, stage: int = 1, at: float = 1e9,
           run: str = "run") -> bytes:  # fmt: skip
    return sign_credit(key, run=run, peer=peer, stage=stage, rate=rate, issued_at=at)


def rates(credits: list[bytes], peers: list[str] = PEERS) -> list[float | None]:
    return credited_rates(credits, peers, run="run", stage=1)


def test_a_group_counts_the_credits_its_majority_key_signed() -> None:
    a, b, c = PEERS
    assert rates([credit(a, 10.0), credit(b, 20.0), credit(c, 30.0)]) == [10.0, 20.0, 30.0]
    # a liar signs its own: a minority key, not counted; the others' still are
    liar = NodeKey.generate()
    assert rates([credit(a, 10.0), credit(b, 20.0), credit(c, 1e9, key=liar)]) == [10, 20, None]
    # a credit shown by another member, for another stage or run, or none: not counted
    assert rates([credit(a, 10.0), credit(a, 20.0), credit(c, 30.0)]) == [10.0, None, 30.0]
    four = [*PEERS, "12D3KooWd"]
    ok = [credit(a, 10.0), credit(b, 20.0), credit(c, 30.0)]
    for bad in (credit(four[3], 40.0, stage=0), credit(four[3], 40.0, run="other"), b"junk"):
        assert rates([*ok, bad], four) == [10.0, 20.0, 30.0, None]
    # ... and a member's credit counts only where more than half of the group's do
    assert rates([credit(a, 10.0), credit(b, 20.0, stage=0), b""]) == [None, None, None]
    # one old credit from a busier time: not counted
    old = 1e9 - MAX_CREDIT_AGE_S - 1
    assert rates([credit(a, 10.0), credit(b, 20.0), credit(c, 99.0, at=old)]) == [10, 20, None]
    # no key that more than half of the members' credits name: none counts (a pair
    # whose liar signs its own, or a coordinator that changed keys in between)
    assert rates([credit(a, 10.0), credit(b, 20.0, key=liar)], PEERS[:2]) == [None, None]
    assert rates([credit(a, 10.0), b"", b""]) == [None, None, None]


def test_a_credit_backs_slack_times_the_groups_seconds_of_work() -> None:
    # two honest members at 100 tokens/s claim 60 s of work; the liar does 50 tokens/s
    assert credit_caps([6000, 6000, 10**15], [100.0, 100.0, 50.0], 2.0) == [12000, 12000, 6000]
    # a member with no counting credit, or nothing witnessed: the lower median claim
    assert credit_caps([6000, 5000, 10**15], [100.0, 100.0, None], 2.0)[2] == 6000
    assert credit_caps([6000, 5000, 10**15], [100.0, 100.0, 0.0], 2.0)[2] == 6000
    # rates so small that claim / rate overflows: a cap of MAX_COUNT, never an error
    tiny = [5e-324, 5e-324, 100.0]
    assert credit_caps([6000, 6000, 6000], tiny, 2.0) == [MAX_COUNT] * 3
    # nobody witnessed (one stage), a pair, or the check off: claims stand
    assert credit_caps([6000, 10**15, 10], [None, 0.0, None], 2.0) == [None] * 3
    assert credit_caps([6000, 10**15], [100.0, 50.0], 2.0) == [None, None]
    assert credit_caps([6000, 6000, 10**15], [100.0, 100.0, 50.0], 0.0) == [None] * 3
    # one liar in three, through group_claims: capped at twice its work, below 4 x median
    gathered = [{"round": 1, "base_round": 1, "tokens": t} for t in (6000, 6000, 10**15)]
    caps = credit_caps([6000, 6000, 10**15], [100.0, 100.0, 50.0], 2.0)
    assert group_claims(gathered, 4.0, caps)[2] == [6000, 6000, 6000]
    assert group_claims(gathered, 4.0)[2] == [6000, 6000, 24000]  # without credits


@settings(max_examples=200, deadline=None)
@given(
    honest=st.lists(st.floats(1.0, 1e6), min_size=2, max_size=8),  # witnessed tokens/s
    third=st.floats(1.0, 1e6),  # an honest member more: a group of at least 3
    seconds=st.floats(1.0, 600.0),  # what an honest round's claim stands for
    jitter=st.lists(st.floats(0.5, 2.0), min_size=8, max_size=8),  # witness noise
    liars=st.lists(st.tuples(st.integers(0, 2**62), st.floats(0.0, 1e6)), max_size=7),
    slack=st.floats(2.0, 8.0),
)
def test_with_an_honest_majority_a_liar_counts_at_most_slack_times_its_work(
    honest: list[float], seconds: float, jitter: list[float],
    liars: list[tuple[int, float]], slack: float, third: float,
) -> None:  # fmt: skip
    honest = [*honest, third][:8]
    liars = liars[: len(honest) - 1]
    # honest claims stand for `seconds` of their witnessed rate, within a factor 2
    claims = [max(1, int(r * seconds * j)) for r, j in zip(honest, jitter, strict=False)]
    rates_ = [*honest, *(r for _, r in liars)]
    caps = credit_caps([*claims, *(t for t, _ in liars)], rates_, slack)
    for i, (t, r) in enumerate(liars):
        cap = caps[len(honest) + i]
        assert cap is not None
        # the group's seconds per token/s is some honest member's, at most 2 x `seconds`
        bound = slack * r * 2 * seconds if r > 0 else max(claims)
        assert min(t, cap) <= bound + 1
    # honest claims within slack / 4 of one another all stand (jitter spans 4 x)
    if slack >= 4.0:
        assert all(c is None or c >= t for c, t in zip(caps, claims, strict=False))
