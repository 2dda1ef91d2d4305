"""Bad input and access control against a real coordinator process: garbage and
oversized frames, a connection flood, auth modes, admin token, replayed requests. After
each, an honest client is still served and the bad-frame counter moved."""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import trio
from coordinator_harness import write_config

from node.control_tls import connect
from node.coordinator_client import ClientConfig, CoordinatorClient, CoordinatorError
from protocol import control as c
from protocol.codec import decode
from protocol.framing import HEADER, FrameDecoder, frame, frame_message
from protocol.identity import NodeKey
from protocol.signing import NONCE_SIZE, SignedRequest, sign_request, signed_bytes
from swarmlab.coordinator import start_coordinator
from swarmlab.procs import wait_for

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=30.0)


def _raw(port: int, data: bytes) -> list[c.Message]:
    """Send bytes, read replies until the server closes or 3 s pass."""
    dec = FrameDecoder()
    out = []
    with connect("127.0.0.1", port, None, timeout_s=3) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                out += [decode(p) for p in dec.feed(chunk)]
        except TimeoutError:
            pass
    return out


def _honest(port: int, key: NodeKey, token: str = "", pin: str | None = None) -> c.StatusReply:
    async def go() -> c.StatusReply:
        async with CoordinatorClient("127.0.0.1", port, key, config=FAST, pin=pin) as cl:
            await cl.join(c.JoinRequest(join_token=token))
            await cl.heartbeat()
            return await cl.status()

    return trio.run(go)


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_bad_frames_flood_auth_admin_and_replay(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        auth="token",
        join_token="s3cret-join",
        admin_token="s3cret-admin",
        max_connections=40,
        idle_timeout_s=1.5,
    )
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", metrics=True)
    mport = coord.metrics_port
    key = NodeKey.generate()

    # garbage inside a frame: error reply, connection closed
    (reply,) = _raw(coord.port, b"\x00\x00\x00\x05hello")
    assert isinstance(reply, c.ErrorReply) and reply.code == "bad_frame"
    # a header claiming 4 GiB: refused before any allocation
    (reply,) = _raw(coord.port, b"\xff\xff\xff\xff" + b"x" * 100)
    assert isinstance(reply, c.ErrorReply) and reply.code == "bad_frame"
    # a valid frame that is not a signed request
    (reply,) = _raw(coord.port, frame_message(c.StatusRequest()))
    assert reply.code == "bad_frame"  # type: ignore[attr-defined]
    assert _metric(mport, "agora_coordinator_bad_frames_total") >= 3

    # wrong join token, then the right one
    with pytest.raises(CoordinatorError) as err:
        _honest(coord.port, key, token="wrong", pin=coord.fingerprint)
    assert err.value.code == "unauthorized"
    assert _honest(coord.port, key, token="s3cret-join", pin=coord.fingerprint).peers == 1

    # a flood of idle connections above the limit: refused or cut, honest client served
    flood = []
    for _ in range(120):
        try:
            flood.append(connect("127.0.0.1", coord.port, None, timeout_s=3))
        except OSError:
            break
    assert len(flood) >= 40
    t0 = time.monotonic()
    assert _honest(coord.port, key, token="s3cret-join", pin=coord.fingerprint).peers == 1
    assert time.monotonic() - t0 < 20
    for s in flood:
        s.close()
    assert _metric(mport, "agora_coordinator_rejected_connections_total") > 0

    # admin calls: refused without the token, accepted with it
    async def admin() -> None:
        async with CoordinatorClient(
            "127.0.0.1", coord.port, key, config=FAST, pin=coord.fingerprint
        ) as cl:
            with pytest.raises(CoordinatorError) as e:
                await cl.call(c.AdminPause(admin_token="nope", paused=True))
            assert e.value.code == "forbidden"
            with pytest.raises(CoordinatorError) as e:
                await cl.call(c.AdminBan(admin_token="", peer_id="x"))
            assert e.value.code == "forbidden"
            assert isinstance(
                await cl.call(c.AdminPause(admin_token="s3cret-admin", paused=True)), c.OkReply
            )
            assert (await cl.acquire_grant()).reason == "paused"
            assert (await cl.status()).paused

    trio.run(admin)

    # a replayed signed request is refused
    signed = frame_message(sign_request(key, c.StatusRequest(), now=time.time(), run=None))
    first, second = _raw(coord.port, signed + signed)
    assert isinstance(first, c.StatusReply)
    assert isinstance(second, c.ErrorReply) and second.code == "replay"
    # a request signed by another key is refused
    req = sign_request(key, c.StatusRequest(), now=time.time(), run=None)
    forged = type(req)(
        key=NodeKey.generate().public_key, ts=req.ts, nonce=req.nonce, body=req.body, sig=req.sig
    )
    forged_reply, unsigned_reply = _raw(
        coord.port, frame_message(forged) + frame_message(c.ErrorReply(code="x"))
    )
    assert forged_reply.code == "bad_signature"  # type: ignore[attr-defined]
    assert unsigned_reply.code == "bad_frame"  # type: ignore[attr-defined]

    assert "s3cret" not in coord.output()  # secrets never logged
    assert coord.stop() == 0


def test_allowlist_mode(tmp_path: Path) -> None:
    good, bad = NodeKey.generate(), NodeKey.generate()
    cfg = write_config(tmp_path, auth="allowlist", allowlist=[good.peer_id])
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    assert _honest(coord.port, good, pin=coord.fingerprint).peers == 1
    with pytest.raises(CoordinatorError) as err:
        _honest(coord.port, bad, pin=coord.fingerprint)
    assert err.value.code == "unauthorized"
    assert coord.stop() == 0


def test_a_join_or_heartbeat_with_a_bad_address_is_refused(tmp_path: Path) -> None:
    """Addresses are checked at the coordinator's edge: a bad one is refused with an
    error naming it, never stored or handed to other members."""
    coord = start_coordinator(tmp_path, config=write_config(tmp_path), db=tmp_path / "c.sqlite")
    key = NodeKey.generate()
    good = f"/ip4/127.0.0.1/tcp/4001/p2p/{key.peer_id}"

    async def go() -> None:
        async with CoordinatorClient(
            "127.0.0.1", coord.port, key, config=FAST, pin=coord.fingerprint
        ) as cl:
            for bad in (c.JoinRequest(addrs=["garbage"]), c.JoinRequest(dht_addrs=[good, "/x"])):
                with pytest.raises(CoordinatorError, match="bad_request") as err:
                    await cl.join(bad)
                assert "addrs" in str(err.value)
            await cl.join(c.JoinRequest(addrs=[good]))
            cl.announce_dht(["/ip4/1.2.3.4/tcp/99999"])
            with pytest.raises(CoordinatorError, match="bad_request"):
                await cl.heartbeat()
            cl.announce_dht([good])
            await cl.heartbeat()
            view = await cl.membership()
            assert [p.addrs for p in view.peers.values()] == [[good]]
            assert [p.dht_addrs for p in view.peers.values()] == [[good]]

    try:
        trio.run(go)
    finally:
        coord.stop()


def test_nested_msgpack_is_refused_while_it_is_read(tmp_path: Path) -> None:
    """Bytes that would unpack into millions of tiny objects never get that far: the
    envelope (read before any signature check) admits no array at all, a signed body no
    array over 4,096 items, and a request frame is capped at max_request_bytes (1 MiB).
    The honest client is served after each."""
    coord = start_coordinator(tmp_path, config=write_config(tmp_path), db=tmp_path / "c.sqlite")
    key = NodeKey.generate()
    try:
        flat = msgpack.packb({"t": "signed", "v": 1, "junk": [[] for _ in range(500_000)]})
        (reply,) = _raw(coord.port, frame(flat))
        assert isinstance(reply, c.ErrorReply) and reply.code == "bad_frame"
        assert "max_array_len" in reply.detail
        (reply,) = _raw(coord.port, HEADER.pack(2 << 20) + b"x" * 100)  # 2 MiB claimed
        assert isinstance(reply, c.ErrorReply) and reply.code == "bad_frame"
        body = msgpack.packb({"t": "status", "v": 1, "junk": [[]] * 5000})
        now = time.time()
        nonce = secrets.token_bytes(NONCE_SIZE)
        sig = key.sign(signed_bytes(key.public_key, now, nonce, body, run="test-run"))
        req = SignedRequest(key=key.public_key, ts=now, nonce=nonce, body=body, sig=sig)
        (reply,) = _raw(coord.port, frame_message(req))
        assert isinstance(reply, c.ErrorReply) and reply.code == "bad_request"
        assert "max_array_len" in reply.detail
        assert _honest(coord.port, key, pin=coord.fingerprint).peers == 1
    finally:
        coord.stop()


def test_scrape_targets_are_the_source_address_on_an_unprivileged_port(tmp_path: Path) -> None:
    """A member cannot point Prometheus at another host or at a privileged port: the
    file-SD target is the join's source address, and ports below 1024 are refused."""
    sd = tmp_path / "nodes.json"
    coord = start_coordinator(
        tmp_path, config=write_config(tmp_path), db=tmp_path / "c.sqlite",
        args=["--prometheus-sd", str(sd)],
    )  # fmt: skip

    async def go() -> None:
        async with CoordinatorClient(
            "127.0.0.1", coord.port, NodeKey.generate(), config=FAST, pin=coord.fingerprint
        ) as a:
            await a.join(c.JoinRequest(metrics_port=9100, metrics_host="10.9.9.9"))
        async with CoordinatorClient(
            "127.0.0.1", coord.port, NodeKey.generate(), config=FAST, pin=coord.fingerprint
        ) as b:
            with pytest.raises(CoordinatorError, match="bad_request.*metrics_port"):
                await b.join(c.JoinRequest(metrics_port=22))

    try:
        trio.run(go)
        groups = wait_for(lambda: sd.exists() and json.loads(sd.read_text()), "the file-SD", 30)
        assert [t for g in groups for t in g["targets"]] == ["127.0.0.1:9100"]
    finally:
        coord.stop()
