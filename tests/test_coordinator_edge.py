"""The coordinator's edge against a real coordinator process over real sockets: the
per-source connection cap, the global budget of buffered partial frames, the deadline
for a whole frame, the per-source rate limit that comes before signature checks and the
replay guard, signatures bound to one run, and replays after a restart. After each
attack an honest client is served."""

from __future__ import annotations

import re
import select
import socket
import time
import urllib.request
from pathlib import Path

import trio
from coordinator_harness import write_config

from node.control_tls import connect
from node.coordinator_client import ClientConfig, CoordinatorClient
from protocol import control as c
from protocol.addrs import MAX_ADDRS, MAX_CHARS, multiaddr_problem
from protocol.codec import decode
from protocol.framing import HEADER, FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.signing import sign_request
from swarmlab.coordinator import start_coordinator
from swarmlab.procs import wait_for

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=30.0)


def _replies(sock: socket.socket, timeout_s: float = 3.0) -> tuple[list[Message], bool]:
    """Replies read until the server closes (True) or `timeout_s` passes (False)."""
    dec, out = FrameDecoder(), []
    sock.settimeout(timeout_s)
    try:
        while chunk := sock.recv(65536):
            out += [decode(p) for p in dec.feed(chunk)]
    except TimeoutError:
        return out, False
    return out, True


def _codes(msgs: list[Message]) -> list[str]:
    return [m.code if isinstance(m, c.ErrorReply) else m.TYPE for m in msgs]


def _refusals(mport: int, reason: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    m = re.search(
        rf'^agora_coordinator_edge_refusals_total{{reason="{reason}"}} (\S+)$', text, re.M
    )
    return float(m.group(1)) if m else 0.0


def _status(port: int) -> c.StatusReply:
    async def go() -> c.StatusReply:
        async with CoordinatorClient("127.0.0.1", port, NodeKey.generate(), config=FAST) as cl:
            return await cl.status()

    return trio.run(go)


def _connect(port: int) -> socket.socket:
    return connect("127.0.0.1", port, None, timeout_s=5)


def test_connections_over_the_per_host_cap_get_too_busy(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, max_connections_per_host=5)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", metrics=True)
    held = []
    try:
        for _ in range(5):  # each served once, so the coordinator counts it
            s = _connect(coord.port)
            s.sendall(frame_message(sign_request(NodeKey.generate(), c.StatusRequest(),
                                                 now=time.time(), run=None)))  # fmt: skip
            msgs, closed = _replies(s, 1.0)
            assert _codes(msgs) == ["status.reply"] and not closed
            held.append(s)
        with _connect(coord.port) as extra:
            msgs, closed = _replies(extra)
        assert _codes(msgs) == ["too_busy"] and closed
        assert "source address" in msgs[0].detail  # type: ignore[attr-defined]
        assert coord.metrics_port is not None
        assert _refusals(coord.metrics_port, "host_connections") >= 1
        for s in held:
            s.close()
        held = []
        assert _status(coord.port).peers == 0  # the client retries until a slot is free
    finally:
        for s in held:
            s.close()
        coord.stop()


def test_partial_frames_share_one_buffer_budget(tmp_path: Path) -> None:
    """Three connections each hold 50 KB of an unfinished frame; the budget holds two.
    Exactly one is refused and closed; the other two stay open."""
    cfg = write_config(tmp_path, max_request_bytes=65536, max_buffered_bytes=120_000)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", metrics=True)
    socks = [_connect(coord.port) for _ in range(3)]
    try:
        # one after the other: over TLS the server reads 16 KiB records, and interleaved
        # reads of three connections could pass the budget on two of them at once
        for s in socks:
            s.sendall(HEADER.pack(60_000) + b"x" * 50_000)
            time.sleep(0.3)
        answered: dict[int, list[bytes]] = {}
        deadline = time.monotonic() + 5
        while len(answered) < 1 and time.monotonic() < deadline:
            ready, _, _ = select.select(socks, [], [], 0.2)
            for s in ready:
                answered.setdefault(socks.index(s), []).append(s.recv(65536))
        assert len(answered) == 1, answered
        (i,) = answered
        msgs, closed = _replies(socks[i])
        first = FrameDecoder().feed(b"".join(answered[i]))
        assert _codes([decode(p) for p in first] + msgs) == ["too_busy"] and closed
        others = [s for j, s in enumerate(socks) if j != i]
        ready, _, _ = select.select(others, [], [], 0.5)
        assert ready == []  # still open, still waiting for the rest of their frame
        assert coord.metrics_port is not None
        assert _refusals(coord.metrics_port, "buffer_budget") == 1
        assert _status(coord.port).peers == 0
    finally:
        for s in socks:
            s.close()
        coord.stop()


def test_a_slow_drip_is_cut_at_the_frame_deadline_but_an_idle_connection_is_not(
    tmp_path: Path,
) -> None:
    cfg = write_config(tmp_path, frame_deadline_s=1.0, idle_timeout_s=60.0)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", metrics=True)
    req = frame_message(sign_request(NodeKey.generate(), c.StatusRequest(), now=time.time(),
                                     run=None))  # fmt: skip
    try:
        with _connect(coord.port) as idle, _connect(coord.port) as drip:
            t0 = time.monotonic()
            cut = False
            for byte in req[:-1]:  # one byte per 0.2 s: each read is well inside any idle timeout
                try:
                    drip.sendall(bytes([byte]))
                except OSError:
                    cut = True
                    break
                ready, _, _ = select.select([drip], [], [], 0.2)
                if ready:
                    cut = True
                    break
                assert time.monotonic() - t0 < 10, "the drip was never cut"
            assert cut
            msgs, closed = _replies(drip)
            assert _codes(msgs) == ["bad_frame"] and closed
            assert "frame_deadline_s" in msgs[0].detail  # type: ignore[attr-defined]
            assert 0.9 < time.monotonic() - t0 < 5
            # silent past the frame deadline but between frames: still served
            assert time.monotonic() - t0 > 1.0
            idle.sendall(frame_message(sign_request(NodeKey.generate(), c.StatusRequest(),
                                                    now=time.time(), run=None)))  # fmt: skip
            msgs, closed = _replies(idle, 2.0)
            assert _codes(msgs) == ["status.reply"] and not closed
        assert coord.metrics_port is not None
        assert _refusals(coord.metrics_port, "frame_deadline") == 1
    finally:
        coord.stop()


def test_the_source_rate_limit_comes_before_signatures_and_the_replay_guard(
    tmp_path: Path,
) -> None:
    """60 forged requests in one write: past the source's burst they are refused as
    rate_limited, never signature-checked. 60 copies of one valid request: past the
    burst they are rate_limited, never reaching (or filling) the replay guard."""
    cfg = write_config(tmp_path, rate_per_host=20.0, host_burst=20.0, rate_per_peer=5.0,
                       rate_burst=5.0)  # fmt: skip
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", metrics=True)
    try:
        forged = []
        for _ in range(60):
            req = sign_request(NodeKey.generate(), c.StatusRequest(), now=time.time(), run=None)
            forged.append(frame_message(type(req)(
                key=NodeKey.generate().public_key, ts=req.ts, nonce=req.nonce, body=req.body,
                sig=req.sig, any_run=True,
            )))  # fmt: skip
        with _connect(coord.port) as s:
            s.sendall(b"".join(forged))
            codes = _codes(_replies(s, 2.0)[0])
        assert len(codes) == 60
        assert set(codes) == {"bad_signature", "rate_limited"}
        assert codes.count("bad_signature") <= 25 and codes.index("rate_limited") >= 19
        assert coord.metrics_port is not None
        assert _refusals(coord.metrics_port, "host_rate") >= 35

        def refilled() -> bool:
            with _connect(coord.port) as t:
                t.sendall(frame_message(sign_request(NodeKey.generate(), c.StatusRequest(),
                                                     now=time.time(), run=None)))  # fmt: skip
                return _codes(_replies(t, 2.0)[0]) == ["status.reply"]

        wait_for(refilled, "the source's bucket to refill", 10, poll_s=0.5)
        time.sleep(1.0)  # the token bucket's refill: 20 tokens at 20/s
        one = frame_message(sign_request(NodeKey.generate(), c.StatusRequest(), now=time.time(),
                                         run=None))  # fmt: skip
        with _connect(coord.port) as s:
            s.sendall(one * 60)
            codes = _codes(_replies(s, 2.0)[0])
        assert codes[0] == "status.reply" and set(codes[1:]) == {"replay", "rate_limited"}
        assert codes.count("replay") <= 25 and codes[-30:] == ["rate_limited"] * 30
        assert _status(coord.port).peers == 0
    finally:
        coord.stop()


def test_a_signature_for_one_run_is_refused_by_another(tmp_path: Path) -> None:
    """The same key is a member of runs A and B; a heartbeat it signed for A, replayed
    to B, is refused; so is any request but a status signed for no run."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    run_a = start_coordinator(a_dir, config=write_config(a_dir, run_id="run-a", lease_ttl_s=30.0),
                              db=a_dir / "c.sqlite")  # fmt: skip
    run_b = start_coordinator(b_dir, config=write_config(b_dir, run_id="run-b", lease_ttl_s=30.0),
                              db=b_dir / "c.sqlite")  # fmt: skip
    key = NodeKey.generate()

    async def join_both() -> None:
        for port in (run_a.port, run_b.port):
            async with CoordinatorClient("127.0.0.1", port, key, config=FAST) as cl:
                assert (await cl.join()).run.run_id == cl.run_id

    try:
        trio.run(join_both)
        for_a = frame_message(sign_request(key, c.HeartbeatRequest(), now=time.time(), run="run-a"))
        with _connect(run_b.port) as s:
            s.sendall(for_a)
            (reply,), _ = _replies(s, 2.0)
        assert isinstance(reply, c.ErrorReply) and reply.code == "bad_signature"
        assert "run-b" in reply.detail
        with _connect(run_a.port) as s:
            s.sendall(for_a)
            (reply,), _ = _replies(s, 2.0)
        assert isinstance(reply, c.HeartbeatReply)
        unbound = sign_request(key, c.HeartbeatRequest(), now=time.time(), run=None)
        with _connect(run_a.port) as s:
            s.sendall(frame_message(unbound))
            (reply,), _ = _replies(s, 2.0)
        assert isinstance(reply, c.ErrorReply) and reply.code == "bad_request"
        assert "run-a" in reply.detail
    finally:
        run_a.stop()
        run_b.stop()


def test_a_request_captured_before_a_restart_is_refused_after_it(tmp_path: Path) -> None:
    cfg, db = write_config(tmp_path), tmp_path / "c.sqlite"
    coord = start_coordinator(tmp_path, config=cfg, db=db)
    key = NodeKey.generate()

    async def join(port: int) -> None:
        async with CoordinatorClient("127.0.0.1", port, key, config=FAST) as cl:
            await cl.join()

    try:
        trio.run(join, coord.port)
        captured = frame_message(
            sign_request(key, c.HeartbeatRequest(), now=time.time(), run="test-run")
        )
        with _connect(coord.port) as s:
            s.sendall(captured)
            (reply,), _ = _replies(s, 2.0)
        assert isinstance(reply, c.HeartbeatReply)
        assert coord.stop() == 0
        coord = start_coordinator(tmp_path, config=cfg, db=db)
        with _connect(coord.port) as s:
            s.sendall(captured)
            (reply,), _ = _replies(s, 2.0)
        assert isinstance(reply, c.ErrorReply) and reply.code == "replay"
        assert "before this coordinator started" in reply.detail

        trio.run(join, coord.port)  # fresh signatures are served
    finally:
        coord.stop()


def _maximal_addrs(tag: str, peer_id: str = "") -> list[str]:
    """MAX_ADDRS distinct addresses of exactly MAX_CHARS characters (ending in
    /p2p/`peer_id` when given, as DHT addresses must)."""
    out = []
    tail = f"/p2p/{peer_id}" if peer_id else ""
    size = MAX_CHARS - len("/dns4//tcp/4001") - len(tail)  # characters of the host name
    for j in range(MAX_ADDRS):
        head = f"{tag}x{j}."
        full, last = divmod(size - len(head) - 1, 64)  # labels of 63 and a dot, then one
        name = head + ("a" * 63 + ".") * full + "b" * (last + 1)
        out.append(f"/dns4/{name}/tcp/4001{tail}")
    assert all(len(a) == MAX_CHARS and multiaddr_problem(a) is None for a in out)
    return out


def test_a_large_view_of_maximal_entries_comes_in_pages_that_fit_a_frame(tmp_path: Path) -> None:
    """200 members, each with the most and the longest addresses allowed, would need
    about 900 KB in one reply; the reply frame here is 300 KB. A node-side client gets
    the full view over pages of 50, then the later changes as delta pages."""
    # members never heartbeat here: a TTL long enough that none lapses while 265 join
    cfg = write_config(tmp_path, max_frame_bytes=300_000, max_request_bytes=65536,
                       membership_page_peers=50, lease_ttl_s=300.0)  # fmt: skip
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    keys = [NodeKey.generate() for _ in range(265)]

    async def join(batch: list[NodeKey]) -> None:
        for key in batch:
            async with CoordinatorClient("127.0.0.1", coord.port, key, config=FAST) as cl:
                addrs = _maximal_addrs(key.peer_id[-6:])
                dht = _maximal_addrs(key.peer_id[-6:], key.peer_id)
                await cl.join(c.JoinRequest(addrs=addrs, dht_addrs=dht, device="d" * 64))

    async def go() -> None:
        await join(keys[:200])
        async with CoordinatorClient("127.0.0.1", coord.port, keys[0], config=FAST) as node:
            first = await node._membership_page(0, None)
            assert first.full and first.more and len(first.peers) == 50 and first.cursor
            view = await node.membership()
            assert set(view.peers) == {k.peer_id for k in keys[:200]}
            assert all(len(p.addrs) == MAX_ADDRS for p in view.peers.values())
            await join(keys[200:])  # 65 changes: two delta pages
            for key in keys[195:200]:
                async with CoordinatorClient("127.0.0.1", coord.port, key, config=FAST) as cl:
                    await cl.leave()
            before = view.version
            view = await node.membership()
            assert set(view.peers) == {k.peer_id for k in keys[:195] + keys[200:]}
            delta = await node._membership_page(before, None)
            assert not delta.full and delta.more and len(delta.peers) == 50

    try:
        trio.run(go)
    finally:
        coord.stop()
