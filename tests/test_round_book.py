"""`RoundBook`: a push waits for its round to register, and is answered at once for a
round that already ended here (a resend after a lost reply)."""

from __future__ import annotations

import asyncio
import time

from node.outer.round_book import RoundBook


def test_a_push_waits_for_its_round_to_register() -> None:
    async def scenario() -> str | None:
        book: RoundBook[str] = RoundBook()
        asyncio.get_running_loop().call_later(0.05, book.register, b"g1", "round g1")
        return await book.find(b"g1", timeout=5.0)

    assert asyncio.run(scenario()) == "round g1"


def test_a_push_for_an_ended_round_is_answered_at_once() -> None:
    async def scenario() -> tuple[str | None, float]:
        book: RoundBook[str] = RoundBook()
        book.register(b"g1", "round g1")
        book.end(b"g1")
        t0 = time.monotonic()
        found = await book.find(b"g1", timeout=30.0)
        return found, time.monotonic() - t0

    found, waited = asyncio.run(scenario())
    assert found is None
    assert waited < 1.0  # not the 30 s timeout


def test_an_unknown_round_waits_out_its_timeout() -> None:
    async def scenario() -> tuple[str | None, float]:
        book: RoundBook[str] = RoundBook()
        # another round registering wakes the waiter, which goes on waiting for its own
        asyncio.get_running_loop().call_later(0.05, book.register, b"other", "another")
        t0 = time.monotonic()
        found = await book.find(b"g1", timeout=0.2)
        return found, time.monotonic() - t0

    found, waited = asyncio.run(scenario())
    assert found is None and waited >= 0.19


def test_the_book_remembers_only_the_last_ended_rounds() -> None:
    book: RoundBook[int] = RoundBook(ended_kept=3)
    for i in range(5):
        book.register(bytes([i]), i)
        book.end(bytes([i]))

    async def waits(gid: bytes) -> float:
        t0 = time.monotonic()
        await book.find(gid, timeout=0.2)
        return time.monotonic() - t0

    assert asyncio.run(waits(bytes([4]))) < 0.1  # remembered
    assert asyncio.run(waits(bytes([0]))) >= 0.19  # forgotten: waits like an unknown one


def test_an_ended_round_keeps_the_receipts_of_what_it_accepted() -> None:
    book: RoundBook[str] = RoundBook()
    book.register(b"g1", "round g1")
    book.end(b"g1", frozenset({("peer a", b"header 1")}))
    assert ("peer a", b"header 1") in book.receipts(b"g1")
    assert ("peer a", b"header 2") not in book.receipts(b"g1")
    assert book.receipts(b"never seen") == frozenset()
