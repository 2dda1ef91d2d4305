"""`agora-coordinator`: run the control plane (membership, placement, DARL leases).

Prints `agora-coordinator listening on HOST:PORT` once it serves (and writes the port to
`--port-file`), so scripts can start it with `--port 0`. The port speaks TLS only; the
certificate's fingerprint is printed (`agora-coordinator certificate sha256:...`) and,
with `--events FILE`, written as the JSON line `{"t", "event": "listening", "host",
"port", "fingerprint", "cert", "address"}` (`address` is `HOST:PORT#sha256:HEX`, what
nodes are given) before the port file, so programs read the pin from there, never from
the log.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
import time
from pathlib import Path

from coordinator.config import CoordinatorConfig, load_config
from coordinator.dataset import load_dataset, load_tokenizer
from coordinator.metrics import CoordinatorMetrics
from coordinator.relay_child import RelayChild, RelayStartError
from coordinator.server import CoordinatorServer
from coordinator.store import SQLiteStore
from coordinator.tls import credit_key, load_identity, server_context
from protocol.pinning import CoordinatorAddress

log = logging.getLogger("coordinator")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agora-coordinator",
        description="Run an Agora coordinator: membership, stage placement, DARL data leases"
        " and the shard server, durable in SQLite. Without --config it runs a local default"
        " (embedded stdlib corpus, preset 'small', 2 stages, codec subspace_int4). Flags"
        " override the config file. Secrets can come from AGORA_JOIN_TOKEN and"
        " AGORA_ADMIN_TOKEN.",
    )
    p.add_argument("--config", type=Path, help="run.toml with the run configuration")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port; 0 lets the OS choose (default 7700)")
    p.add_argument("--port-file", help="write the bound port to this file")
    p.add_argument("--db", help="SQLite database file (default coordinator.sqlite)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--prometheus-sd", help="write a Prometheus file-SD JSON of node endpoints")
    p.add_argument("--auth", choices=("open", "token", "allowlist"), help="join policy")
    p.add_argument("--run-id", help="run name")
    p.add_argument("--n-stages", type=int, help="pipeline stages")
    p.add_argument(
        "--dataset",
        help="'stdlib', a directory of text files, a .jsonl, a .parquet file or a directory"
        " of them, or a directory written by datasets' save_to_disk",
    )
    p.add_argument("--text-column", help="the column (or .jsonl key) holding text (default text)")
    p.add_argument(
        "--tokenizer",
        help="'bytes' (default) or a tokenizer.json (agora tokenizer train); served to nodes",
    )
    p.add_argument("--shard-tokens", type=int, help="tokens per shard")
    p.add_argument("--lease-ttl", dest="lease_ttl_s", type=float, help="lease/peer TTL, s")
    p.add_argument(
        "--heartbeat-interval", dest="heartbeat_interval_s", type=float, help="heartbeat, s"
    )
    p.add_argument("--sync", choices=("full", "normal"), help="SQLite durability level")
    p.add_argument("--max-connections", type=int, help="concurrent connection limit")
    p.add_argument(
        "--relay", action="store_true", default=None,
        help="also run a circuit-relay v2 hop (python -m node.p2p.relay_main) on --host for"
        " nodes started with --no-listen; its address is handed to them",
    )  # fmt: skip
    p.add_argument("--relay-port", type=int, help="relay listen port (default 0: OS-chosen)")
    p.add_argument(
        "--tls-cert", help="PEM certificate for the control port (with --tls-key; default: a"
        " self-signed one made once beside --db as DB.tls-cert.pem / DB.tls-key.pem, mode 0600)",
    )  # fmt: skip
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument(
        "--events", type=Path,
        help="append structured events (JSON lines) here: `listening` with the port and the"
        " certificate fingerprint nodes pin",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p.parse_args(argv)


def write_event(path: Path, event: str, **fields: object) -> None:
    """Append one structured event (`{"t", "event", ...}`) as a JSON line."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")


async def serve(cfg: CoordinatorConfig, events: Path | None = None) -> int:
    relay = None
    if cfg.relay:
        relay = await RelayChild.start(
            host=cfg.host,
            port=cfg.relay_port,
            identity=Path(cfg.db).with_name(Path(cfg.db).name + ".relay.key"),
            announce=cfg.relay_announce,
            limits={
                "circuit-bytes": cfg.relay_circuit_bytes,
                "circuit-duration": cfg.relay_circuit_duration_s,
                "reservation-ttl": cfg.relay_reservation_ttl_s,
            },
        )
        cfg.relays = [*relay.addrs, *cfg.relays]
        print(f"agora-coordinator relay at {' '.join(relay.addrs)}", flush=True)
    try:
        return await _serve(cfg, relay, events)
    finally:
        if relay is not None:
            await relay.stop()


async def _serve(cfg: CoordinatorConfig, relay: RelayChild | None, events: Path | None) -> int:
    tls = load_identity(cfg)
    tokenizer = load_tokenizer(cfg)
    if len(tokenizer.json) + 4096 > cfg.max_frame_bytes:
        raise ValueError(
            f"tokenizer {cfg.tokenizer} ({len(tokenizer.json)} bytes) does not fit a reply"
            f" frame: raise max_frame_bytes above {len(tokenizer.json) + 4096}"
        )
    log.info("loading dataset %s (tokenizer %s)", cfg.dataset, tokenizer.name)
    manifest, corpus = await asyncio.to_thread(load_dataset, cfg, tokenizer)
    metrics = CoordinatorMetrics()
    store = SQLiteStore(cfg.db, sync=cfg.sync)
    server = CoordinatorServer(
        cfg,
        store=store,
        manifest=manifest,
        corpus=corpus,
        metrics=metrics,
        tokenizer_json=tokenizer.json,
        tls=server_context(tls.cert, tls.key),
        fingerprint=tls.fingerprint,
        credit_key=credit_key(tls.key),
    )
    port = await server.start()
    # What is loaded by now (modules, config, manifest, restored peers and leases) lives
    # as long as the process, or is freed by reference counting: moved out of the
    # cyclic GC's view, it no longer lengthens every full collection (pauses that
    # were the p99 of heartbeats at 25,000 peers: docs/scale.md)
    gc.freeze()
    follow = None
    if relay is not None:  # the relay serves the live members only
        membership = server.service.membership
        follow = asyncio.create_task(
            relay.follow(lambda: (membership.version, list(membership.live)), cfg.sweep_interval_s)
        )
    if cfg.metrics_port is not None:
        mport = metrics.serve(cfg.metrics_host, cfg.metrics_port)
        print(f"agora-coordinator metrics on {cfg.metrics_host}:{mport}", flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    address = CoordinatorAddress(host=cfg.host, port=port, pin=tls.fingerprint)
    log.info(
        "TLS certificate %s (%s), fingerprint %s",
        tls.cert,
        "generated now" if tls.generated else "loaded",
        tls.fingerprint,
    )
    if events is not None:
        write_event(
            events, "listening", host=cfg.host, port=port, fingerprint=tls.fingerprint,
            cert=str(tls.cert), address=str(address),
        )  # fmt: skip
    if cfg.port_file:
        Path(cfg.port_file).write_text(f"{port}\n")
    log.info(
        "run %s: %d stages, dataset %s (%d training shards, %d tokens), db %s",
        cfg.run_id,
        cfg.n_stages,
        manifest.name,
        len(manifest.train),
        manifest.total_tokens,
        cfg.db,
    )
    print(f"agora-coordinator certificate {tls.fingerprint}", flush=True)
    print(f"agora-coordinator listening on {cfg.host}:{port} (nodes: {address})", flush=True)
    await server.wait_stopped()
    if follow is not None:
        follow.cancel()
    failed = server.commits.failed
    log.info("shutting down")
    await server.close()
    return 1 if failed is not None else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    overrides = {
        k: getattr(args, k)
        for k in (
            "host",
            "port",
            "port_file",
            "db",
            "metrics_port",
            "prometheus_sd",
            "auth",
            "run_id",
            "n_stages",
            "dataset",
            "text_column",
            "tokenizer",
            "shard_tokens",
            "lease_ttl_s",
            "heartbeat_interval_s",
            "sync",
            "max_connections",
            "relay",
            "relay_port",
            "tls_cert",
            "tls_key",
        )
    }
    try:
        cfg = load_config(args.config, overrides)
    except (OSError, ValueError) as exc:
        print(f"agora-coordinator: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(serve(cfg, args.events))
    except (ValueError, RelayStartError) as exc:
        print(f"agora-coordinator: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
