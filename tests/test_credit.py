"""Credits (protocol/credit.py): the coordinator's signed word on a member's witnessed
work. A credit opens only for the run it was signed for and with every field as signed;
the decoder takes any bytes and raises only `ProtocolError` (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import encode
from protocol.credit import MAX_CREDIT_BYTES, MAX_RATE, Credit, open_credit, sign_credit
from protocol.errors import ProtocolError
from protocol.identity import NodeKey

KEY = NodeKey.generate()


def test_a_credit_opens_for_its_run_with_every_field_as_signed() -> None:
    data = sign_credit(KEY, run="r1", peer="12D3KooWx", stage=1, rate=250.5, issued_at=1e9)
    assert len(data) <= MAX_CREDIT_BYTES
    got = open_credit(data, "r1")
    assert (got.peer, got.stage, got.rate, got.issued_at, got.key) == (
        "12D3KooWx",
        1,
        250.5,
        1e9,
        KEY.public_key,
    )
    with pytest.raises(ProtocolError, match="signature"):
        open_credit(data, "r2")  # another run's
    for field, value in (("rate", 1e6), ("peer", "12D3KooWy"), ("stage", 0), ("issued_at", 2e9)):
        forged = Credit(**{**{f: getattr(got, f) for f in Credit.__dataclass_fields__},
                           field: value})  # fmt: skip
        with pytest.raises(ProtocolError, match="signature"):
            open_credit(encode(forged), "r1")
    # a member's own key signs a credit that opens: whose key counts is the reader's call
    mine = NodeKey.generate()
    assert open_credit(sign_credit(mine, run="r1", peer="p", stage=0, rate=1.0,
                                   issued_at=1.0), "r1").key == mine.public_key  # fmt: skip


def test_rates_are_finite_and_bounded() -> None:
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError):
            sign_credit(KEY, run="r", peer="p", stage=0, rate=bad, issued_at=1.0)
    big = sign_credit(KEY, run="r", peer="p", stage=0, rate=1e300, issued_at=1.0)
    assert open_credit(big, "r").rate == MAX_RATE


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=MAX_CREDIT_BYTES + 8))
def test_any_bytes_open_or_raise_protocol_error(data: bytes) -> None:
    try:
        open_credit(data, "r")
    except ProtocolError:
        pass


@settings(max_examples=100, deadline=None)
@given(
    rate=st.floats(0.0, MAX_RATE), stage=st.integers(0, 64), at=st.floats(0.0, 4e9),
    flip=st.integers(0, 10**6),
)  # fmt: skip
def test_a_flipped_byte_never_opens_as_another_credit(
    rate: float, stage: int, at: float, flip: int
) -> None:
    data = bytearray(sign_credit(KEY, run="r", peer="12D3KooWz", stage=stage, rate=rate,
                                 issued_at=at))  # fmt: skip
    i = flip % len(data)
    data[i] ^= 1 + flip % 255
    try:
        got = open_credit(bytes(data), "r")
    except ProtocolError:
        return
    # only a change the signature does not cover (none today but the encoding's own) opens
    assert (got.peer, got.stage, got.rate, got.issued_at) == ("12D3KooWz", stage, rate, at)
