"""The efficiency bench's link emulator: a host's uplink is shared by everything it sends,
whatever the destination, and a connection is charged to the host whose process opened
it (a real proxy process, a real client process, an echo server)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.shaping_proxy import Crossing, Host, Link, parse_routes
from swarmlab.procs import child_env, free_port, wait_for

RATE = 1000.0  # bytes/s of every link in the pure tests


def host(name: str) -> Host:
    return Host(name, Link(RATE), Link(RATE))


def test_one_uplink_serialises_what_a_host_sends_to_any_peer() -> None:
    a, b, c = host("a"), host("b"), host("c")
    unattributed = [0]
    to_b = Crossing(a, b, 0.02, unattributed)
    to_c = Crossing(a, c, 0.02, unattributed)
    assert to_b.arrival(0.0, 500) == pytest.approx(0.52)
    # handed over at the same moment, to another peer: it waits for a's uplink
    assert to_c.arrival(0.0, 500) == pytest.approx(1.02)
    assert a.up.bytes == 1000 and b.down.bytes == c.down.bytes == 500
    assert unattributed == [0]


def test_one_downlink_serialises_what_a_host_receives_from_any_peer() -> None:
    a, b, c = host("a"), host("b"), host("c")
    assert Crossing(a, c, 0.0, [0]).arrival(0.0, 1000) == pytest.approx(1.0)
    assert Crossing(b, c, 0.0, [0]).arrival(0.0, 1000) == pytest.approx(2.0)


def test_a_sender_of_no_host_has_no_uplink_and_is_counted_apart() -> None:
    b = host("b")
    unattributed = [0]
    assert Crossing(None, b, 0.01, unattributed).arrival(5.0, 250) == pytest.approx(5.26)
    assert Crossing(b, None, 0.01, unattributed).arrival(5.0, 250) == pytest.approx(5.26)
    assert unattributed == [250] and b.down.bytes == b.up.bytes == 250


def test_routes_of_one_host_share_its_link_and_bad_specs_are_refused() -> None:
    routes = parse_routes(["n0:1001=2001", "n0:1002=2002", "coordinator:1003=2003"], 8.0)
    assert routes[0].host is routes[1].host and routes[2].host is not routes[0].host
    assert routes[0].host.up.rate_bytes_s == 1e6
    for bad in ("1001=2001", "n0:x=2001", "n0:1001"):
        with pytest.raises(ValueError, match="HOST:LISTEN=TARGET"):
            parse_routes([bad], 8.0)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()


CLIENT = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30) as s:
    s.sendall(b"x" * int(sys.argv[2]))
    s.shutdown(socket.SHUT_WR)
    got = 0
    while data := s.recv(65536):
        got += len(data)
print(got)
"""


def test_a_connection_is_charged_to_the_host_whose_process_opened_it(
    tmp_path: Path, echo_port: int
) -> None:
    listen = free_port()
    owners, ready, stats = (tmp_path / n for n in ("owners.json", "ready", "stats.json"))
    owners.write_text("{}")
    proxy = subprocess.Popen(
        [sys.executable, "-m", "bench.shaping_proxy", "--rate-mbit", "100", "--delay-ms", "1",
         f"--route=server:{listen}={echo_port}", f"--route=client:{free_port()}={free_port()}",
         "--owners", str(owners), "--ready-file", str(ready), "--stats", str(stats)],
        env=child_env(),
    )  # fmt: skip
    try:
        wait_for(ready.exists, "the proxy to listen", 30)
        # a process of host "client" (its pid in the owners file, written after it started)
        client = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.readline()\n" + CLIENT,
             str(listen), "30000"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        owners.write_text(json.dumps({"client": client.pid}))
        out, _ = client.communicate("go\n", timeout=60)
        assert int(out) == 30000
        # this test's own process belongs to no host: its bytes are unattributed
        done = subprocess.run(
            [sys.executable, "-c", CLIENT, str(listen), "7000"],
            capture_output=True, text=True, timeout=60, env=child_env(), check=True,
        )  # fmt: skip
        assert int(done.stdout) == 7000
    finally:
        proxy.send_signal(signal.SIGINT)
        proxy.wait(30)
    assert proxy.returncode == 0
    got = json.loads(stats.read_text())
    server, client_host = got["hosts"]["server"], got["hosts"]["client"]
    assert client_host["bytes_up"] == 30000 and client_host["bytes_down"] == 30000
    assert server["bytes_down"] == 37000 and server["bytes_up"] == 37000
    assert client_host["connections_out"] == 1 and server["connections_in"] == 2
    assert got["unattributed_bytes"] == 7000  # sent by no host (its replies: by the server)
    route = got["routes"][f"{listen}->{echo_port}"]
    assert route == {"host": "server", "bytes_in": 37000, "bytes_out": 37000, "connections": 2}
