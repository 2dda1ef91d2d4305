"""A userspace TCP proxy that shapes traffic like a consumer link: a rate and a delay.

Used by `agora bench efficiency` because the kernel here has no `sch_netem` (tc answers
"Specified qdisc kind is unknown"), so the delay cannot be added with netem. Each route
listens on a local port and forwards to a target port. Every byte crossing a route in
one direction goes through one `Link` of that direction: it is serialised at `rate`
(bytes leave no faster than rate_mbit, shared by all connections of the route and
direction) and delivered `delay` seconds later. With delay 20 ms each way a request and
its reply see a 40 ms round trip, as on the emulated link.

Run as a process: `python -m bench.shaping_proxy --rate-mbit 80 --delay-ms 20
--route LISTEN_PORT=TARGET_PORT ... --ready-file F`. It writes "ready" to the file once
every route listens, reports bytes per route on SIGINT/SIGTERM to `--stats FILE`
(JSON) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

CHUNK = 64 * 1024  # bytes read at once
QUEUE_CHUNKS = 64  # chunks buffered per direction of one connection (back-pressure)


@dataclass(slots=True)
class Link:
    """One direction of one emulated link: serialisation at a rate, then a fixed delay."""

    rate_bytes_s: float  # bytes per second
    delay_s: float  # one-way propagation delay, seconds
    free_at: float = 0.0  # loop time at which the link finishes sending what it has
    bytes: int = 0  # bytes carried

    def schedule(self, now: float, n: int) -> float:
        """Loop time at which `n` bytes handed over `now` arrive at the far end."""
        start = max(now, self.free_at)
        self.free_at = start + n / self.rate_bytes_s
        self.bytes += n
        return self.free_at + self.delay_s


@dataclass(slots=True)
class Route:
    listen_port: int
    target_port: int
    up: Link  # client -> target
    down: Link  # target -> client
    connections: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
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
            at = link.schedule(loop.time(), len(data)) if data else loop.time() + link.delay_s
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


async def _serve(
    route: Route, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
) -> None:
    route.connections += 1
    try:
        target_r, target_w = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", route.target_port), timeout=10
        )
    except (OSError, TimeoutError):
        client_w.close()
        return
    try:
        await asyncio.gather(
            _pipe(client_r, target_w, route.up), _pipe(target_r, client_w, route.down)
        )
    finally:
        for w in (client_w, target_w):
            w.close()


async def run(routes: list[Route], ready: Path | None, stats: Path | None) -> None:
    servers = []
    for route in routes:

        def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, route: Route = route) -> None:
            task = asyncio.create_task(_serve(route, r, w))
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
        stats.write_text(
            json.dumps(
                {
                    f"{r.listen_port}->{r.target_port}": {
                        "connections": r.connections,
                        "bytes_up": r.up.bytes,
                        "bytes_down": r.down.bytes,
                    }
                    for r in routes
                },
                indent=2,
            )
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="shaping_proxy",
        description="Forward local TCP ports through an emulated link (rate and delay).",
    )
    p.add_argument("--rate-mbit", type=float, default=80.0, help="link rate (Mbit/s)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay (ms)")
    p.add_argument("--route", action="append", default=[], metavar="LISTEN=TARGET", help="ports")
    p.add_argument("--ready-file", type=Path, help="written once every route listens")
    p.add_argument("--stats", type=Path, help="bytes per route as JSON, written on exit")
    args = p.parse_args(argv)
    if args.rate_mbit <= 0 or args.delay_ms < 0:
        print("shaping_proxy: need rate > 0 and delay >= 0", file=sys.stderr)
        return 2
    routes = []
    for spec in args.route:
        listen, _, target = spec.partition("=")
        if not (listen.isdigit() and target.isdigit()):
            print(f"shaping_proxy: bad route {spec!r}; want LISTEN=TARGET", file=sys.stderr)
            return 2
        rate = args.rate_mbit * 1e6 / 8
        delay = args.delay_ms / 1000
        routes.append(Route(int(listen), int(target), Link(rate, delay), Link(rate, delay)))
    asyncio.run(run(routes, args.ready_file, args.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
