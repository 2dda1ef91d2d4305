"""The control plane's TLS and certificate pinning, against real coordinator processes.

- A node (`agora-node`) and `agora status` pinned to one coordinator's certificate and
  pointed at another coordinator (an impostor with its own certificate) refuse it with
  an error naming both fingerprints and a non-zero exit, and the impostor sees no
  request at all (its request counters stay at zero).
- A closed run's join crosses a real TCP relay placed between client and coordinator;
  the relay records every byte both ways, and the join token never appears in them.
- Tokens are never sent to an unpinned coordinator; a `CoordinatorClient` keeps the
  first certificate it saw and refuses a different one on a later connection.
- Address and fingerprint syntax (`protocol.pinning`).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import trio
from coordinator_harness import write_config

from node.control_tls import UnpinnedSecret
from node.coordinator_client import ClientConfig, CoordinatorClient
from protocol import control as c
from protocol.identity import NodeKey
from protocol.pinning import CoordinatorAddress, PinMismatch, parse_address, parse_fingerprint
from swarmlab.coordinator import CoordinatorProc, start_coordinator
from swarmlab.procs import REPO, child_env

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)
TOKEN = "tls-join-s3cret-0123456789"


def _requests_seen(coord: CoordinatorProc) -> float:
    """Requests the coordinator handled (any type, answered or refused), from its metrics."""
    assert coord.metrics_port is not None
    url = f"http://127.0.0.1:{coord.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    counts = re.findall(r"^agora_coordinator_rpc_latency_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(x) for x in counts)


class Relay:
    """A TCP forwarder on loopback that records every byte in both directions."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = int(self.listener.getsockname()[1])
        self.up = bytearray()  # client -> coordinator
        self.down = bytearray()  # coordinator -> client
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            for src, dst, buf in ((client, upstream, self.up), (upstream, client, self.down)):
                t = threading.Thread(target=self._pump, args=(src, dst, buf), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, buf: bytearray) -> None:
        src.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                with self._lock:
                    buf += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self.listener.close()


@pytest.fixture
def two_coordinators(tmp_path: Path):  # type: ignore[no-untyped-def]
    """The real coordinator of a closed run and an impostor with its own certificate."""
    (tmp_path / "real").mkdir()
    (tmp_path / "fake").mkdir()
    cfg = write_config(tmp_path, auth="token", join_token=TOKEN)
    real = start_coordinator(tmp_path / "real", config=cfg, db=tmp_path / "real" / "c.sqlite")
    fake = start_coordinator(
        tmp_path / "fake", config=cfg, db=tmp_path / "fake" / "c.sqlite", metrics=True
    )
    try:
        assert real.fingerprint and fake.fingerprint and real.fingerprint != fake.fingerprint
        yield real, fake
    finally:
        real.stop()
        fake.stop()


def test_pinned_clients_refuse_an_impostor_and_send_it_nothing(
    two_coordinators: tuple[CoordinatorProc, CoordinatorProc], tmp_path: Path
) -> None:
    real, fake = two_coordinators
    impostor = str(CoordinatorAddress(host=fake.host, port=fake.port, pin=real.fingerprint))
    env = child_env()
    status = subprocess.run(
        [sys.executable, "-m", "swarmlab.status", "--coordinator", impostor],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 1, status.stderr
    assert str(real.fingerprint) in status.stderr and str(fake.fingerprint) in status.stderr
    node = subprocess.run(
        [sys.executable, "-m", "node.main", "--coordinator", impostor, "--device", "cpu",
         "--identity", str(tmp_path / "n.key"), "--listen", "/ip4/127.0.0.1/tcp/0"],
        cwd=REPO, env=dict(env, AGORA_JOIN_TOKEN=TOKEN), capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert node.returncode == 4, node.stderr[-3000:]
    assert str(real.fingerprint) in node.stderr and str(fake.fingerprint) in node.stderr
    assert "nothing was sent" in node.stderr
    assert _requests_seen(fake) == 0  # neither a status nor the join reached it
    assert fake.alive()


def test_a_closed_join_through_a_relay_never_shows_the_token(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, auth="token", join_token=TOKEN)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    relay = Relay(coord.port)
    try:
        via = CoordinatorAddress(host="127.0.0.1", port=relay.port, pin=coord.fingerprint)

        async def go() -> c.JoinReply:
            async with CoordinatorClient.to(via, NodeKey.generate(), config=FAST) as cl:
                joined = await cl.join(c.JoinRequest(observer=True, join_token=TOKEN))
                await cl.heartbeat()
                await cl.leave()
                return joined

        joined = trio.run(go)
        assert joined.run.run_id == "test-run"
    finally:
        relay.close()
        coord.stop()
    up, down = bytes(relay.up), bytes(relay.down)
    assert len(up) > 500 and len(down) > 500  # the join, heartbeat and leave went through
    assert up[0] == 0x16 and down[0] == 0x16  # TLS handshake records, both ways
    for secret in (TOKEN.encode(), TOKEN[:12].encode()):
        assert secret not in up and secret not in down
    assert b"join" not in up  # no plaintext message type either


def test_tokens_need_a_pin_and_a_client_keeps_its_first_certificate(
    two_coordinators: tuple[CoordinatorProc, CoordinatorProc],
) -> None:
    real, fake = two_coordinators

    async def go() -> None:
        async with CoordinatorClient(real.host, real.port, NodeKey.generate(), config=FAST) as cl:
            with pytest.raises(UnpinnedSecret, match="join_token"):
                await cl.join(c.JoinRequest(join_token=TOKEN))
            await cl.status()  # no secret: served, unauthenticated (a warning is logged)
            assert cl.seen_fingerprint == real.fingerprint
            await cl.aclose()
            cl.port = fake.port  # the "same" coordinator now answers with another certificate
            with pytest.raises(PinMismatch):
                await cl.status()

    trio.run(go)
    assert _requests_seen(fake) == 0


def test_address_syntax() -> None:
    pin = "sha256:" + "ab" * 32
    assert parse_address("h:7700") == CoordinatorAddress(host="h", port=7700)
    a = parse_address(f"[::1]:7700#{pin}")
    assert (a.host, a.port, a.pin) == ("::1", 7700, pin) and str(a) == f"[::1]:7700#{pin}"
    assert parse_address("h:1", ":".join(["AB"] * 32)).pin == pin  # OpenSSL's form
    assert parse_fingerprint(pin.upper().replace("SHA256", "sha256")) == pin
    for bad in ("h", "h:0", "h:1#sha256:abc", "h:1#md5:" + "ab" * 32, f"h:x#{pin}"):
        with pytest.raises(ValueError):
            parse_address(bad)
    with pytest.raises(ValueError, match="fingerprint option"):
        parse_address(f"h:1#{pin}", "sha256:" + "cd" * 32)
