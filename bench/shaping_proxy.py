"""A userspace TCP proxy that puts each host of a local swarm behind its own consumer link.

Used by `agora bench efficiency` because the kernel here has no `sch_netem` (tc answers
"Specified qdisc kind is unknown"), so the delay cannot be added with netem. Every host
(a node, the coordinator) has one link: an uplink and a downlink, each serialising at
`rate` and shared by everything the host sends or receives, whatever the destination
and whichever of its processes (the stage, the outer loop's DHT) sends it. A host's
listening ports are reached through routes: the proxy listens on an announced port and
forwards to the host's real one.

Bytes a client sends into a route leave through the client's uplink, enter through the
target host's downlink (cut-through: the downlink starts a chunk when the uplink does),
and arrive `delay` later; the replies go the other way. The client is the host whose
processes own the connecting socket: the proxy looks up the socket's owner pid
(`psutil.net_connections`) and walks up its parents to a host's root pid, read from
`--owners FILE` (JSON `{host: pid}`, re-read when a pid is not found, so the bench can
add hosts as it starts them). A connection from a process of no host has no uplink
(its bytes are counted as unattributed). With delay 20 ms each way a request and its
reply see a 40 ms round trip.

Run as a process: `python -m bench.shaping_proxy --rate-mbit 80 --delay-ms 20
--route HOST:LISTEN_PORT=TARGET_PORT ... --owners F --ready-file F`. It writes "ready"
to the ready file once every route listens, reports bytes per host on SIGINT/SIGTERM to
`--stats FILE` (JSON) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

CHUNK = 64 * 1024  # bytes read at once
QUEUE_CHUNKS = 64  # chunks buffered per direction of one connection (back-pressure)
OWNER_LOOKUP_S = 5.0  # seconds the lookup of a connecting socket's owner may take


@dataclass(slots=True)
class Link:
    """One direction of a host's link: bytes leave no faster than `rate_bytes_s`."""

    rate_bytes_s: float  # bytes per second
    free_at: float = 0.0  # loop time at which the link finishes sending what it has
    bytes: int = 0  # bytes carried

    def serialise(self, ready: float, n: int) -> tuple[float, float]:
        """(start, end) loop times of sending `n` bytes handed over at `ready`."""
        start = max(ready, self.free_at)
        self.free_at = start + n / self.rate_bytes_s
        self.bytes += n
        return start, self.free_at


@dataclass(slots=True)
class Host:
    name: str
    up: Link  # what the host sends
    down: Link  # what the host receives
    connections_in: int = 0  # connections accepted on its routes
    connections_out: int = 0  # connections its processes opened through the proxy


@dataclass(slots=True)
class Crossing:
    """One direction of one proxied connection: from `sender` to `receiver` (None: a
    process of no host, which has no link), `delay_s` one way."""

    sender: Host | None
    receiver: Host | None
    delay_s: float
    unattributed: list[int]  # the proxy's count of bytes sent by no host (shared cell)
    tally: list[int] = field(default_factory=lambda: [0])  # bytes of this direction of a route

    def arrival(self, now: float, n: int) -> float:
        """Loop time at which `n` bytes handed over `now` arrive at the far end."""
        self.tally[0] += n
        if self.sender is None:
            self.unattributed[0] += n
            start, sent = now, now
        else:
            start, sent = self.sender.up.serialise(now, n)
        received = sent if self.receiver is None else self.receiver.down.serialise(start, n)[1]
        return max(sent, received) + self.delay_s


@dataclass(slots=True)
class Route:
    host: Host
    listen_port: int
    target_port: int
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    bytes_in: list[int] = field(default_factory=lambda: [0])  # to the target port
    bytes_out: list[int] = field(default_factory=lambda: [0])  # back from it
    connections: int = 0


@dataclass(slots=True)
class Owners:
    """Which host a connecting process belongs to, from the owners file."""

    path: Path | None
    hosts: dict[str, Host]
    roots: dict[int, str] = field(default_factory=dict)  # root pid -> host name

    def _reload(self) -> None:
        if self.path is None:
            return
        try:
            table = json.loads(self.path.read_text())
            self.roots = {int(pid): name for name, pid in table.items() if name in self.hosts}
        except (OSError, ValueError, TypeError, AttributeError):
            return

    def host_of(self, client: tuple[str, int], server_port: int) -> Host | None:
        """The host whose process owns the socket at `client` connected to `server_port`
        (blocking: /proc scans; run it off the event loop). None without an owners file."""
        if self.path is None:
            return None
        pid = None
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.raddr and tuple(c.laddr[:2]) == client and c.raddr[1] == server_port:
                pid = c.pid
                break
        if pid is None:
            return None
        try:
            chain = [pid, *(p.pid for p in psutil.Process(pid).parents())]
        except psutil.Error:
            return None
        for attempt in range(2):
            for p in chain:
                if p in self.roots:
                    return self.hosts[self.roots[p]]
            if attempt == 0:
                self._reload()
        return None


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, crossing: Crossing
) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)

    async def deliver() -> None:
        while True:
            at, data = await queue.get()
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(CHUNK)
            now = loop.time()
            at = crossing.arrival(now, len(data)) if data else now + crossing.delay_s
            await queue.put((at, data))
            if not data:
                break
        await sender
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender


@dataclass(slots=True)
class Proxy:
    routes: list[Route]
    owners: Owners
    delay_s: float  # one-way delay (s)
    unattributed: list[int] = field(default_factory=lambda: [0])  # bytes from no host

    async def serve(
        self, route: Route, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        route.host.connections_in += 1
        route.connections += 1
        peer = client_w.get_extra_info("peername")
        try:
            client = await asyncio.wait_for(
                loop.run_in_executor(
                    None, self.owners.host_of, (peer[0], peer[1]), route.listen_port
                ),
                OWNER_LOOKUP_S,
            )
        except (TimeoutError, psutil.Error, OSError):
            client = None
        if client is not None:
            client.connections_out += 1
        try:
            target_r, target_w = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", route.target_port), timeout=10
            )
        except (OSError, TimeoutError):
            client_w.close()
            return
        up = Crossing(client, route.host, self.delay_s, self.unattributed, route.bytes_in)
        down = Crossing(route.host, client, self.delay_s, self.unattributed, route.bytes_out)
        try:
            await asyncio.gather(_pipe(client_r, target_w, up), _pipe(target_r, client_w, down))
        finally:
            for w in (client_w, target_w):
                w.close()

    def stats(self) -> dict[str, object]:
        hosts = {r.host.name: r.host for r in self.routes}
        return {
            "hosts": {
                name: {
                    "bytes_up": h.up.bytes,
                    "bytes_down": h.down.bytes,
                    "connections_in": h.connections_in,
                    "connections_out": h.connections_out,
                    "routes": [
                        f"{r.listen_port}->{r.target_port}" for r in self.routes if r.host is h
                    ],
                }
                for name, h in hosts.items()
            },
            "routes": {
                f"{r.listen_port}->{r.target_port}": {
                    "host": r.host.name,
                    "bytes_in": r.bytes_in[0],
                    "bytes_out": r.bytes_out[0],
                    "connections": r.connections,
                }
                for r in self.routes
            },
            "unattributed_bytes": self.unattributed[0],
        }


def spawn(workdir: Path, name: str, args: list[str]) -> subprocess.Popen[bytes]:
    """Run this proxy as a process with `args` (its flags but `--ready-file`), logging to
    `workdir/NAME.log`; returns once every route listens."""
    from swarmlab.procs import child_env, wait_for

    ready = workdir / f"{name}.ready"
    cmd = [sys.executable, "-m", "bench.shaping_proxy", "--ready-file", str(ready), *args]
    with (workdir / f"{name}.log").open("ab") as log:
        proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())

    def started() -> bool:
        if proxy.poll() is not None:
            raise RuntimeError(f"the {name} proxy exited with {proxy.returncode}")
        return ready.exists()

    wait_for(started, f"the {name} proxy to listen", 30)
    return proxy


def stop(proxy: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Ctrl-C a proxy started by `spawn` (it writes its stats on the way out); SIGKILL
    past `timeout_s`."""
    proxy.send_signal(signal.SIGINT)
    try:
        proxy.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proxy.kill()
        proxy.wait(10)


def bypassing(real_ports: set[int], proxy_pid: int | None) -> list[str]:
    """Established connections to one of `real_ports` (ports only the proxy should dial)
    from a process other than the proxy: traffic that did not cross its link."""
    return [
        f"pid {c.pid} -> port {c.raddr[1]}"
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED
        and c.raddr
        and c.raddr[1] in real_ports
        and c.pid != proxy_pid
    ]


async def run(proxy: Proxy, ready: Path | None, stats: Path | None) -> None:
    servers = []
    for route in proxy.routes:

        def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, route: Route = route) -> None:
            task = asyncio.create_task(proxy.serve(route, r, w))
            route.tasks.add(task)
            task.add_done_callback(route.tasks.discard)

        servers.append(await asyncio.start_server(handler, "127.0.0.1", route.listen_port))
    if ready is not None:
        ready.write_text("ready\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()
    if stats is not None:
        stats.write_text(json.dumps(proxy.stats(), indent=2))


def parse_routes(specs: list[str], rate_mbit: float) -> list[Route]:
    """`HOST:LISTEN=TARGET` specs as routes, one `Host` (one link) per host name."""
    hosts: dict[str, Host] = {}
    routes = []
    rate = rate_mbit * 1e6 / 8
    for spec in specs:
        name, _, ports = spec.rpartition(":")
        listen, _, target = ports.partition("=")
        if not (name and listen.isdigit() and target.isdigit()):
            raise ValueError(f"bad route {spec!r}; want HOST:LISTEN=TARGET")
        host = hosts.setdefault(name, Host(name, Link(rate), Link(rate)))
        routes.append(Route(host, int(listen), int(target)))
    return routes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="shaping_proxy",
        description="Put each host's local TCP ports behind its own emulated link"
        " (rate per direction, one-way delay).",
    )
    p.add_argument("--rate-mbit", type=float, default=80.0, help="link rate per direction (Mbit/s)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay (ms)")
    p.add_argument(
        "--route", action="append", default=[], metavar="HOST:LISTEN=TARGET",
        help="the proxy listens on LISTEN and forwards to HOST's TARGET port",
    )  # fmt: skip
    p.add_argument("--owners", type=Path, help="JSON {host: root pid}: whose connections are whose")
    p.add_argument("--ready-file", type=Path, help="written once every route listens")
    p.add_argument("--stats", type=Path, help="bytes per host as JSON, written on exit")
    args = p.parse_args(argv)
    if args.rate_mbit <= 0 or args.delay_ms < 0:
        print("shaping_proxy: need rate > 0 and delay >= 0", file=sys.stderr)
        return 2
    try:
        routes = parse_routes(args.route, args.rate_mbit)
    except ValueError as exc:
        print(f"shaping_proxy: {exc}", file=sys.stderr)
        return 2
    hosts = {r.host.name: r.host for r in routes}
    proxy = Proxy(routes, Owners(args.owners, hosts), args.delay_ms / 1000)
    asyncio.run(run(proxy, args.ready_file, args.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
