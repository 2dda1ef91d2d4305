"""`agora-node`: run a training peer.

Reads its settings from `--config FILE` (TOML) with a few flags on top, creates or loads
the node identity, joins the coordinator and trains until Ctrl-C (or SIGTERM, or its
deadline), then drains: in-flight micro-batches finish, leases are released, the node
leaves and exits 0. A stop asked for at any moment of start-up is kept until the drain can
run (or, before the join, ends the start-up with exit 0); a second one exits at once (130).
A join the coordinator refuses (auth,
ban, no stage whose memory estimate fits the device: `--memory-limit`, protocol.memory)
exits 3 with the coordinator's reason. The control plane is TLS: a coordinator whose
certificate is not the pinned one (`--coordinator HOST:PORT#sha256:HEX` or
`--coordinator-fingerprint`) is refused before any request is sent (exit 4, naming both
fingerprints); a join token is never sent to an unpinned coordinator (exit 2).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

# Only the standard library is imported at module level: `main` installs its stop handler
# before trio, torch and the node's modules load, so a SIGINT during those imports is
# kept instead of killing the process with a KeyboardInterrupt traceback.
if TYPE_CHECKING:
    from node.config import NodeConfig
    from node.p2p.transport import P2PConfig
    from protocol.identity import NodeKey

log = logging.getLogger("agora.node")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class EarlyStop:
    """SIGINT/SIGTERM that arrive before the drain handler runs: remembered, not raised.

    Installed first thing in `main`; trio leaves a non-default handler alone, so it holds
    until `_run` opens its own signal receiver, which then drains at once if a stop came.
    A second signal before that exits at once, as a second Ctrl-C does later.
    """

    def __init__(self) -> None:
        self.signame: str | None = None

    def install(self) -> None:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        # A launcher may start the node with them blocked (`swarmlab.procs.spawn`), so that
        # one sent during the interpreter's start and the imports above waits: it lands here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signame is not None:
            os._exit(130)
        self.signame = signal.Signals(signum).name

    def stopped_before_join(self) -> bool:
        """True (and says so) when a stop came before the node joined: nothing to drain."""
        if self.signame is None:
            return False
        log.info("%s during start-up, before joining: exiting", self.signame)
        return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agora-node",
        description="Join an Agora run as a training peer: serve one pipeline stage, "
        "train on leased data, and leave cleanly on Ctrl-C.",
    )
    p.add_argument(
        "--coordinator", metavar="HOST:PORT[#sha256:HEX]",
        help="the run's agora-coordinator; the optional #sha256:HEX (64 hex digits, printed by"
        " agora-coordinator at start) pins its TLS certificate: a coordinator presenting"
        " another one is refused before anything is sent. Unpinned, the channel is encrypted"
        " but the coordinator unauthenticated (a warning says so), and a join token is refused",
    )  # fmt: skip
    p.add_argument(
        "--coordinator-fingerprint", metavar="sha256:HEX",
        help="the coordinator's certificate pin, when --coordinator carries none",
    )  # fmt: skip
    p.add_argument("--config", type=Path, help="TOML file with a [node] table")
    p.add_argument("--stage", default=None, help="pipeline stage: auto (default) or a number")
    p.add_argument("--device", default=None, help="auto (default), cpu, cuda or cuda:N")
    p.add_argument(
        "--precision", choices=("auto", "fp32", "bf16"), default=None,
        help="compute precision: auto (default: bf16 autocast on a GPU that supports it, fp32"
        " otherwise), fp32, or bf16 (weights, gradients and optimizer state stay fp32)",
    )  # fmt: skip
    p.add_argument(
        "--recompute", action="store_true", default=None,
        help="recompute each layer's activations during backward: less device memory for"
        " about a third more compute",
    )  # fmt: skip
    p.add_argument(
        "--memory-limit", type=float, default=None, metavar="GB",
        help="device memory to offer the run, in GiB (default: what the device has free);"
        " the coordinator places the node only on a stage whose estimate fits it",
    )  # fmt: skip
    p.add_argument(
        "--identity", type=Path, default=None,
        help="ed25519 key file, created on first run (default ~/.config/agora/node.key)",
    )  # fmt: skip
    p.add_argument(
        "--listen",
        default=None,
        help="libp2p listen multiaddr (default /ip4/0.0.0.0/tcp/0: every interface)",
    )
    p.add_argument(
        "--no-listen", action="store_true", default=None,
        help="accept no inbound connections (a compute node behind NAT): reserve a slot on"
        " the --relay relays (default: the coordinator's) and be reached through them",
    )  # fmt: skip
    p.add_argument(
        "--relay", action="append", default=None, metavar="MULTIADDR",
        help="circuit-relay v2 hop to reserve a slot on, /ip4/H/tcp/P/p2p/ID (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--relay-hop", action="store_true", default=None,
        help="also serve as a relay hop for --no-listen peers (needs a reachable --listen)",
    )  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    p.add_argument(
        "--deadline", default=None,
        help="leave before this time: unix seconds, ISO 8601, or +DURATION such as +2h",
    )  # fmt: skip
    p.add_argument(
        "--join-token", default=None,
        help="token for closed runs (auth mode token); other users see it in `ps`: prefer"
        " --join-token-file or the AGORA_JOIN_TOKEN environment variable",
    )  # fmt: skip
    p.add_argument(
        "--join-token-file", type=Path, default=None, metavar="FILE",
        help="read the join token from FILE (its first line)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=None, help="stop after committing N tokens")
    p.add_argument(
        "--outer-every-steps", type=int, default=None,
        help="inner steps between DiLoCo outer rounds (default 25; 0 disables the outer loop)",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-dir", type=Path, default=None,
        help="write the stage's global state (stage{K}.safetensors + .json) here after outer"
        " rounds and at drain (default: no checkpoints)",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint-every", type=int, default=None,
        help="applied outer rounds between checkpoints (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--events", type=Path, default=None, metavar="FILE",
        help="append structured events (joined, lease committed, round applied, draining,"
        " left, ...) to FILE as JSON lines, for programs (default: none)",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    return p.parse_args(argv)


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: no CUDA device is available")
    return requested


async def _p2p_config(cfg: NodeConfig, key: NodeKey) -> P2PConfig:
    """Data-plane settings; an outbound-only node without --relay uses the coordinator's."""
    import trio

    from node.coordinator_client import CoordinatorClient
    from node.p2p.transport import P2PConfig

    relays = list(cfg.relays)
    if cfg.no_listen and not relays:
        with trio.move_on_after(60.0):
            async with CoordinatorClient.to(cfg.coordinator_addr, key) as client:
                relays = list((await client.status()).relays)
        if not relays:
            raise ValueError(
                "--no-listen needs a relay: pass --relay MULTIADDR, or start the coordinator"
                f" {cfg.coordinator} with --relay"
            )
        log.info("using the coordinator's relays %s", relays)
    listen = [] if cfg.no_listen else [cfg.listen]
    return P2PConfig(
        listen=listen, announce=list(cfg.announce), relays=relays, relay_hop=cfg.relay_hop
    )


async def _run(cfg: NodeConfig, key: NodeKey, device: str, early: EarlyStop) -> int:
    import trio

    from node.coordinator_client import CoordinatorClient
    from node.p2p.host import Libp2pTransport
    from node.runtime import Node

    try:
        p2p = await _p2p_config(cfg, key)
    except ValueError as exc:
        print(f"agora-node: {exc}", file=sys.stderr)
        return 2
    if early.stopped_before_join():
        return 0
    # Nobody is served until the node knows the run's members (Node.run sets the filter).
    transport = Libp2pTransport(key, p2p, allow=lambda _peer: False)
    async with transport.run(), CoordinatorClient.to(cfg.coordinator_addr, key) as client:
        node = Node(cfg, transport, client, device=device)
        async with trio.open_nursery() as nursery:

            async def signals() -> None:
                with trio.open_signal_receiver(*STOP_SIGNALS) as sigs:
                    if early.signame is not None:  # a stop that came during start-up
                        log.info("%s during start-up: draining", early.signame)
                        node.drain(early.signame)
                    async for signum in sigs:
                        if node.draining:
                            log.warning("second %s: exiting now", signal.Signals(signum).name)
                            os._exit(130)
                        log.info("%s: draining; press Ctrl-C again to exit at once",
                                 signal.Signals(signum).name)  # fmt: skip
                        node.drain(signal.Signals(signum).name)

            nursery.start_soon(signals)
            await node.run()
            nursery.cancel_scope.cancel()
    return 0


def join_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--join-token, else the first line of --join-token-file, else AGORA_JOIN_TOKEN, else
    None (the config file's, if any). This is where the node reads the environment."""
    if args.join_token is not None:
        return str(args.join_token)
    if args.join_token_file is not None:
        from node.identity import read_token_file

        return read_token_file(Path(args.join_token_file))
    return environ.get("AGORA_JOIN_TOKEN") or None


def main(argv: list[str] | None = None) -> int:
    early = EarlyStop()
    early.install()
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import trio

    from node.config import NodeConfig
    from node.coordinator_client import JoinRefused
    from node.identity import load_or_create_key
    from protocol.pinning import PinMismatch

    try:
        stage = None if args.stage in (None, "auto") else int(args.stage)
        cfg = NodeConfig.load(
            args.config,
            {
                "coordinator": args.coordinator,
                "coordinator_fingerprint": args.coordinator_fingerprint,
                "stage": stage,
                "device": args.device,
                "precision": args.precision,
                "recompute": args.recompute,
                "memory_limit_gb": args.memory_limit,
                "identity": args.identity,
                "listen": args.listen,
                "no_listen": args.no_listen,
                "relays": args.relay,
                "relay_hop": args.relay_hop,
                "metrics_port": args.metrics_port,
                "deadline": args.deadline,
                "join_token": join_token(args, os.environ),
                "max_tokens": args.max_tokens,
                "outer_every_steps": args.outer_every_steps,
                "checkpoint_dir": args.checkpoint_dir,
                "checkpoint_every_rounds": args.checkpoint_every,
                "events_file": args.events,
            },
        )
        key = load_or_create_key(cfg.identity)
        device = resolve_device(cfg.device)
    except (ValueError, OSError) as exc:
        print(f"agora-node: {exc}", file=sys.stderr)
        return 2
    import torch

    if early.stopped_before_join():
        return 0
    torch.set_num_threads(int(os.environ.get("AGORA_TORCH_THREADS", "1")))
    if cfg.metrics_port is not None:
        from prometheus_client import start_http_server

        server, _ = start_http_server(cfg.metrics_port, addr=cfg.metrics_host)
        cfg.metrics_port = int(server.server_port)  # the bound port, announced in the join
        print(f"agora-node metrics on {cfg.metrics_host}:{cfg.metrics_port}", flush=True)
    try:
        return int(trio.run(_run, cfg, key, device, early))
    except (JoinRefused, PinMismatch, BaseExceptionGroup) as exc:
        if (mismatch := only(exc, PinMismatch)) is not None:
            print(f"agora-node: {mismatch}", file=sys.stderr)
            return 4
        refused = only(exc, JoinRefused)
        if refused is None:
            raise
        print(f"agora-node: the coordinator refused the join ({refused.code}): {refused.detail}",
              file=sys.stderr)  # fmt: skip
        return 3


E = TypeVar("E", bound=BaseException)


def only(exc: BaseException, kind: type[E]) -> E | None:
    """The `kind` exception that `exc` is or (within task groups) consists of, else None."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [only(e, kind) for e in exc.exceptions]
        if found and all(f is not None for f in found):
            return found[0]
    return None


if __name__ == "__main__":
    sys.exit(main())
