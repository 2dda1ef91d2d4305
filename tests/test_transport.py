"""Data-plane transport over real py-libp2p between processes on loopback.

One echo server (`python -m node.p2p.probe`) runs in a subprocess for the module; the
clients run in the pytest process under trio. Rogue clients write raw bytes on libp2p
streams. Every wait has a deadline.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from node.p2p.host import Libp2pTransport
from node.p2p.probe import ECHO_PROTOCOL, POISON
from node.p2p.transport import P2PConfig, RequestRefused, RequestTimeout, TransportError
from protocol.dataplane import Echo
from protocol.framing import HEADER
from protocol.identity import NodeKey
from swarmlab.procs import child_env

REPO = Path(__file__).resolve().parent.parent
MAX_STREAMS = 16  # the server's per-peer stream cap in these tests


def client_config() -> P2PConfig:
    return P2PConfig(listen=[], max_outbound_streams_per_peer=MAX_STREAMS // 2)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    peer_id: str
    addrs: list[str]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_probe(args: list[str], log: Path, env: dict[str, str]) -> Server:
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "node.p2p.probe", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=REPO,
            env=env,
        )
    assert proc.stdout is not None
    line = _readline_with_deadline(proc, 60.0)
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"probe exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    info = json.loads(line)
    return Server(proc=proc, peer_id=info["peer_id"], addrs=info["addrs"], log=log)


def _readline_with_deadline(proc: subprocess.Popen[bytes], deadline_s: float) -> bytes:
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=deadline_s):
        proc.kill()
        raise AssertionError(f"probe printed no address within {deadline_s} s")
    return proc.stdout.readline()


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)
        server.proc.kill()
    server.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def keys() -> dict[str, NodeKey]:
    names = ["honest", "outsider", "rogue_garbage", "rogue_huge", "rogue_poison", "rogue_flood"]
    return {n: NodeKey.generate() for n in names} | {"server": NodeKey.generate()}


@pytest.fixture(scope="module")
def server(keys: dict[str, NodeKey], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = child_env()
    members = [k for n, k in keys.items() if n not in ("outsider", "server")]
    args = ["--seed-hex", keys["server"].seed.hex(), "--poison"]
    args += ["--max-streams", str(MAX_STREAMS), "--read-timeout", "5"]
    for k in members:
        args += ["--allow", k.peer_id]
    srv = start_probe(args, tmp_path_factory.mktemp("probe") / "server.log", env)
    yield srv
    assert srv.proc.poll() is None, "the echo server died during the tests:\n" + srv.log_text()
    stop(srv)


def run_as(key: NodeKey, fn: Callable[[Libp2pTransport], Awaitable[Any]]) -> Any:
    """Run `fn(transport)` under trio with a fresh client transport for `key`."""

    async def main() -> Any:
        t = Libp2pTransport(key, client_config())
        async with t.run():
            with trio.fail_after(60):
                return await fn(t)

    return trio.run(main)


async def echo(t: Libp2pTransport, srv: Server, seq: int, payload: bytes = b"hi") -> Echo:
    reply = await t.request(
        srv.peer_id, srv.addrs, ECHO_PROTOCOL, Echo(seq=seq, payload=payload), timeout=20
    )
    assert isinstance(reply, Echo)
    return reply


def wait_for_log(srv: Server, needle: str, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while needle not in srv.log_text():
        if time.monotonic() > end:
            raise AssertionError(f"{needle!r} not in server log within {deadline_s} s")
        time.sleep(0.05)


def assert_honest_served(keys: dict[str, NodeKey], srv: Server) -> None:
    async def go(t: Libp2pTransport) -> None:
        reply = await echo(t, srv, 7, b"still here")
        assert reply.payload == b"still here"

    run_as(keys["honest"], go)


# --- tests ------------------------------------------------------------------------------


def test_requests_flow_over_noise_and_yamux(keys: dict[str, NodeKey], server: Server) -> None:
    assert server.peer_id == keys["server"].peer_id  # libp2p id == NodeKey id
    assert all(a.endswith(f"/p2p/{server.peer_id}") for a in server.addrs)
    assert server.addrs[0].startswith("/ip4/127.0.0.1/tcp/") and "/tcp/0/" not in server.addrs[0]

    async def go(t: Libp2pTransport) -> list[tuple[str | None, str | None]]:
        assert (await echo(t, server, 1, b"x" * 100_000)).payload == b"x" * 100_000
        replies: dict[int, bytes] = {}

        async def one(i: int) -> None:
            replies[i] = (await echo(t, server, i, bytes([i]) * i)).payload

        async with trio.open_nursery() as n:
            for i in range(24):
                n.start_soon(one, i)
        assert replies == {i: bytes([i]) * i for i in range(24)}
        return t.connection_stack(server.peer_id)

    stack = run_as(keys["honest"], go)
    assert stack and set(stack) == {("/noise", "/yamux/1.0.0")}


def test_a_peer_without_noise_or_yamux_cannot_connect(
    keys: dict[str, NodeKey], server: Server
) -> None:
    """Only Noise and Yamux are offered, so plaintext or mplex-only peers fail to connect."""
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
    from libp2p.stream_muxer.mplex.mplex import MPLEX_PROTOCOL_ID, Mplex

    async def attempt(**opts: Any) -> bool:
        host = new_host(**opts)
        async with host.run([]):
            try:
                with trio.fail_after(10):
                    await host.connect(info_from_p2p_addr(multiaddr.Multiaddr(server.addrs[0])))
                return True
            except Exception:
                return False

    kp = create_new_key_pair(keys["honest"].seed)
    plaintext = {TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)}
    assert not trio.run(lambda: attempt(key_pair=kp, sec_opt=plaintext))
    assert not trio.run(
        lambda: attempt(key_pair=kp, muxer_opt={TProtocol(MPLEX_PROTOCOL_ID): Mplex})
    )
    assert trio.run(lambda: attempt(key_pair=kp))  # the library default includes Noise+Yamux


def test_non_member_is_refused_and_members_are_served(
    keys: dict[str, NodeKey], server: Server
) -> None:
    async def go(t: Libp2pTransport) -> None:
        with pytest.raises(RequestRefused) as info:
            await echo(t, server, 1)
        assert info.value.reason == "not_member"
        assert server.peer_id in str(info.value)

    run_as(keys["outsider"], go)
    assert_honest_served(keys, server)


async def _raw(t: Libp2pTransport, srv: Server, data: bytes, *, reset: bool = False) -> bytes:
    """Write raw bytes on a fresh stream; return what the server sends before it ends."""
    stream = await t.open_stream(srv.peer_id, srv.addrs, ECHO_PROTOCOL)
    await stream.write(data)
    if reset:
        await stream.reset()
        return b""
    got = b""
    with trio.move_on_after(10):
        try:
            while chunk := await stream.read(65536):
                got += chunk
        except Exception:
            pass
    return got


async def _is_shut_out(t: Libp2pTransport, srv: Server) -> bool:
    try:
        await echo(t, srv, 99)
    except RequestRefused as exc:
        return exc.reason == "banned"
    except TransportError:
        return True  # reset or disconnected: the server would not talk to us
    return False


@pytest.mark.parametrize(
    ("rogue", "data", "needle"),
    [
        ("rogue_garbage", HEADER.pack(12) + b"\xc1garbage\xff\x00\x01\x02", "malformed request"),
        ("rogue_huge", HEADER.pack(2**31) + b"\x00" * 1024, "oversized request"),
        ("rogue_poison", b"", "invalid request"),
    ],
)
def test_rogue_input_gets_the_peer_banned_while_honest_peers_are_served(
    keys: dict[str, NodeKey], server: Server, rogue: str, data: bytes, needle: str
) -> None:
    async def go(t: Libp2pTransport) -> bool:
        if data:
            assert await _raw(t, server, data) == b""  # no reply, just a reset
        else:
            with pytest.raises(TransportError):
                await echo(t, server, 1, POISON)
        return await _is_shut_out(t, server)

    assert run_as(keys[rogue], go)
    wait_for_log(server, f"banned {keys[rogue].peer_id}")
    assert needle in server.log_text()
    assert_honest_served(keys, server)


def test_a_thousand_streams_are_capped_and_honest_peer_keeps_being_served(
    keys: dict[str, NodeKey], server: Server
) -> None:
    async def flood(t: Libp2pTransport) -> tuple[int, int]:
        streams: list[Any] = []
        attempts = 0

        async def open_one() -> None:
            nonlocal attempts
            attempts += 1
            with trio.move_on_after(20):
                try:
                    streams.append(await t.open_stream(server.peer_id, server.addrs, ECHO_PROTOCOL))
                except Exception:
                    pass  # the server resets streams over its cap

        await open_one()  # connect first
        async with trio.open_nursery() as n:  # then 999 streams at once
            for _ in range(999):
                n.start_soon(open_one)
        assert attempts == 1000
        # while the flood holds its streams open, an honest peer is still served
        honest = Libp2pTransport(keys["honest"], client_config())
        async with honest.run():
            assert (await echo(honest, server, 5, b"ok")).payload == b"ok"
        # of all those streams, at most MAX_STREAMS are served
        served = 0
        frame = HEADER.pack(len(b := _echo_bytes())) + b
        for s in streams:
            try:
                with trio.fail_after(2):
                    await s.write(frame)
                    if len(await s.read(4096)) > 4:
                        served += 1
            except Exception:
                pass
            if served > MAX_STREAMS:
                break
        return len(streams), served

    opened, served = run_as(keys["rogue_flood"], flood)
    assert opened >= MAX_STREAMS
    assert 1 <= served <= MAX_STREAMS


def _echo_bytes() -> bytes:
    from protocol.codec import encode

    return encode(Echo(seq=1, payload=b"flood"))


def test_stream_cut_mid_message_does_not_hurt_the_server(
    keys: dict[str, NodeKey], server: Server
) -> None:
    async def go(t: Libp2pTransport) -> bytes:
        await _raw(t, server, HEADER.pack(10_000) + b"\x00" * 100, reset=True)
        await _raw(t, server, HEADER.pack(10_000)[:2], reset=True)
        return (await echo(t, server, 3, b"again")).payload  # not banned: a cut is no offence

    assert run_as(keys["honest"], go) == b"again"
    assert server.proc.poll() is None


def test_request_to_a_frozen_or_dead_peer_fails_within_its_deadline(
    keys: dict[str, NodeKey], tmp_path: Path
) -> None:
    env = child_env()
    frozen = start_probe([], tmp_path / "frozen.log", env)
    try:
        frozen.proc.send_signal(signal.SIGSTOP)

        async def go(t: Libp2pTransport) -> tuple[str, float]:
            start = trio.current_time()
            with pytest.raises(RequestTimeout) as info:
                await t.request(
                    frozen.peer_id, frozen.addrs, ECHO_PROTOCOL, Echo(seq=1), timeout=1.5
                )
            return str(info.value), trio.current_time() - start

        text, took = run_as(keys["honest"], go)
        assert "1.5 s" in text and frozen.peer_id in text
        assert took < 5.0
    finally:
        stop(frozen)

    async def dead(t: Libp2pTransport) -> float:  # the process is gone: refused quickly
        start = trio.current_time()
        with pytest.raises(TransportError) as info:
            await t.request(frozen.peer_id, frozen.addrs, ECHO_PROTOCOL, Echo(seq=1), timeout=10)
        assert frozen.peer_id in str(info.value)
        return trio.current_time() - start

    assert run_as(keys["honest"], dead) < 10.5


def test_a_node_dials_only_the_peers_it_sends_to(keys: dict[str, NodeKey], server: Server) -> None:
    """Knowing a member's address is not a reason to connect to it: py-libp2p's own
    auto-connector would dial every peer in the peerstore (up to 50 connections) about
    10 s after start, which in a swarm opens connections nobody asked for and makes a
    no-listen node reach a stage-0 peer directly before that peer could reach it."""

    async def go(t: Libp2pTransport) -> None:
        t.add_peer_addrs(server.peer_id, server.addrs)
        end = trio.current_time() + 15.0  # past py-libp2p's 10 s auto-connect poll
        while trio.current_time() < end:
            assert t.connection_stack(server.peer_id) == [], "dialled a peer it never asked"
            await trio.sleep(0.25)
        await echo(t, server, 1)  # and it still connects when it does send
        assert t.connection_stack(server.peer_id) == [("/noise", "/yamux/1.0.0")]

    run_as(keys["honest"], go)


def test_a_send_to_a_killed_peer_fails_at_its_first_refusal_and_its_restart_is_reached(
    keys: dict[str, NodeKey], tmp_path: Path
) -> None:
    """A replica SIGKILLed mid-run refuses its port: a send to it fails on the first
    refused dial, so the router can take the micro-batch elsewhere at once (py-libp2p's
    own dial retries held it 0.1 + 0.2 + 0.4 s longer, less 10 % jitter at most). When it
    comes back under the same key at a new address it is reached at once (py-libp2p
    would refuse to dial it for 60 s after all its addresses failed)."""
    seed = "07" * 32
    victim = start_probe(["--seed-hex", seed], tmp_path / "victim.log", child_env())
    back: Server | None = None
    try:

        async def go(t: Libp2pTransport) -> list[float]:
            nonlocal back
            await echo(t, victim, 1)
            victim.proc.kill()
            victim.proc.wait(10)
            took = []
            for seq in (2, 3):  # the stream it held (or a dial), then a dial
                await trio.sleep(0.5)  # the swarm notices the dead connection
                start = trio.current_time()
                with pytest.raises(TransportError):
                    await t.request(
                        victim.peer_id, victim.addrs, ECHO_PROTOCOL, Echo(seq=seq), timeout=10
                    )
                took.append(trio.current_time() - start)
            back = start_probe(["--seed-hex", seed], tmp_path / "back.log", child_env())
            assert back.peer_id == victim.peer_id and back.addrs != victim.addrs
            await echo(t, back, 4)
            return took

        took = run_as(keys["honest"], go)
    finally:
        stop(victim)
        if back is not None:
            stop(back)
    assert max(took) < 0.6, took
