"""Token claims bounded by the coordinator's credits. Pure: no torch, no network.

A member's outer-loop contribution is weighted by the tokens it says it trained. Each
member also carries, in its gathered metadata, the credit its coordinator signed for it
(`protocol.credit`): the tokens/s that adjacent members witnessed for it. Every member
of a group derives from the gathered metadata alike (the weights a reducer owes are
checked by each contributor and the audit):

- `credited_rates`: which credits count. A credit counts when its signature holds, it
  names the member that shows it and this stage, it is signed by the key that more than
  half of the group's members' credits are signed by (each member's came from its own
  pinned coordinator: a liar's self-signed credit is a minority of one), and it is no
  more than `MAX_CREDIT_AGE_S` older than the group's median credit (an old credit from
  a busier time does not stand for now). No such key: no credit counts.
- `credit_caps`: what a credit backs. Within a group, honest members' claims stand for
  about the same seconds of work, so claim / witnessed rate is about the same for each.
  A member counts at most `slack` x its witnessed rate x the lower median of that
  ratio over the members whose credits count; a member without a counting credit (or
  with nothing witnessed) while others have one counts at most the lower median claim.
  When no member's work was witnessed (one stage, nobody routes to anyone), or the
  group is a pair (`MIN_GROUP`), claims stand as before, capped only by
  `max_token_ratio` (`node.outer.parts.group_claims`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from node.outer.settings import MAX_COUNT
from protocol.credit import Credit, open_credit
from protocol.errors import ProtocolError

MAX_CREDIT_AGE_S = 300.0  # seconds a counted credit may be older than the group's median
# members a group needs before credits bound its claims: in a pair, a liar that shows a
# credit signed by its own key leaves no key with a majority, so a pair's credits could
# only ever bound honest members (the pair rule bounds a pair: node.diloco.pair_problem)
MIN_GROUP = 3


def credited_rates(
    credits: Sequence[bytes], peers: Sequence[str], *, run: str, stage: int
) -> list[float | None]:
    """Each member's witnessed rate (tokens/s) by the credit it showed (`credits`, in
    `peers`' order, base58 peer ids), None where its credit does not count."""
    opened: list[Credit | None] = []
    for data, peer in zip(credits, peers, strict=True):
        try:
            c = open_credit(data, run) if data else None
        except ProtocolError:
            c = None
        opened.append(c if c is not None and c.peer == peer and c.stage == stage else None)
    keys = collections.Counter(c.key for c in opened if c is not None)
    key = next((k for k, n in keys.items() if 2 * n > len(peers)), None)
    if key is None:
        return [None] * len(peers)
    times = sorted(c.issued_at for c in opened if c is not None and c.key == key)
    floor = times[(len(times) - 1) // 2] - MAX_CREDIT_AGE_S
    return [
        c.rate if c is not None and c.key == key and c.issued_at >= floor else None for c in opened
    ]


def credit_caps(
    claims: Sequence[int], rates: Sequence[float | None], slack: float
) -> list[int | None]:
    """The most tokens each member's claim (`claims`) counts by its credit (`rates`, from
    `credited_rates`), None where nothing bounds it: every entry in a group smaller than
    `MIN_GROUP`, when no member's work was witnessed, or `slack` is 0 (off)."""
    per_rate = sorted(t / r for t, r in zip(claims, rates, strict=True) if r and t > 0)
    if slack == 0.0 or not per_rate or len(claims) < MIN_GROUP:
        return [None] * len(claims)
    seconds = per_rate[(len(per_rate) - 1) // 2]  # what a claim stands for, per token/s
    positive = sorted(t for t in claims if t > 0)
    median_claim = positive[(len(positive) - 1) // 2]
    # a cap past MAX_COUNT bounds nothing (and a non-finite one must not reach int())
    return [int(min(slack * r * seconds, MAX_COUNT)) if r else median_claim for r in rates]
