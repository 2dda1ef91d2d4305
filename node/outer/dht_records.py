"""Owned DHT records: every record in a stage's hivemind DHT belongs to the peer its
subkey names, carries that peer's ed25519 signature, and is kept or believed only while
the peer is, or lately was, a listed member of the stage.

The outer loop stores three kinds of record, each with subkey = the storing peer's id:
matchmaking declarations (`<prefix>.0b`, True while the peer looks for a group), state
sharing priorities (`<prefix>.all_averagers`) and announced addresses (`<prefix>.addrs`).
A DHT keeps, per subkey, the record with the latest expiration. Unsigned, anyone who could
reach a replica's DHT could store under a member's subkey, and a later expiration would
replace the member's own record: a stranger marking every member "not looking for a
group" keeps every group from forming.

`MemberRecords` is the DHT's record validator (hivemind's `RecordValidatorBase`
interface, duck-typed so this module loads without hivemind). hivemind signs each record
its own node stores with it (`sign_value`) and checks every record a peer asks it to
store or returns to its reads (`validate`): a record whose owner is not an ed25519 peer,
whose signature does not verify, or whose expiration lies more than `MAX_RECORD_AHEAD_S`
ahead is refused (only that record of an answer or a store of several:
`keep_valid_entries`), and so is one under a key of this replica's stage (`guarded`, by
DHT id) whose owner is not admitted. The run's stages share one DHT, so a replica also
holds other stages' records: those need a valid owner signature only, and their own
stage's replicas check membership when they read them. Admitted: the members the
coordinator listed to the replica (`admit`), each for `GRACE_S` after it was last
listed, longer than any record it stored while listed can live, so a departed member's
records expire before it stops being believed. Until the first list arrives (it comes
with the state the outer process starts from, fetched or set, and with every round)
every correctly signed record is taken.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar, Protocol

import msgpack

from node.outer.settings import MAX_RECORD_AHEAD_S
from protocol.errors import ProtocolError
from protocol.identity import SIGNATURE_SIZE, NodeKey, peer_id_from_public_key, verify_signature

log = logging.getLogger(__name__)

DOMAIN = b"agora/dht-record/v1"  # what a record signature covers starts with this
# a member stays admitted this long after the last list that named it (s): its records
# (at most MAX_RECORD_AHEAD_S ahead when stored) expire first, with a minute for clocks
GRACE_S = MAX_RECORD_AHEAD_S + 60.0
MAX_ADMITTED = 65536  # peers remembered as admitted; past it the oldest are forgotten
# a subkey is hivemind's msgpack of `PeerID.to_bytes()`: bin8 of 38 bytes, an identity
# multihash (0x00, 36) of the protobuf PublicKey{Type: Ed25519, Data: 32 bytes}
_SUBKEY_HEAD = b"\xc4\x26" + b"\x00\x24" + b"\x08\x01\x12\x20"
SUBKEY_SIZE = len(_SUBKEY_HEAD) + 32  # bytes


class Record(Protocol):
    """hivemind's `DHTRecord` (a frozen dataclass), as this module reads it."""

    key: Any  # bytes: the key's DHT id
    subkey: Any  # bytes: the serialised subkey
    value: Any  # bytes: the serialised value, signed or not
    expiration_time: Any  # float: DHT time (s)


def owner_public_key(subkey: bytes) -> bytes | None:
    """The ed25519 public key of the peer a record's subkey names; None for any other
    subkey (no subkey, another key type, anything else)."""
    if len(subkey) != SUBKEY_SIZE or not subkey.startswith(_SUBKEY_HEAD):
        return None
    return subkey[len(_SUBKEY_HEAD) :]


def owner_peer_id(subkey: bytes) -> str | None:
    """The base58 peer id a record's subkey names (None as in `owner_public_key`)."""
    public_key = owner_public_key(subkey)
    return None if public_key is None else peer_id_from_public_key(public_key)


def signed_bytes(record: Record) -> bytes:
    """What the owner signs: the domain, the key's DHT id, the subkey, the value as the
    application stored it, and the expiration time."""
    fields = [DOMAIN, record.key, record.subkey, record.value, float(record.expiration_time)]
    return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]


class MemberRecords:
    """hivemind record validator: records owned and signed by their owner, and under the
    `guarded` keys (DHT ids; None: every key) by admitted members only (see the module
    docstring). `key`: this replica's own key, which signs what it stores."""

    # the validator of this process; the DHT process is forked from the one that built
    # it, so there it is the DHT's own copy, which `admit_members` updates
    live: ClassVar[MemberRecords | None] = None

    def __init__(self, key: NodeKey, guarded: Iterable[bytes] | None = None) -> None:
        self._key = key
        self._guarded = None if guarded is None else frozenset(guarded)
        self._own_subkey = _SUBKEY_HEAD + key.public_key
        self._own_peer = key.peer_id  # admitted always: the coordinator's list may lag
        self._listed: dict[str, float] | None = None  # peer id -> monotonic time last listed
        self.refused = 0  # records refused so far
        self.reported = 0  # of them, those `_admit` has reported
        MemberRecords.live = self

    def admit(self, members: Iterable[str], now: float | None = None) -> None:
        """The stage's members as the coordinator lists them now (base58 peer ids)."""
        now = time.monotonic() if now is None else now
        listed = {} if self._listed is None else self._listed
        for peer in members:
            listed[peer] = now
        for peer in [p for p, t in listed.items() if now - t > GRACE_S]:
            del listed[peer]
        while len(listed) > MAX_ADMITTED:
            del listed[min(listed, key=listed.__getitem__)]
        self._listed = listed

    def admits(self, peer: str, now: float | None = None) -> bool:
        if self._listed is None or peer == self._own_peer:
            return True
        seen = self._listed.get(peer)
        now = time.monotonic() if now is None else now
        return seen is not None and now - seen <= GRACE_S

    def validate(self, record: Record) -> bool:
        ok = self._valid(record)
        if not ok:
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # 1st, 2nd, 4th, ...: not a flood
                owner = owner_peer_id(record.subkey) if isinstance(record.subkey, bytes) else None
                log.info("DHT record refused (owner %s; %d so far)", owner, self.refused)
        return ok

    def _valid(self, record: Record) -> bool:
        if not all(isinstance(b, bytes) for b in (record.key, record.subkey, record.value)):
            return False
        public_key = owner_public_key(record.subkey)
        if public_key is None or len(record.value) < SIGNATURE_SIZE:
            return False
        expiration = record.expiration_time
        if not isinstance(expiration, float | int) or isinstance(expiration, bool):
            return False  # numpy's float64 is a float
        if not math.isfinite(expiration):
            return False
        if expiration > time.time() + MAX_RECORD_AHEAD_S:
            return False
        guarded = self._guarded is None or record.key in self._guarded
        if guarded and not self.admits(peer_id_from_public_key(public_key)):
            return False
        stripped = dataclasses.replace(record, value=record.value[:-SIGNATURE_SIZE])  # type: ignore[type-var]
        try:
            verify_signature(public_key, record.value[-SIGNATURE_SIZE:], signed_bytes(stripped))
        except ProtocolError:
            return False
        return True

    def sign_value(self, record: Record) -> bytes:
        """Our own records get our signature; a record under another peer's subkey is
        left unsigned (no peer of ours would take it)."""
        if record.subkey != self._own_subkey:
            return record.value  # type: ignore[no-any-return]
        return record.value + self._key.sign(signed_bytes(record))  # type: ignore[no-any-return]

    def strip_value(self, record: Record) -> bytes:
        """The value without its signature (hivemind calls this only on validated
        records and on our own storage, which holds only validated ones)."""
        return record.value[:-SIGNATURE_SIZE]  # type: ignore[no-any-return]

    @property
    def priority(self) -> int:
        return 10  # before any validator that reads the value (hivemind's convention)

    def merge_with(self, other: Any) -> bool:
        return isinstance(other, MemberRecords)  # one per DHT


def keep_valid_entries() -> None:
    """Make hivemind's `DHTProtocol` drop the records of a dictionary value that fail
    validation and keep the rest, where it drops the whole dictionary.
    Stock hivemind refuses every record a peer returns for a key when one of them fails:
    a stranger's record (of a peer not yet listed, or a forgery the answering node
    kept because its own list had not arrived) hid every member's record in that answer.
    Only refusals change: a dictionary that validates is kept as it was. Call it in the
    process that builds the DHT, before it does (the DHT process is forked from it)."""
    # imported here: the rest of this module loads without hivemind
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.validation import DHTRecord

    def _validate_dictionary(self: Any, key_bytes: bytes, dictionary: Any) -> bool:
        if self.record_validator is None:
            return True
        with dictionary.freeze():
            bad = [
                subkey
                for subkey, (value, expiration) in dictionary.items()
                if not self.record_validator.validate(
                    DHTRecord(key_bytes, self.serializer.dumps(subkey), value, expiration)
                )
            ]
            for subkey in bad:
                del dictionary[subkey]
            if bad:  # the dictionary's newest expiration was perhaps a refused record's
                left = [e for _subkey, (_value, e) in dictionary.items()]
                dictionary.latest_expiration_time = max(left, default=float("-inf"))
        return True

    DHTProtocol._validate_dictionary = _validate_dictionary


async def _admit(_dht: Any, _node: Any, members: list[str]) -> int:
    """Runs in the DHT process (`DHT.run_coroutine`); the records refused since the
    last call."""
    live = MemberRecords.live
    if live is None:
        raise RuntimeError("this DHT process has no MemberRecords validator")
    live.admit(members)
    new, live.reported = live.refused - live.reported, live.refused
    return new


def admit_members(dht: Any, members: Iterable[str], timeout: float = 5.0) -> int | None:
    """Tell `dht`'s process (a hivemind DHT built with a `MemberRecords`) the stage's
    members now; returns the records its validator refused since the last call, None
    (logged) when the DHT process did not answer within `timeout` seconds: it keeps its
    last list, and the round goes on."""
    future = dht.run_coroutine(partial(_admit, members=list(members)), return_future=True)
    try:
        return int(future.result(timeout=timeout))
    except Exception as exc:
        log.warning("could not pass the member list to the DHT within %ss: %r", timeout, exc)
        return None
