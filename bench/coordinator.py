"""`agora bench coordinator --peers N --json FILE`: control-plane load test.

Starts a real coordinator process (SQLite, `sync=full`: every group commit fsynced before
the replies that depend on it go out; heartbeats that only renew liveness write nothing)
and `--procs` client processes over real sockets. Each client process
multiplexes its share of the N simulated peers over a few pipelined TLS connections
(`node.control_tls`, pinned to the coordinator's certificate): all
peers join, then each heartbeats once per `--interval` seconds, while `--lease-peers`
peers per process loop acquire -> 4 commits -> next lease. Each peer's join is signed for
the coordinator's certificate, which proves its key on that connection; while the
coordinator keeps proven keys (`--session-keys`, not 0) the peer's later requests go with
a zero signature, since nobody checks them: the load generator spends its CPU on load,
not on signatures (a real node signs every request, at its own cost). Reported: sustained
heartbeats/s and lease ops/s (successful replies only; error replies are counted apart,
by kind and code), p50/p99 latency (send to reply) of heartbeats and of lease operations
separately (a percentile from fewer than `MIN_SAMPLES` replies is null, never a guess),
and `restart_s`, the seconds from spawning a coordinator on the same database after
SIGKILL to its first answer.

`--capacity` finds what the coordinator can take rather than what was offered: it runs
the load at rising heartbeat rates (doubling from `--capacity-from`, same peers) and
reports `capacity_hb_per_s`, the highest offered rate whose heartbeats were all answered
(at least 99 % of the offer) with a p99 under `--p99-goal-ms`, with every step's figures.
On a machine with at least 2 CPUs the coordinator is pinned to CPU 0 and the load
generators to the others (`--no-pin` turns it off), so the two do not share a core.

CPU is reported apart for the two sides over the measured window (`coordinator_cpu`
and `clients_cpu`, in cores: CPU seconds per wall second), so a saturated load
generator is told apart from a saturated coordinator; `join_s` is how long the N joins
took. Coordinator CPU is read from /proc (Linux; None elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from node.control_tls import open_asyncio
from protocol import control as c
from protocol.codec import encode
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import SIGNATURE_SIZE, NodeKey
from protocol.message import Message
from protocol.pinning import CoordinatorAddress, parse_address
from protocol.signing import NONCE_SIZE, SignedRequest, sign_request
from swarmlab.configs import write_toml
from swarmlab.coordinator import CoordinatorProc, start_coordinator
from swarmlab.procs import child_env

REPO = Path(__file__).resolve().parent.parent
RUN_ID = "bench-coordinator"  # the bench coordinator's run; requests are signed for it
MIN_SAMPLES = 100  # replies a p50/p99 needs; fewer give null
P99_GOAL_MS = 50.0  # the latency a rate must keep to count as within capacity (ms)
ANSWERED = 0.99  # fraction of the offered heartbeats that must be answered (capacity)


class Conn:
    """One pipelined connection: replies come back in request order."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cert: str
    ) -> None:
        self.reader, self.writer = reader, writer
        self.cert = cert  # the coordinator certificate's fingerprint: requests are bound to it
        self.pending: collections.deque[tuple[float, asyncio.Future[Message] | None, str]] = (
            collections.deque()
        )
        self.lat: dict[str, list[float]] = collections.defaultdict(list)  # kind -> s
        self.counts: collections.Counter[str] = collections.Counter()  # kind -> successes
        self.errors: collections.Counter[str] = collections.Counter()  # "kind:code" -> n
        self.measure = False

    def send(self, key: NodeKey, body: Message, kind: str, want: bool = False, signed: bool = True):  # type: ignore[no-untyped-def]
        """Queue one request. `signed=False` sends a zero signature: only for a key that
        proved itself on this connection (its join), which the coordinator does not check
        again, so the load generator spends no CPU on signatures nobody reads."""
        fut = asyncio.get_running_loop().create_future() if want else None
        self.pending.append((time.perf_counter(), fut, kind))
        if signed:
            req = sign_request(key, body, now=time.time(), run=RUN_ID, cert=self.cert)
        else:
            req = SignedRequest(
                key=key.public_key, ts=time.time(), nonce=secrets.token_bytes(NONCE_SIZE),
                body=encode(body), sig=bytes(SIGNATURE_SIZE), bound=True,
            )  # fmt: skip
        self.writer.write(frame_message(req))
        return fut

    async def read_loop(self) -> None:
        dec = FrameDecoder()
        while data := await self.reader.read(1 << 16):
            for msg in dec.feed_messages(data):
                t0, fut, kind = self.pending.popleft()
                if self.measure:
                    if isinstance(msg, c.ErrorReply):
                        self.errors[f"{kind}:{msg.code}"] += 1
                    else:
                        self.lat[kind].append(time.perf_counter() - t0)
                        self.counts[kind] += 1
                if fut is not None and not fut.done():
                    fut.set_result(msg)


async def worker(
    address: CoordinatorAddress,
    n: int,
    conns: int,
    interval: float,
    duration: float,
    lease_peers: int,
    proven: bool,
) -> dict[str, object]:
    """One load generator: `n` peers over `conns` connections. With `proven` (the
    coordinator keeps proven keys) every request after a peer's join goes unsigned."""
    keys = [NodeKey.generate() for _ in range(n)]
    signed = not proven
    t_join = time.perf_counter()
    cs = []
    for _ in range(conns):
        cs.append(Conn(*await open_asyncio(address.host, address.port, address.pin)))
    readers = [asyncio.create_task(x.read_loop()) for x in cs]
    joins = []
    for i, k in enumerate(keys):
        joins.append(cs[i % conns].send(k, c.JoinRequest(throughput=1000.0), "join", want=True))
        if i % 200 == 199:
            await asyncio.gather(*joins)
            joins = []
    await asyncio.gather(*joins)
    join_s = time.perf_counter() - t_join
    for x in cs:
        x.measure = True
    stop = time.perf_counter() + duration
    wall0, cpu0 = time.time(), _cpu_self()

    async def lease_loop(i: int) -> None:
        key, conn = keys[i], cs[i % conns]
        while time.perf_counter() < stop:
            g = await conn.send(
                key, c.LeaseAcquire(max_tokens=4096), "lease", want=True, signed=signed
            )
            if not isinstance(g, c.LeaseGrant) or g.lease is None:
                await asyncio.sleep(0.1)
                continue
            lease, step = g.lease, max(1, (g.lease.limit - g.lease.committed) // 4)
            pos = lease.committed
            while pos < lease.limit:
                end = min(lease.limit, pos + step)
                body = c.LeaseCommit(lease_id=lease.lease_id, epoch=lease.epoch, start=pos, end=end)
                await conn.send(key, body, "lease", want=True, signed=signed)
                pos = end

    async def heartbeats() -> None:
        per_tick, tick = n / interval * 0.02, 0.02
        credit, idx = 0.0, 0
        nxt = time.perf_counter()
        while time.perf_counter() < stop:
            credit += per_tick
            while credit >= 1:
                credit -= 1
                conn = cs[idx % conns]
                conn.send(keys[idx], c.HeartbeatRequest(), "heartbeat", signed=signed)
                idx = (idx + 1) % n
            nxt += tick
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))

    t0 = time.perf_counter()
    await asyncio.gather(heartbeats(), *(lease_loop(i) for i in range(min(lease_peers, n))))
    sent_s = time.perf_counter() - t0  # the load's own window; replies may come after it
    deadline = time.perf_counter() + 10
    while any(x.pending for x in cs) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - t0
    wall1, cpu1 = time.time(), _cpu_self()
    for x in cs:
        x.writer.close()
    for t in readers:
        t.cancel()
    counts: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    lat: dict[str, list[float]] = collections.defaultdict(list)
    for x in cs:
        counts.update(x.counts)
        errors.update(x.errors)
        for kind, values in x.lat.items():
            lat[kind] += values
    return {
        "elapsed": elapsed,
        "sent_s": sent_s,
        "counts": dict(counts),
        "errors": dict(errors),
        "lat": lat,
        "join_s": join_s,
        "window": [wall0, wall1],
        "cpu_s": cpu1 - cpu0,
    }


def verify_backend() -> str:
    """The ed25519 implementation the coordinator (same interpreter) verifies with."""
    try:
        from coordinator.verify import BACKEND
    except ImportError:  # a coordinator from before coordinator/verify.py
        return "openssl"
    return BACKEND


def _cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _cpu_of(pid: int) -> float | None:
    """CPU seconds (user + system) of a process, from /proc; None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_at(samples: list[tuple[float, float]], t: float) -> float | None:
    """Linear interpolation of sampled (wall time, CPU seconds) at `t`."""
    for (ta, ca), (tb, cb) in zip(samples, samples[1:], strict=False):
        if ta <= t <= tb:
            return ca + (cb - ca) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
    return None


def percentiles(samples: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99) in ms of latencies in seconds; (None, None) below MIN_SAMPLES."""
    if len(samples) < MIN_SAMPLES:
        return None, None
    q = statistics.quantiles(samples, n=100)
    return q[49] * 1000, q[98] * 1000


def within_capacity(step: dict[str, Any], goal_ms: float) -> bool:
    """Whether a load step kept up: its heartbeats answered and their p99 under the goal."""
    p99 = step["heartbeat_p99_ms"]
    answered = step["heartbeats_per_s"] >= ANSWERED * step["target_heartbeats_per_s"]
    return p99 is not None and p99 < goal_ms and answered


def capacity(steps: list[dict[str, Any]], goal_ms: float) -> float | None:
    """The highest offered heartbeat rate of the steps that stayed within capacity."""
    ok = [s["target_heartbeats_per_s"] for s in steps if within_capacity(s, goal_ms)]
    return max(ok) if ok else None


def _pin(pid: int, cpus: set[int]) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(pid, cpus)


def run_worker(argv: list[str]) -> int:
    address, n, conns, interval, duration, lease_peers, proven, out_path = argv
    import uvloop

    out = uvloop.run(
        worker(
            parse_address(address),
            int(n),
            int(conns),
            float(interval),
            float(duration),
            int(lease_peers),
            proven == "1",
        )
    )
    Path(out_path).write_text(json.dumps(out))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora bench coordinator", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--peers", type=int, default=2000, help="simulated peers (2000)")
    p.add_argument("--procs", type=int, default=2, help="client processes (2)")
    p.add_argument("--conns", type=int, default=8, help="connections per client process (8)")
    p.add_argument("--interval", type=float, default=5.0, help="heartbeat interval per peer, s (5)")
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds (30)")
    p.add_argument("--lease-peers", type=int, default=20, help="lease-looping peers per process")
    p.add_argument("--sync", choices=("full", "normal"), default="full", help="SQLite sync level")
    p.add_argument(
        "--verify-threads", type=int, help="coordinator signature-check threads (its default)"
    )
    p.add_argument(
        "--session-keys", type=int,
        help="keys a connection may prove and then send unchecked (its default; 0: check all)",
    )  # fmt: skip
    p.add_argument(
        "--capacity", action="store_true",
        help="find the highest heartbeat rate whose p99 stays under --p99-goal-ms",
    )  # fmt: skip
    p.add_argument(
        "--capacity-from", type=float, default=500.0,
        help="first offered heartbeat rate of --capacity, per s (500); doubled each step",
    )  # fmt: skip
    p.add_argument("--capacity-steps", type=int, default=6, help="most --capacity steps (6)")
    p.add_argument("--p99-goal-ms", type=float, default=P99_GOAL_MS, help="p99 goal, ms (50)")
    p.add_argument("--no-pin", action="store_true", help="do not pin coordinator and clients")
    p.add_argument("--json", type=Path, help="write the results here")
    return p


def measure(args: argparse.Namespace, interval: float) -> dict[str, Any]:
    """One load step: a fresh coordinator, `args.peers` peers heartbeating every
    `interval` s for `args.duration` s, then a SIGKILL and a timed restart."""
    env = child_env()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = not args.no_pin and len(cpus) >= 2
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        data = tmp / "data"
        data.mkdir()
        (data / "a.txt").write_bytes(os.urandom(3 << 20).hex().encode()[: 4 << 20])
        config = write_toml(
            tmp / "run.toml",
            {
                "run_id": RUN_ID,
                "dataset": str(data),
                "shard_tokens": 16384,
                "heartbeat_interval_s": interval,
                "lease_ttl_s": max(30.0, 4 * interval),
                "sync": args.sync,
                "rate_per_peer": 1000.0,
                "rate_burst": 1000.0,
                # every simulated peer is on 127.0.0.1: no per-host rate or connection cap
                "rate_per_host": 0.0,
                "max_connections_per_host": 100_000,
                "max_leases_per_peer": 4,
                "min_grant_tokens": 1,
                "verify_threads": args.verify_threads,  # None: the coordinator's default
                "session_keys": args.session_keys,
            },
        )
        db = tmp / "bench.sqlite"

        def start() -> CoordinatorProc:
            return start_coordinator(
                tmp, config=config, db=db, args=["--log-level", "WARNING"], env=env,
                timeout_s=120,
            )  # fmt: skip

        coord = start()
        proc = coord.popen
        if pin:
            _pin(proc.pid, {cpus[0]})
        per = [
            args.peers // args.procs + (1 if i < args.peers % args.procs else 0)
            for i in range(args.procs)
        ]
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.coordinator",
                    "--worker",
                    coord.address,
                    str(n),
                    str(args.conns),
                    str(interval),
                    str(args.duration),
                    str(args.lease_peers),
                    "0" if args.session_keys == 0 else "1",
                    str(tmp / f"w{i}.json"),
                ],
                cwd=REPO,
                env=env,
            )  # fmt: skip
            for i, n in enumerate(per)
        ]
        if pin:
            for w in workers:
                _pin(w.pid, set(cpus[1:]))
        results = []
        samples: list[tuple[float, float]] = []  # (wall time, coordinator CPU seconds)
        give_up = time.monotonic() + args.duration + 600
        while any(w.poll() is None for w in workers):
            cpu = _cpu_of(proc.pid)
            if cpu is not None:
                samples.append((time.time(), cpu))
            if time.monotonic() > give_up:
                raise RuntimeError("bench workers did not finish in time")
            time.sleep(0.25)
        for i, w in enumerate(workers):
            if w.returncode != 0:
                raise RuntimeError(f"bench worker {i} failed with exit code {w.returncode}")
            results.append(json.loads((tmp / f"w{i}.json").read_text()))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.perf_counter()
        coord2 = start()
        proc2 = coord2.popen
        from swarmlab.status import fetch_status

        while True:
            try:
                st, _ = fetch_status(coord2.pinned, timeout_s=5)
                break
            except OSError:
                time.sleep(0.01)
        restart_s = time.perf_counter() - t0
        proc2.send_signal(signal.SIGTERM)
        proc2.wait(timeout=60)
    elapsed = max(float(r["elapsed"]) for r in results)
    # rates over the window the load was offered in (the replies still in flight at its
    # end are counted: they answer requests sent within it)
    window = max(float(r["sent_s"]) for r in results)
    counts: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    lat: dict[str, list[float]] = collections.defaultdict(list)
    for r in results:
        counts.update(r["counts"])
        errors.update(r["errors"])
        for kind, values in r["lat"].items():
            lat[kind] += values
    hb50, hb99 = percentiles(lat["heartbeat"])
    lease50, lease99 = percentiles(lat["lease"])
    w0 = max(float(r["window"][0]) for r in results)
    w1 = min(float(r["window"][1]) for r in results)
    c0, c1 = _cpu_at(samples, w0), _cpu_at(samples, w1)
    coord_cpu = (c1 - c0) / (w1 - w0) if c0 is not None and c1 is not None and w1 > w0 else None
    clients_cpu = sum(float(r["cpu_s"]) / float(r["elapsed"]) for r in results)
    answered = sum(counts.values())
    return {
        "peers": args.peers,
        "interval_s": interval,
        "target_heartbeats_per_s": args.peers / interval,
        "peers_after_restart": st.peers,
        "heartbeats_per_s": counts["heartbeat"] / window,
        "lease_ops_per_s": counts["lease"] / window,
        "heartbeat_p50_ms": hb50,
        "heartbeat_p99_ms": hb99,
        "lease_p50_ms": lease50,
        "lease_p99_ms": lease99,
        "heartbeat_samples": len(lat["heartbeat"]),
        "lease_samples": len(lat["lease"]),
        "restart_s": restart_s,
        "duration_s": elapsed,
        "join_s": max(float(r["join_s"]) for r in results),
        "coordinator_cpu": coord_cpu,
        "clients_cpu": clients_cpu,
        # coordinator CPU per successful reply (all kinds), microseconds
        "coordinator_cpu_us_per_req": (
            coord_cpu / (answered / window) * 1e6 if coord_cpu is not None and answered else None
        ),
        "errors": dict(errors),
        "pinned": pin,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return run_worker(argv[1:])
    args = _parser().parse_args(argv)
    if args.capacity:
        steps = []
        rate = args.capacity_from
        for _ in range(args.capacity_steps):
            step = measure(args, args.peers / rate)
            steps.append(step)
            print(
                f"offered {rate:.0f} heartbeats/s: answered {step['heartbeats_per_s']:.0f}/s,"
                f" p99 {step['heartbeat_p99_ms']} ms", flush=True,
            )  # fmt: skip
            if not within_capacity(step, args.p99_goal_ms):
                break
            rate *= 2
        out = {
            "capacity_hb_per_s": capacity(steps, args.p99_goal_ms),
            "p99_goal_ms": args.p99_goal_ms,
            "steps": steps,
        }
        at_interval = measure(args, args.interval)
        out |= {"p99_ms": at_interval["heartbeat_p99_ms"], "at_interval": at_interval}
    else:
        out = measure(args, args.interval)
        out["p99_ms"] = out["heartbeat_p99_ms"]
    out |= {
        "verify_backend": verify_backend(),
        "sync": args.sync,
        "verify_threads": args.verify_threads,
        "session_keys": args.session_keys,
        "procs": args.procs,
        "conns_per_proc": args.conns,
        "min_samples": MIN_SAMPLES,
    }
    from rich.console import Console
    from rich.table import Table

    table = Table(title="agora bench coordinator")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in out.items():
        if k in ("steps", "at_interval"):
            continue
        table.add_row(k, f"{v:.2f}" if isinstance(v, float) else str(v))
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
