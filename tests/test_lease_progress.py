"""Out-of-order micro-batches commit only as a contiguous prefix."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.lease_progress import LeaseProgress


def test_commits_only_the_contiguous_prefix() -> None:
    p = LeaseProgress(committed=100, end=400)
    p.finish(200, 300)
    assert p.commit_point() == 100
    p.finish(100, 200)
    assert p.commit_point() == 300
    p.accept(300)
    p.finish(300, 400)
    p.accept(p.commit_point())
    assert p.complete and p.done == {}


def test_rejects_ranges_outside_the_lease_and_backward_commits() -> None:
    p = LeaseProgress(committed=100, end=400)
    with pytest.raises(ValueError, match="outside"):
        p.finish(0, 100)
    with pytest.raises(ValueError, match="backwards"):
        p.accept(50)


@given(st.permutations(list(range(10))), st.integers(1, 9))
def test_any_finishing_order_commits_everything_exactly(
    order: list[int], accept_every: int
) -> None:
    p = LeaseProgress(committed=0, end=1000)
    commits = []
    for i, k in enumerate(order):
        p.finish(k * 100, k * 100 + 100)
        if i % accept_every == 0 and p.commit_point() > p.committed:
            commits.append((p.committed, p.commit_point()))
            p.accept(p.commit_point())
    if p.commit_point() > p.committed:
        commits.append((p.committed, p.commit_point()))
        p.accept(p.commit_point())
    assert p.complete
    covered = [a for c in commits for a in range(*c)]
    assert covered == list(range(1000))
