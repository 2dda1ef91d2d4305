"""The contract between the stage process and the outer-loop process: round trips of every
command and reply, strict decoding, hypothesis fuzzing (random bytes, mutated frames and
random maps fed to every decoder only ever raise ProtocolError), and `OuterLink`'s side of
it against a scripted outer process (no hivemind)."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.outer import contract as c
from node.outer.contract_fields import MAX_TEXT
from node.outer.settings import MAX_RECORD_AHEAD_S
from node.outer_link import OuterLink, OuterLinkError, _create_private
from protocol.codec import packb
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame
from protocol.identity import NodeKey

REPO = Path(__file__).resolve().parent.parent

CONFIG = c.OuterConfig(
    compression="uint8",
    matchmaking_s=2.0,
    request_timeout_s=0.5,
    round_timeout_s=4.0,
    target_group_size=3,
    host="0.0.0.0",
    port=4242,
    announce=["/ip4/203.0.113.9/tcp/4243"],
    startup_timeout_s=30.0,
    state_timeout_s=10.0,
    diloco=c.DilocoConfig(eta=0.5, mu=0.5, target_tokens=400, clip_radius=0.1, clip_iters=5),
)
KEY = NodeKey.generate()
COMMANDS: list[c.Command] = [
    c.Init(
        run_id="r1",
        stage=2,
        numel=4096,
        initial_peers=["/ip4/127.0.0.1/tcp/1/p2p/Qm"],
        snap="/dev/shm/a-snap",
        result="/dev/shm/a-result",
        momentum="/dev/shm/a-m",
        config=CONFIG,
    ),
    c.SetState(round=5, momentum=True),
    c.SetState(),
    c.Fetch(timeout_s=15.0),
    c.Fetch(timeout_s=5.0, attested=(3, "00ff")),
    c.Begin(tokens=100),
    c.Begin(tokens=7, attested=(0, "ab")),
    c.Begin(tokens=0, target_tokens=400),
    c.Stop(),
    c.Peek(),
    c.Init(
        run_id="r2",
        stage=0,
        numel=8,
        initial_peers=[],
        snap="/dev/shm/b-snap",
        result="/dev/shm/b-result",
        momentum="/dev/shm/b-m",
        config=CONFIG,
        identity=KEY.libp2p_private_key(),
    ),
    c.Begin(tokens=3, members=[KEY.peer_id, "QmOther"]),
    c.Begin(tokens=3, members=[]),
    c.Fetch(timeout_s=5.0, members=[KEY.peer_id, "QmOther"]),
    c.Begin(tokens=3, credit=b"\x81\xa1t\xa6credit"),
    c.SetState(round=2, members=[KEY.peer_id, "QmOther"]),
]
REPLIES: list[c.Reply] = [
    c.Ready(addrs=["/ip4/127.0.0.1/tcp/5/p2p/Qm"], peer_id="QmPeer"),
    c.StateSet(round=5, digest="0123456789abcdef"),
    c.StateFetched(ok=False, round=-1, digest=""),
    c.StateFetched(ok=True, round=3, digest="0123456789abcdef"),
    c.RoundResult(
        round=1,
        applied=True,
        contributed=True,
        rebased=False,
        group_size=2,
        tokens=400,
        eta_r=0.7,
        bytes_out=8192,
        bytes_in=8192,
        raw_bytes=16384,
        seconds=1.25,
        rejected={"QmOther": "norm 3.0 above 1.0 x ||theta_g||"},
        digest="0123456789abcdef",
        lineage=[(0, "00"), (1, "0123456789abcdef")],
        agreed=(0, "00"),
        accused={"QmOther": "part 1: non-finite values"},
        records_refused=3,
    ),
    c.RoundFailed(error="no state: call set_state or fetch_state first"),
    c.Fatal(error="RuntimeError: boom"),
    c.Peeked(waiting=1),
]
SAMPLES: list[c.Command | c.Reply] = [*COMMANDS, *REPLIES]
DECODERS = [c.decode_command, c.decode_reply]
CLASSES: list[Any] = [*c.COMMANDS.values(), *c.REPLIES.values(), c.OuterConfig, c.DilocoConfig]


def _decode_frames(data: bytes) -> list[bytes]:
    return FrameDecoder(max_frame=c.MAX_CONTROL_FRAME).feed(data)


@pytest.mark.parametrize("msg", COMMANDS, ids=lambda m: type(m).__name__)
def test_every_command_round_trips_through_a_frame(msg: c.Command) -> None:
    (payload,) = _decode_frames(c.encode(msg))
    assert c.decode_command(payload) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_every_reply_round_trips_through_a_frame(msg: c.Reply) -> None:
    (payload,) = _decode_frames(c.encode(msg))
    assert c.decode_reply(payload) == msg


def test_config_round_trips_and_missing_keys_take_defaults() -> None:
    assert c.OuterConfig.from_wire(CONFIG.to_wire()) == CONFIG
    assert c.OuterConfig.from_wire({}) == c.OuterConfig()
    got = c.OuterConfig.from_wire({"port": 7, "diloco": {"eta": 1}})
    assert got.port == 7 and got.diloco.eta == 1.0 and isinstance(got.diloco.eta, float)


def test_state_downloads_and_rounds_get_their_bytes_at_the_slowest_rate_on_top() -> None:
    cfg = c.OuterConfig(state_timeout_s=10.0, min_rate_mb_s=2.0)
    assert cfg.transfer_s(75_000_000) == 300.0  # 600 MB of theta_g and m
    assert cfg.transfer_s(1000) < 0.01  # a test-sized stage: the timeout alone
    # a round's exchange: 2 fp16 stages each way, or one uint8 stage per other member
    assert cfg.exchange_s(1_000_000) == 2.0
    wide = c.OuterConfig(
        averaging="all_gather", compression="uint8", target_group_size=8, min_rate_mb_s=2.0
    )
    assert wide.exchange_s(1_000_000) == 3.5
    with pytest.raises(ProtocolError, match="min_rate_mb_s"):
        c.OuterConfig.from_wire({"min_rate_mb_s": 0.0})


@pytest.mark.parametrize(
    "announce", ["/ip4/1.2.3.4/tcp/1", ["/ip4/0.0.0.0/tcp/1"], [7], ["/ip4/1.2.3.4/tcp/1"] * 9]
)
def test_config_refuses_announced_addresses_nobody_can_dial(announce: object) -> None:
    with pytest.raises(ProtocolError, match="announce|list|strings"):
        c.OuterConfig.from_wire({"port": 7, "announce": announce})


def test_the_commands_and_replies_are_told_apart() -> None:
    payload = packb(c.Stop().to_wire())
    assert c.decode_command(payload) == c.Stop()
    with pytest.raises(ProtocolError, match="unknown reply"):
        c.decode_reply(payload)
    with pytest.raises(ProtocolError, match="unknown command"):
        c.decode_command(packb(REPLIES[0].to_wire()))


def _with(msg: Any, **changes: Any) -> dict[str, Any]:
    wire: dict[str, Any] = msg.to_wire()
    wire.update(changes)
    return wire


@pytest.mark.parametrize(
    ("cls", "wire"),
    [
        (c.Init, _with(COMMANDS[0], stage=-1)),
        (c.Init, _with(COMMANDS[0], stage=True)),
        (c.Init, _with(COMMANDS[0], numel=0)),
        (c.Init, _with(COMMANDS[0], run_id="")),
        (c.Init, _with(COMMANDS[0], run_id="x" * 129)),
        (c.Init, _with(COMMANDS[0], snap="relative/path")),
        (c.Init, _with(COMMANDS[0], result="/dev/shm/a-snap")),
        (c.Init, _with(COMMANDS[0], initial_peers=["/ip4/x"] * (c.MAX_PEERS + 1))),
        (c.Init, _with(COMMANDS[0], initial_peers="/ip4/x")),
        (c.Init, _with(COMMANDS[0], config={"compression": "zstd"})),
        (c.Init, _with(COMMANDS[0], config={"diloco": {"mu": 1.0}})),
        (c.Init, _with(COMMANDS[0], config={"diloco": {"eta": float("nan")}})),
        (c.Init, _with(COMMANDS[0], config={"bogus": 1})),
        (c.Init, _with(COMMANDS[0], config=[])),
        (c.Init, _with(COMMANDS[0], identity="key")),
        (c.Init, _with(COMMANDS[0], identity=b"\x08\x01\x12\x40" + b"k" * 63)),
        (c.Init, _with(COMMANDS[0], identity=b"\x08\x00\x12\x40" + b"k" * 64)),
        (c.Begin, _with(COMMANDS[4], members=[KEY.peer_id] * (c.MAX_PEERS + 1))),
        (c.Begin, _with(COMMANDS[4], members=[""])),
        (c.Begin, _with(COMMANDS[4], members=None)),
        (c.SetState, _with(COMMANDS[1], round=-1)),
        (c.SetState, _with(COMMANDS[1], momentum=1)),
        (c.SetState, _with(COMMANDS[1], members=[""])),
        (c.SetState, _with(COMMANDS[1], members=None)),
        (c.SetState, _with(COMMANDS[1], members=[KEY.peer_id] * (c.MAX_PEERS + 1))),
        (c.Fetch, _with(COMMANDS[3], timeout_s=0)),
        (c.Fetch, _with(COMMANDS[3], members=[""])),
        (c.Fetch, _with(COMMANDS[3], members=None)),
        (c.Fetch, _with(COMMANDS[3], members=[KEY.peer_id] * (c.MAX_PEERS + 1))),
        (c.Fetch, _with(COMMANDS[3], timeout_s=float("inf"))),
        (c.Fetch, _with(COMMANDS[3], timeout_s=10**400)),
        (c.Begin, _with(COMMANDS[4], tokens=10**30)),
        (c.DilocoConfig, {"eta": 10**400}),
        (c.OuterConfig, {"target_group_size": 10**400}),
        (c.Begin, _with(COMMANDS[4], tokens=-1)),
        (c.Begin, _with(COMMANDS[4], target_tokens=None)),
        (c.Begin, {"op": "begin"}),
        (c.Begin, _with(COMMANDS[4], credit="text")),
        (c.Begin, _with(COMMANDS[4], credit=b"x" * 513)),
        (c.Stop, {"op": "stop", "extra": 1}),
        (c.Stop, {"op": "begin"}),
        (c.Peek, {"op": "peek", "waiting": 1}),
        (c.Peeked, {"op": "peeked", "waiting": -1}),
        (c.Peeked, {"op": "peeked", "waiting": True}),
        (c.StateFetched, _with(REPLIES[2], round=-2)),
        (c.StateSet, _with(REPLIES[1], digest="x" * 65)),
        (c.RoundResult, _with(REPLIES[4], group_size=0)),
        (c.RoundResult, _with(REPLIES[4], rejected={"a": 1})),
        (c.RoundResult, _with(REPLIES[4], rejected=[])),
        (c.RoundResult, _with(REPLIES[4], seconds=-1.0)),
        (c.RoundResult, _with(REPLIES[4], agreed=[[1, "ab"], [2, "cd"]])),
        (c.RoundResult, _with(REPLIES[4], agreed=[[1, "AB"]])),
        (c.RoundResult, _with(REPLIES[4], agreed=None)),
        (c.RoundResult, _with(REPLIES[4], accused={"a": None})),
        (c.RoundResult, _with(REPLIES[4], accused={"a": "x" * (MAX_TEXT + 1)})),
        (c.RoundResult, _with(REPLIES[4], accused=[["a", "b"]])),
        (c.Fatal, _with(REPLIES[6], error=b"bytes")),
    ],
)
def test_malformed_maps_raise_protocol_error(cls: Any, wire: Any) -> None:
    with pytest.raises(ProtocolError):
        cls.from_wire(wire)


def test_the_sender_checks_what_it_sends() -> None:
    with pytest.raises(ProtocolError):
        c.encode(c.SetState(round=-1))
    with pytest.raises(ProtocolError):
        c.encode(c.Fetch(timeout_s=0.0))
    for bad in [(-1, "ab"), (1, "AB"), (1, ""), (1, "x" * 65)]:
        with pytest.raises(ProtocolError):
            c.encode(c.Begin(tokens=1, attested=bad))


def test_long_errors_are_clipped_on_the_wire() -> None:
    (payload,) = _decode_frames(c.encode(c.Fatal(error="x" * (3 * c.MAX_TEXT))))
    got = c.decode_reply(payload)
    assert isinstance(got, c.Fatal) and len(got.error) == c.MAX_TEXT


# --- hypothesis ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(data)
        except ProtocolError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_frames_only_raise_protocol_error(msg: Any, data: st.DataObject) -> None:
    raw = bytearray(packb(msg.to_wire()))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(("flip", "cut", "insert")))
        i = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[i:]
        else:
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    for decode in DECODERS:
        try:
            decode(bytes(raw))
        except ProtocolError:
            pass


def _keys_of(cls: Any) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls)]


ALL_KEYS = sorted({k for cls in CLASSES for k in _keys_of(cls)} | {"op", "bogus"})
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from([*c.COMMANDS, *c.REPLIES, "/dev/shm/x", "fp16", ""])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(CLASSES),
    st.dictionaries(st.sampled_from(ALL_KEYS) | st.text(max_size=6), VALUES, max_size=14),
    st.booleans(),
)
def test_random_maps_only_raise_protocol_error(cls: Any, fields: dict[str, Any], tag: bool) -> None:
    obj: Any = dict(fields)
    if tag and hasattr(cls, "OP"):
        obj["op"] = cls.OP  # get past the tag check to the field checks
    for target in (lambda: cls.from_wire(obj), lambda: c.decode_command(packb(obj))):
        try:
            target()
        except ProtocolError:
            pass
    try:
        c.decode_reply(packb(obj))
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_one_bad_field_in_a_valid_message_only_raises_protocol_error(
    msg: Any, data: st.DataObject
) -> None:
    wire = msg.to_wire()
    key = data.draw(st.sampled_from(sorted(wire)))
    wire[key] = data.draw(VALUES)
    try:
        got = type(msg).from_wire(wire)
    except ProtocolError:
        return
    assert isinstance(got, type(msg))


# --- the contract stays light --------------------------------------------------------------


def test_the_contract_loads_neither_torch_nor_hivemind_nor_libp2p() -> None:
    code = (
        "import sys, node.outer.contract\n"
        "bad = {m.split('.')[0] for m in sys.modules} & {'torch', 'hivemind', 'libp2p'}\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)


def test_the_outer_package_never_imports_the_stage_side_link() -> None:
    for f in sorted((REPO / "node" / "outer").rglob("*.py")):
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("node.outer_link") for n in names), f


# --- the link's side, against a scripted outer process ----------------------------------


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[OuterLink, socket.socket]]:
    """An `OuterLink` whose "outer process" is the test: replies go through `peer`."""
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    paths = [tmp_path / name for name in ("snap", "result", "m")]
    for path in paths:
        path.write_bytes(bytes(4 * 8))
    # a stand-in for the outer process's pid: it waits on its stdin, which teardown closes
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    link = OuterLink(proc, ours, *paths, numel=8)
    yield link, peer
    assert proc.stdin is not None
    proc.stdin.close()
    proc.kill()
    link.close(timeout=5.0)
    peer.close()


def _commands(peer: socket.socket) -> list[c.Command]:
    peer.settimeout(5.0)
    return [c.decode_command(p) for p in _decode_frames(peer.recv(1 << 16))]


def test_the_link_sends_typed_commands_and_reads_typed_replies(
    scripted: tuple[OuterLink, socket.socket],
) -> None:
    link, peer = scripted
    link.begin_round([torch.ones(8)], 100, target_tokens=400)
    assert _commands(peer) == [c.Begin(tokens=100, target_tokens=400)]
    assert link.poll_result() is None
    result = REPLIES[4]
    assert isinstance(result, c.RoundResult)
    peer.sendall(c.encode(result))
    assert link.wait_result(5.0) == result and link.round == 1 and link.digest == result.digest
    assert torch.equal(link._snap, torch.ones(8))


def test_a_failed_round_a_fatal_reply_and_garbage_become_outer_link_errors(
    scripted: tuple[OuterLink, socket.socket],
) -> None:
    link, peer = scripted
    link.begin_round([torch.ones(8)], 1)
    peer.sendall(c.encode(c.RoundFailed(error="no state")))
    with pytest.raises(OuterLinkError, match="no state"):
        link.wait_result(5.0)
    link.begin_round([torch.ones(8)], 1)
    peer.sendall(c.encode(c.Fatal(error="boom")))
    with pytest.raises(OuterLinkError, match="boom"):
        link.wait_result(5.0)
    peer.sendall(frame(packb({"op": "result", "round": "one"})))
    with pytest.raises(OuterLinkError, match="malformed"):
        link._pump(5.0)


def test_arguments_the_contract_cannot_carry_are_value_errors(
    scripted: tuple[OuterLink, socket.socket],
) -> None:
    link, _ = scripted
    with pytest.raises(ValueError):
        link.fetch_state(timeout=1e9)
    with pytest.raises(ValueError):
        link.begin_round([torch.ones(8)], 2**63)


def test_shared_memory_files_are_private_and_never_an_existing_name(tmp_path: Path) -> None:
    path = tmp_path / "seg"
    _create_private(path, 4096)
    assert path.stat().st_size == 4096 and path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        _create_private(path, 16)  # someone else's file under the name
    (tmp_path / "link").symlink_to(tmp_path / "target")
    with pytest.raises(OSError):
        _create_private(tmp_path / "link", 16)  # a planted link is not followed
    assert not (tmp_path / "target").exists()


def test_a_matchmaking_window_that_outlives_the_dht_record_bound_is_refused() -> None:
    """A matchmaking declaration lives about twice the window; peers refuse DHT records
    that expire more than MAX_RECORD_AHEAD_S ahead (node.outer.dht_records)."""
    c.OuterConfig(matchmaking_s=MAX_RECORD_AHEAD_S / 2 - 1.0)
    with pytest.raises(ValueError, match="matchmaking_s"):
        c.OuterConfig(matchmaking_s=MAX_RECORD_AHEAD_S / 2)
