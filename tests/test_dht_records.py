"""Owned DHT records (`node.outer.dht_records`): a record is kept and believed only when
the peer its subkey names signed it and is an admitted member; the validator never
raises, whatever the bytes (hypothesis). The wire test runs real hivemind DHTs (p2p
daemons on loopback) in a fresh interpreter, as hivemind cannot share the pytest
process with py-libp2p: a stranger's forged declaration under a member's subkey replaces
the member's own without the validator and is refused on store and on read with it."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from node.outer.dht_records import GRACE_S, MemberRecords, owner_peer_id, signed_bytes
from node.outer.settings import MAX_RECORD_AHEAD_S
from protocol.identity import NodeKey

KEY = b"\x11" * 20  # a key's DHT id (hivemind: 20 bytes)


@dataclasses.dataclass(frozen=True)
class Rec:
    """hivemind's `DHTRecord`, field for field."""

    key: bytes
    subkey: bytes
    value: bytes
    expiration_time: float


def subkey(k: NodeKey) -> bytes:
    """hivemind's subkey for a peer: the msgpack of `PeerID.to_bytes()`."""
    return msgpack.packb(b"\x00\x24\x08\x01\x12\x20" + k.public_key, use_bin_type=True)


def test_a_record_signed_by_its_owner_validates_and_strips_back_to_its_value() -> None:
    me = NodeKey.generate()
    v = MemberRecords(me)
    rec = fresh(v, me)
    assert owner_peer_id(rec.subkey) == me.peer_id
    assert v.validate(rec)
    assert v.strip_value(rec) == b"\xc3"
    # any field changed after signing breaks the signature
    for field, new in (("key", b"\x12" * 20), ("value", b"\xc2" + rec.value[1:]),
                       ("expiration_time", rec.expiration_time + 1.0)):  # fmt: skip
        assert not v.validate(dataclasses.replace(rec, **{field: new})), field


def test_a_record_under_another_peers_subkey_is_never_signed_and_never_valid() -> None:
    me, victim = NodeKey.generate(), NodeKey.generate()
    v = MemberRecords(me)
    rec = Rec(KEY, subkey(victim), b"\xc2", _now() + 10.0)
    assert v.sign_value(rec) == rec.value  # not ours: left unsigned
    assert not v.validate(rec)
    # signed with the wrong key (ours) over the victim's subkey
    forged = dataclasses.replace(rec, value=rec.value + me.sign(signed_bytes(rec)))
    assert not v.validate(forged)
    assert v.validate(fresh(MemberRecords(victim), victim))  # the victim's own is fine


def test_malformed_records_are_refused() -> None:
    me = NodeKey.generate()
    v = MemberRecords(me)
    good = fresh(v, me)
    assert v.validate(good)
    bad = [
        dataclasses.replace(good, subkey=b"\xc0"),  # no subkey (a regular value)
        dataclasses.replace(good, subkey=good.subkey[:-1]),  # not an ed25519 peer id
        dataclasses.replace(good, value=b"\x00" * 10),  # shorter than a signature
        dataclasses.replace(good, expiration_time=math.nan),
        dataclasses.replace(good, expiration_time=math.inf),
        dataclasses.replace(good, expiration_time=True),  # type: ignore[arg-type]
    ]
    assert not any(v.validate(r) for r in bad)
    far = _now() + MAX_RECORD_AHEAD_S + 60.0  # signed, but claims to live too long
    assert not v.validate(fresh(v, me, expiration=far))
    assert v.refused == len(bad) + 1


def test_only_admitted_members_records_are_taken_and_a_departed_one_for_a_grace() -> None:
    me, member, stranger = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    v = MemberRecords(me)
    recs = {k.peer_id: fresh(MemberRecords(k), k) for k in (me, member, stranger)}
    assert all(v.validate(r) for r in recs.values())  # no list yet: any signed record
    t0 = time.monotonic()
    v.admit([member.peer_id], now=t0)
    assert v.validate(recs[member.peer_id]) and v.validate(recs[me.peer_id])
    assert not v.validate(recs[stranger.peer_id])
    # the member leaves the list: believed for a grace that outlives its records
    assert GRACE_S > MAX_RECORD_AHEAD_S
    v.admit([], now=t0 + GRACE_S - 1.0)
    assert v.admits(member.peer_id, now=t0 + GRACE_S - 1.0)
    v.admit([], now=t0 + GRACE_S + 1.0)
    assert not v.admits(member.peer_id, now=t0 + GRACE_S + 1.0)
    assert v.admits(me.peer_id, now=t0 + GRACE_S + 1.0)  # our own, always


@settings(max_examples=300, deadline=None)
@given(key=st.binary(max_size=40), sub=st.binary(max_size=48), value=st.binary(max_size=200),
       exp=st.one_of(st.floats(), st.integers(), st.none(), st.text(max_size=3)))  # fmt: skip
def test_validate_never_raises(key: bytes, sub: bytes, value: bytes, exp: object) -> None:
    v = MemberRecords(NodeKey(b"\x01" * 32))
    assert v.validate(Rec(key, sub, value, exp)) is False  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(value=st.binary(max_size=200), cut=st.integers(min_value=0, max_value=263))
def test_a_signed_record_cut_or_flipped_anywhere_is_refused(value: bytes, cut: int) -> None:
    me = NodeKey(b"\x02" * 32)
    v = MemberRecords(me)
    rec = fresh(v, me, value=value)
    assert v.validate(rec)
    i = cut % len(rec.value)
    flipped = rec.value[:i] + bytes([rec.value[i] ^ 0x01]) + rec.value[i + 1 :]
    assert not v.validate(dataclasses.replace(rec, value=flipped))
    assert not v.validate(dataclasses.replace(rec, value=rec.value[:i]))


def _now() -> float:
    return time.time()


def fresh(v: MemberRecords, owner: NodeKey, value: bytes = b"\xc3",
          expiration: float | None = None) -> Rec:  # fmt: skip
    rec = Rec(KEY, subkey(owner), value, _now() + 10.0 if expiration is None else expiration)
    return dataclasses.replace(rec, value=v.sign_value(rec))


WIRE_SCRIPT = """
import json, sys
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from node.outer.dht_records import MemberRecords, admit_members
from node.outer.lifecycle import identity_file
from protocol.identity import NodeKey

protect = sys.argv[1] == "1"
KEY = "agora-run-stage0.0b"

def start(key, peers, validate):
    validators = [MemberRecords(key)] if validate else []  # built before the DHT forks
    with identity_file(key.libp2p_private_key()) as path:
        return DHT(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                   identity_path=path, check_if_identity_free=False,
                   record_validators=validators, start=True, await_ready=True)

a, b, c, d = (NodeKey.generate() for _ in range(4))  # a, b members; c, d strangers
dht_a = start(a, [], protect)
peers = [str(m) for m in dht_a.get_visible_maddrs()]
dht_b = start(b, peers, protect)
dht_c = start(c, peers, False)  # stores whatever it likes, signs nothing
dht_d = start(d, peers, protect)  # signs its own records, but is no member
if protect:
    for dht in (dht_a, dht_b):
        admit_members(dht, [a.peer_id, b.peer_id])
now = get_dht_time()
pid = {k.peer_id: PeerID.from_base58(k.peer_id).to_bytes() for k in (a, b, c, d)}
ok = {
    "a": dht_a.store(KEY, subkey=pid[a.peer_id], value=True, expiration_time=now + 60),
    "b": dht_b.store(KEY, subkey=pid[b.peer_id], value=True, expiration_time=now + 60),
    # the forgery: a's subkey, "not looking", a later expiration than a's own
    "forged": dht_c.store(KEY, subkey=pid[a.peer_id], value=False, expiration_time=now + 120),
    "c": dht_c.store(KEY, subkey=pid[c.peer_id], value=True, expiration_time=now + 60),
    "d": dht_d.store(KEY, subkey=pid[d.peer_id], value=True, expiration_time=now + 60),
}
names = {v: k for k, v in zip("abcd", (pid[k.peer_id] for k in (a, b, c, d)))}
seen = {}
for name, dht in (("a", dht_a), ("b", dht_b)):
    found = dht.get(KEY, latest=True)
    seen[name] = {names.get(k, "?"): v.value for k, v in (found.value if found else {}).items()}
refused = [admit_members(dht, [a.peer_id, b.peer_id]) for dht in (dht_a, dht_b)] if protect else []
for dht in (dht_a, dht_b, dht_c, dht_d):
    dht.shutdown()
print(json.dumps({"stored": ok, "seen": seen, "refused": refused}))
"""


def run_wire(protect: bool) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", WIRE_SCRIPT, "1" if protect else "0"],
        capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_strangers_forged_declaration_takes_a_member_out_only_without_the_validator() -> None:
    """Four real DHTs: members a and b declare "looking for a group"; stranger c stores a
    forged "not looking" under a's subkey with a later expiration, and its own record;
    stranger d stores its own signed record. Without validators the forgery replaces a's
    declaration in both members' reads. With them, both members see exactly a and b
    looking, though c still holds its forgery (a read drops what c returns)."""
    open_run = run_wire(protect=False)
    for name in ("a", "b"):
        assert open_run["seen"][name]["a"] is False, open_run  # type: ignore[index]
        assert {"c", "d"} <= set(open_run["seen"][name]), open_run  # type: ignore[index]
    guarded = run_wire(protect=True)
    for name in ("a", "b"):
        assert guarded["seen"][name] == {"a": True, "b": True}, guarded  # type: ignore[index]
    stored = guarded["stored"]
    assert stored["a"] and stored["b"], guarded  # type: ignore[index]
    assert all(n >= 1 for n in guarded["refused"]), guarded  # type: ignore[union-attr]


def test_membership_binds_the_guarded_keys_only() -> None:
    """The run's stages share one DHT: records under another stage's keys need their
    owner's signature only (that stage's replicas check its members when they read)."""
    me, stranger = NodeKey.generate(), NodeKey.generate()
    v = MemberRecords(me, guarded=[KEY])
    v.admit([me.peer_id])
    theirs = fresh(MemberRecords(stranger), stranger)
    assert not v.validate(theirs)  # our stage's key: members only
    other = dataclasses.replace(theirs, key=b"\x22" * 20)  # another stage's key...
    assert not v.validate(other)  # ...signed over the old key: the signature breaks
    signer = MemberRecords(stranger)
    elsewhere = dataclasses.replace(
        other, value=signer.sign_value(dataclasses.replace(other, value=b"\xc3"))
    )
    assert v.validate(elsewhere)  # signed by its owner: kept


ENTRIES_SCRIPT = """
import json, types
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time
from node.outer.dht_records import MemberRecords, keep_valid_entries
from protocol.identity import NodeKey

KEY = b"\\x11" * 20
me, a, d = (NodeKey.generate() for _ in range(3))  # d signs its records but is no member
reader = MemberRecords(me)
reader.admit([me.peer_id, a.peer_id])
protocol = types.SimpleNamespace(
    record_validator=CompositeValidator([reader]), serializer=MSGPackSerializer)
now = get_dht_time()

def signed(owner, value, expiration):
    sub = PeerID.from_base58(owner.peer_id).to_bytes()
    rec = DHTRecord(KEY, MSGPackSerializer.dumps(sub), MSGPackSerializer.dumps(value), expiration)
    return sub, MemberRecords(owner).sign_value(rec)

def answer():  # what a node that holds d's record too returns for the key
    value = DictionaryDHTValue()
    for owner, expiration in ((a, now + 60), (d, now + 120)):
        sub, data = signed(owner, True, expiration)
        value.store(sub, data, expiration)
    return value

def check():
    value = answer()
    ok = DHTProtocol._validate_dictionary(protocol, KEY, value)
    owners = sorted(str(PeerID(sub)) for sub, _ in value.items()) if ok else []
    return {"ok": ok, "owners": owners, "latest": value.latest_expiration_time - now}

stock = check()
keep_valid_entries()
print(json.dumps({"stock": stock, "kept": check(), "a": a.peer_id}))
"""


def test_a_refused_record_costs_only_itself_in_a_dictionary_answer() -> None:
    """A node that holds a stranger's signed record beside a member's answers a read of
    the key with both. Stock hivemind refuses the whole answer when one record fails;
    after `keep_valid_entries` the reader keeps the member's record, and the answer's
    newest expiration is the member's, not the refused one's."""
    out = subprocess.run(
        [sys.executable, "-c", ENTRIES_SCRIPT],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["stock"]["ok"] is False, got
    assert got["kept"]["ok"] is True and got["kept"]["owners"] == [got["a"]], got
    assert math.isclose(got["kept"]["latest"], 60.0, abs_tol=1e-6), got
