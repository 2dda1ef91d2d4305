"""`agora bench transport`: data-plane MB/s over py-libp2p vs raw TCP on loopback.

A server process serves the same echo request two ways: over py-libp2p (Noise, Yamux,
the node's `Libp2pTransport`) and over a plain trio TCP socket with the same framing
(4-byte length + msgpack). The client sends N requests of each size, one at a time, and
the server answers each with an empty reply, so the figure is one-way payload MB/s
including framing, encoding and decoding. The two transports alternate rounds in one
run, so machine load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from swarmlab.procs import child_env

MIB = 1024 * 1024
SIZES = {"1MiB": 1 * MIB, "64MiB": 64 * MIB}
MAX_FRAME = 80 * MIB  # bytes; raised from the 64 MiB default so a 64 MiB payload fits


class _SocketStreamAdapter:
    """`read(n)` / `write(data)` over a trio SocketStream, as node.p2p.wire expects."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._s = stream

    async def read(self, n: int | None = None) -> bytes:
        return bytes(await self._s.receive_some(n or 65536))

    async def write(self, data: bytes) -> None:
        await self._s.send_all(data)


def _p2p_config() -> Any:
    from node.p2p.limits import LimitsConfig
    from node.p2p.transport import P2PConfig

    return P2PConfig(
        max_frame=MAX_FRAME,
        limits=LimitsConfig(max_bytes_in_flight_per_peer=4 * MAX_FRAME),
    )


# --- server process -----------------------------------------------------------------------


async def _serve() -> None:
    from node.p2p.host import Libp2pTransport
    from node.p2p.probe import ECHO_PROTOCOL, make_echo_handler
    from node.p2p.wire import read_message, write_message
    from protocol.dataplane import Echo
    from protocol.identity import NodeKey

    transport = Libp2pTransport(NodeKey.generate(), _p2p_config())
    transport.set_handler(ECHO_PROTOCOL, make_echo_handler(poison=False))  # type: ignore[arg-type]

    async def tcp_echo(sock: trio.SocketStream) -> None:
        s = _SocketStreamAdapter(sock)
        try:
            while True:
                msg = await read_message(s, max_frame=MAX_FRAME)
                assert isinstance(msg, Echo)
                size = msg.reply_size
                reply = Echo(seq=msg.seq, payload=msg.payload if size is None else bytes(size))
                await write_message(s, reply, max_frame=MAX_FRAME)
        except Exception:
            return

    async with transport.run(), trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        nursery.start_soon(trio.serve_listeners, tcp_echo, listeners)
        port = listeners[0].socket.getsockname()[1]
        info = {"peer_id": transport.peer_id, "addrs": transport.listen_addrs, "tcp_port": port}
        print(json.dumps(info), flush=True)
        async with trio.lowlevel.FdStream(os.dup(0)) as stdin:
            while await stdin.receive_some(1024):
                pass
        nursery.cancel_scope.cancel()


# --- client -------------------------------------------------------------------------------


async def _measure(info: dict[str, Any], reps: dict[str, int], rounds: int) -> dict[str, Any]:
    from node.p2p.host import Libp2pTransport
    from node.p2p.probe import ECHO_PROTOCOL
    from node.p2p.wire import read_message, write_message
    from protocol.dataplane import Echo
    from protocol.identity import NodeKey

    cfg = _p2p_config()
    cfg.listen = []
    client = Libp2pTransport(NodeKey.generate(), cfg)
    sock = await trio.open_tcp_stream("127.0.0.1", info["tcp_port"])
    tcp = _SocketStreamAdapter(sock)
    times: dict[tuple[str, str], list[float]] = {}

    async def p2p_once(payload: bytes) -> None:
        reply = await client.request(
            info["peer_id"],
            info["addrs"],
            ECHO_PROTOCOL,
            Echo(seq=0, payload=payload, reply_size=0),
            timeout=120,
        )
        assert isinstance(reply, Echo)

    async def tcp_once(payload: bytes) -> None:
        with trio.fail_after(120):
            await write_message(
                tcp, Echo(seq=0, payload=payload, reply_size=0), max_frame=MAX_FRAME
            )
            await read_message(tcp, max_frame=MAX_FRAME)

    async with client.run():
        for size_name, size in SIZES.items():
            payload = os.urandom(size)
            await p2p_once(payload)  # warm-up: connection, stream, Yamux window growth
            await tcp_once(payload)
            for _ in range(rounds):
                for name, once in (("libp2p", p2p_once), ("tcp", tcp_once)):
                    start = time.perf_counter()
                    for _ in range(reps[size_name]):
                        await once(payload)
                    times.setdefault((size_name, name), []).append(time.perf_counter() - start)
    await sock.aclose()
    results: dict[str, Any] = {}
    for size_name, size in SIZES.items():
        row: dict[str, Any] = {"bytes": size, "requests": reps[size_name] * rounds}
        for name in ("libp2p", "tcp"):
            total = sum(times[(size_name, name)])
            row[f"{name}_mb_s"] = round(size * reps[size_name] * rounds / total / 1e6, 2)
        row["ratio"] = round(row["libp2p_mb_s"] / row["tcp_mb_s"], 3)
        results[size_name] = row
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora bench transport",
        description=(
            "Data-plane throughput over py-libp2p (Noise, Yamux) vs raw TCP with the same "
            "framing, loopback, 1 MiB and 64 MiB messages, measured side by side."
        ),
    )
    p.add_argument("--json", type=Path, help="write results to this JSON file")
    p.add_argument("--reps-1mib", type=int, default=20, help="1 MiB requests per round")
    p.add_argument("--reps-64mib", type=int, default=2, help="64 MiB requests per round")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per transport")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # server process
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.serve:
        trio.run(_serve)
        return 0
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.transport", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line:
            print("agora bench transport: the server process failed to start", file=sys.stderr)
            return 1
        info = json.loads(line)
        reps = {"1MiB": args.reps_1mib, "64MiB": args.reps_64mib}
        results = trio.run(_measure, info, reps, args.rounds)
    except KeyboardInterrupt:
        return 130
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=10)
    print(f"{'size':>6}  {'libp2p MB/s':>12}  {'tcp MB/s':>10}  {'ratio':>6}  requests")
    for size_name, row in results.items():
        print(
            f"{size_name:>6}  {row['libp2p_mb_s']:>12.1f}  {row['tcp_mb_s']:>10.1f}  "
            f"{row['ratio']:>6.3f}  {row['requests']}"
        )
    if args.json:
        out = {
            "benchmark": "transport",
            "transport": "py-libp2p 0.8.1, Noise + Yamux, stream reuse",
            "baseline": "trio TCP, same framing and codec",
            "loopback": True,
            "cpus": os.cpu_count(),
            "sizes": results,
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
