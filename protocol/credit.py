"""Credits: the coordinator's signed word on how much work one member did.

A member's outer-loop contribution is weighted by the tokens it trained since its last
round, and those it states itself. The coordinator knows better: adjacent members report
the tokens of the micro-batches they completed with it (`coordinator.witness`). In each
heartbeat reply it hands a member a `Credit`, signed with the coordinator's credit key:
the tokens/s others witnessed for that member, when, and on which stage. The member
carries the encoded credit into its outer round's gathered metadata, where its groupmates
check it (`open_credit`) and bound its token claim by it (`node.outer.credit`). A member
cannot raise its own credit: it cannot sign one.
"""

from __future__ import annotations

import functools
import math
import struct

from protocol.codec import UnpackLimits, decode, encode
from protocol.errors import ProtocolError
from protocol.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, NodeKey, verify_signature
from protocol.message import Message, bounded, message
from protocol.signing import MAX_RUN_ID

MAX_CREDIT_BYTES = 512  # bytes of an encoded credit (about 200 today)
MAX_PEER_CHARS = 128  # characters of the peer id a credit names
MAX_RATE = 1e12  # tokens/s: the largest rate a credit may name (as a throughput claim)
_DOMAIN = b"agora/credit/v1\0"


@message("credit", version=1)
class Credit(Message):
    peer: str = bounded(min_len=1, max_len=MAX_PEER_CHARS)  # the member it is about
    stage: int = bounded(ge=0)  # the member's stage when it was issued
    rate: float = bounded(ge=0.0, le=MAX_RATE)  # tokens/s others witnessed for it
    issued_at: float = bounded(ge=0.0)  # unix seconds at signing
    key: bytes = bounded(min_len=PUBLIC_KEY_SIZE, max_len=PUBLIC_KEY_SIZE)  # the signer's
    sig: bytes = bounded(min_len=SIGNATURE_SIZE, max_len=SIGNATURE_SIZE)


def credit_bytes(run: str, peer: str, stage: int, rate: float, issued_at: float) -> bytes:
    """The bytes a credit's signature covers: the run, so a credit of one run is worth
    nothing in another, and every field but the signer's key."""
    scope, who = run.encode(), peer.encode()
    if len(scope) > MAX_RUN_ID or len(who) > MAX_PEER_CHARS:
        raise ProtocolError(f"run id ({len(scope)} bytes) or peer id ({len(who)}) too long")
    return (
        _DOMAIN + bytes([len(scope)]) + scope + bytes([len(who)]) + who
        + struct.pack(">Qdd", stage, rate, issued_at)
    )  # fmt: skip


def sign_credit(
    key: NodeKey, *, run: str, peer: str, stage: int, rate: float, issued_at: float
) -> bytes:
    """The encoded credit for `peer`, signed by `key` for `run`."""
    if not (math.isfinite(rate) and 0.0 <= rate):
        raise ValueError(f"rate must be finite and >= 0, got {rate}")
    rate = min(rate, MAX_RATE)
    sig = key.sign(credit_bytes(run, peer, stage, rate, issued_at))
    credit = Credit(
        peer=peer, stage=stage, rate=rate, issued_at=issued_at, key=key.public_key, sig=sig
    )
    return encode(credit)


@functools.lru_cache(maxsize=1)
def _limits() -> UnpackLimits:
    return UnpackLimits(
        max_str_len=MAX_PEER_CHARS, max_bin_len=SIGNATURE_SIZE, max_array_len=0, max_map_len=16
    )


def open_credit(data: bytes, run: str) -> Credit:
    """The credit `data` encodes, its signature checked against the key it names for
    `run`; `ProtocolError` for anything else. Whether that key is the coordinator's is
    the reader's to decide."""
    if len(data) > MAX_CREDIT_BYTES:
        raise ProtocolError(f"credit of {len(data)} bytes, above {MAX_CREDIT_BYTES}")
    credit = decode(data, max_size=MAX_CREDIT_BYTES, limits=_limits())
    if not isinstance(credit, Credit):
        raise ProtocolError(f"expected a credit, got {credit.TYPE!r}")
    signed = credit_bytes(run, credit.peer, credit.stage, credit.rate, credit.issued_at)
    verify_signature(credit.key, credit.sig, signed)
    return credit
