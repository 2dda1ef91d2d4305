"""`agora-node` configuration: one dataclass, loaded from TOML and overridden by flags.

The TOML file may hold a `[node]` table (or the fields at top level). Environment
variables are not read here; `node.main` is the one place that reads them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.outer.settings import COMPRESSIONS
from protocol.addrs import MAX_ADDRS, announce_problem, ip_of, multiaddr_problem
from protocol.pinning import CoordinatorAddress, parse_address

PRECISIONS = ("auto", "fp32", "bf16")  # the stage's compute precision (NodeConfig.precision)


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    # HOST:PORT[#sha256:HEX] of agora-coordinator; the fingerprint pins its TLS certificate
    coordinator: str
    coordinator_fingerprint: str | None = None  # sha256:HEX pin (when `coordinator` has none)
    stage: int | None = None  # None = let the coordinator place this node
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto (bf16 autocast on a GPU that has it, fp32 elsewhere) | fp32 | bf16; with bf16 the
    # weights, gradients and AdamW state stay fp32 (autocast), only the matmuls run in bf16
    precision: str = "auto"
    recompute: bool = False  # recompute each block's activations in backward (less memory)
    # device memory this node offers the run (GiB, 2**30 bytes; None = what the device has
    # free): caps what the join reports, e.g. to share a GPU; on a CPU it is what is reported
    memory_limit_gb: float | None = None
    identity: Path = Path("~/.config/agora/node.key")  # ed25519 seed file, created on first run
    # libp2p listen multiaddr (port 0 = OS-chosen); on 0.0.0.0 / :: the node announces
    # each interface's IP instead (loopback only on a host with no other interface)
    listen: str = "/ip4/0.0.0.0/tcp/0"
    # multiaddrs other peers dial instead of the listen address's (a port your router
    # forwards here: /ip4/PUBLIC_IP/tcp/PORT); empty = the listen address's
    announce: list[str] = dataclasses.field(default_factory=list)
    no_listen: bool = False  # outbound only: reachable through a relay (circuit relay v2)
    # relay multiaddrs ending in /p2p/<id> (empty with no_listen: the coordinator's relays)
    relays: list[str] = dataclasses.field(default_factory=list)
    relay_hop: bool = False  # also serve as a circuit-relay hop for other peers
    metrics_port: int | None = None  # Prometheus endpoint port (0 = OS-chosen, None = off)
    metrics_host: str = "127.0.0.1"  # address the Prometheus endpoint listens on
    deadline: float | None = None  # unix seconds by which the node must have left
    join_token: str = ""  # for runs with auth mode "token"
    micro_batch: int = 8  # sequences per micro-batch
    seq_len: int = 128  # tokens per sequence
    in_flight: int = 4  # micro-batches stage 0 keeps in the pipeline at once
    # leases stage 0 trains at once, their windows mixed into micro-batches (count); 16
    # measured 0.06-0.15 nats of held-out loss below 8 (docs/outer-loop.md, "Data order")
    lease_pool: int = 16
    # route to the next-stage replicas paired with this one by rank (PeerView.partners)
    # while the sooner one's expected finish is at most this many times the best one's,
    # so that each pipeline of replicas trains as one model between outer rounds; it
    # helped a 2 x 2 swarm's loss, not a 4 x 2 one's (docs/outer-loop.md, "Pairing
    # replicas across stages"); 0 = the fastest replica for every micro-batch (ratio)
    route_affinity: float = 0.0
    # draw a micro-batch's windows at random from the open leases (else in lease order)
    shuffle_windows: bool = True
    inner_batch_tokens: int = 4096  # tokens per inner optimizer step (per replica)
    lr: float = 3e-3  # inner AdamW peak learning rate
    warmup_steps: int = 20  # inner steps of linear learning-rate warm-up
    weight_decay: float = 0.1  # AdamW weight decay on matrices
    request_timeout_s: float = 30.0  # seconds a downstream stage has for one micro-batch
    max_attempts: int = 4  # failed tries after which a draining node gives a micro-batch up
    activation_cache: int = 16  # micro-batches whose activations are kept for backward
    drain_timeout_s: float = 30.0  # seconds to finish in-flight work on shutdown
    max_tokens: int | None = None  # stop after committing this many tokens (None = run on)
    outer_every_steps: int = 25  # inner steps between DiLoCo outer rounds (0 = no outer loop)
    outer_compression: str = "fp16"  # pseudo-gradient codec: none | fp16 | uint8 | topk1 | topk3
    outer_port: int = 0  # TCP port the outer loop's DHT listens on (0 = OS-chosen)
    # multiaddrs the outer loop's DHT announces instead of its listen addresses (a port
    # your router forwards to outer_port); empty = its listen addresses
    outer_announce: list[str] = dataclasses.field(default_factory=list)
    outer_matchmaking_s: float = 6.0  # seconds to gather replicas for a round
    outer_timeout_s: float = 20.0  # seconds an outer round may take once a group formed
    # seconds a joiner waits for a replica's state to start coming, plus the state's bytes
    # at outer_min_rate_mb_s; on timeout it starts from the seeded init and rebases
    # onto the stage's newest state at its first round
    outer_state_timeout_s: float = 10.0
    # the slowest link an outer-loop transfer is waited for (MB/s): a state download gets
    # its bytes (theta_g and m, fp32: 304 MB for half of llama-125m) at this rate on top of
    # outer_state_timeout_s, a round its exchange (2 compressed stages) on top of
    # outer_timeout_s; a state source slower than this on average is dropped
    outer_min_rate_mb_s: float = 1.0
    # eta and mu of the outer Nesterov step, from `agora bench outer-sweep` at our short
    # rounds (H = 10-25 inner steps): DiLoCo's mu = 0.9 costs 6-32 % of eval loss there,
    # 0.7 / 0.5 was best at H = 25 (docs/outer-loop.md).
    outer_lr: float = 0.7  # eta, the outer (Nesterov) learning rate (dimensionless)
    outer_momentum: float = 0.5  # mu, the outer Nesterov momentum (dimensionless)
    # p in eta_r = eta * min(1, round tokens / target)^p; target = replicas of the stage x
    # outer_every_steps x inner_batch_tokens (docs/outer-loop.md) (dimensionless)
    outer_participation_power: float = 0.5
    # robust aggregation of outer rounds: centered clipping in groups of three or more,
    # and in groups of two each reducer bounds the other's contribution by its own (norm
    # and direction: node.diloco.pair_problem); false = the plain token-weighted mean
    # (non-finite and absurd-norm contributions are still rejected) (switch)
    outer_robust: bool = True
    # what runs the outer-loop process after the Python interpreter (argv); empty = the
    # node's own (`-m node.outer`). A chaos harness substitutes a rogue one here
    # (swarmlab.chaos.rogue_outer); nothing else should
    outer_program: list[str] = dataclasses.field(default_factory=list)
    checkpoint_dir: Path | None = None  # write stage{K}.safetensors + .json here (None = off)
    checkpoint_every_rounds: int = 1  # applied outer rounds between checkpoints (and at drain)
    events_file: Path | None = None  # append structured events here (node.events; None = off)

    def __post_init__(self) -> None:
        address = parse_address(self.coordinator, self.coordinator_fingerprint)
        if self.join_token and address.pin is None:
            raise ValueError(
                "a join token goes only to an authenticated coordinator: give --coordinator"
                f" {address.hostport}#sha256:HEX (or --coordinator-fingerprint) with the"
                " fingerprint the coordinator printed at start"
            )
        if self.stage is not None and self.stage < 0:
            raise ValueError(f"stage must be >= 0, got {self.stage}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.memory_limit_gb is not None and not 0 < self.memory_limit_gb < 1 << 20:
            raise ValueError(f"memory_limit_gb must be > 0 (GiB), got {self.memory_limit_gb}")
        for name in (
            "micro_batch",
            "seq_len",
            "in_flight",
            "inner_batch_tokens",
            "max_attempts",
            "lease_pool",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.activation_cache < self.in_flight:
            raise ValueError(
                f"activation_cache ({self.activation_cache}) must hold at least in_flight"
                f" ({self.in_flight}) micro-batches"
            )
        if self.route_affinity != 0 and not 1 <= self.route_affinity <= 1e6:
            raise ValueError(
                f"route_affinity must be 0 (off) or a ratio >= 1, got {self.route_affinity}"
            )
        if self.outer_every_steps < 0:
            raise ValueError(f"outer_every_steps must be >= 0, got {self.outer_every_steps}")
        if self.request_timeout_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if not self.outer_min_rate_mb_s > 0:
            raise ValueError(
                f"outer_min_rate_mb_s must be > 0 (MB/s), got {self.outer_min_rate_mb_s}"
            )
        if self.deadline is not None and self.deadline <= time.time():
            raise ValueError(f"deadline {self.deadline} is already in the past")
        if not 0.0 <= self.outer_participation_power <= 2.0:
            raise ValueError(
                f"outer_participation_power must be in [0, 2], got {self.outer_participation_power}"
            )
        if self.checkpoint_every_rounds < 1:
            raise ValueError(
                f"checkpoint_every_rounds must be >= 1, got {self.checkpoint_every_rounds}"
            )
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = Path(self.checkpoint_dir).expanduser()
        if self.events_file is not None:
            self.events_file = Path(self.events_file).expanduser()
        problem = multiaddr_problem(self.listen)
        if problem is None and (ip_of(self.listen) is None or "/p2p" in self.listen):
            problem = "expected /ip4/IP/tcp/PORT or /ip6/IP/tcp/PORT"
        if problem is None and self.listen.split("/")[3:4] != ["tcp"]:
            problem = "the data plane listens on TCP only"
        if problem is not None:
            raise ValueError(f"listen {self.listen!r} is not a listen address: {problem}")
        for name in ("announce", "outer_announce"):
            if len(getattr(self, name)) > MAX_ADDRS:
                raise ValueError(f"{name}: at most {MAX_ADDRS} addresses")
            for addr in getattr(self, name):
                if (bad := announce_problem(addr)) is not None:
                    raise ValueError(f"{name} {addr!r:.80}: {bad}")
        if self.announce and self.no_listen:
            raise ValueError("announce needs a listen address: it cannot go with no_listen")
        if not 0 <= self.outer_port < 65536:
            raise ValueError(f"outer_port must be in [0, 65535], got {self.outer_port}")
        if self.outer_announce and self.outer_port == 0:
            raise ValueError(
                "outer_announce needs a fixed outer_port (the port it forwards to), not 0"
            )
        if self.outer_compression not in COMPRESSIONS:
            raise ValueError(
                f"outer_compression must be one of {COMPRESSIONS}, got {self.outer_compression!r}"
            )
        if not all(isinstance(a, str) and a for a in self.outer_program):
            raise ValueError("outer_program: a list of non-empty arguments")
        if self.no_listen and self.relay_hop:
            raise ValueError("relay_hop needs inbound connections: it cannot go with no_listen")
        for relay in self.relays:
            if "/p2p/" not in relay or "/p2p-circuit" in relay:
                raise ValueError(
                    f"relay {relay!r} must be a multiaddr ending in /p2p/<relay peer id>"
                )
        self.identity = Path(self.identity).expanduser()

    @property
    def coordinator_addr(self) -> CoordinatorAddress:
        return parse_address(self.coordinator, self.coordinator_fingerprint)

    @classmethod
    def load(cls, path: Path | None, overrides: dict[str, Any]) -> NodeConfig:
        """Fields from the TOML file at `path`, then non-None `overrides` on top."""
        table: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
            table = dict(raw.get("node", raw))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(table) - known
        if unknown:
            raise ValueError(f"{path}: unknown node settings {sorted(unknown)}")
        table.update({k: v for k, v in overrides.items() if v is not None})
        if "deadline" in table and table["deadline"] is not None:
            table["deadline"] = parse_deadline(table["deadline"])
        if "coordinator" not in table:
            raise ValueError("no coordinator given: pass --coordinator HOST:PORT")
        return cls(**table)


def parse_deadline(value: Any, now: float | None = None) -> float:
    """Unix seconds, an ISO 8601 time, or `+DURATION` such as `+90s`, `+45m`, `+2h`."""
    now = time.time() if now is None else now
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    m = re.fullmatch(r"\+(\d+(?:\.\d+)?)([smh]?)", text)
    if m:
        scale = {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
        return now + float(m.group(1)) * scale
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"deadline {text!r} is not unix seconds, an ISO time or +DURATION (e.g. +2h)"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()
