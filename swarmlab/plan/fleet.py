"""What `agora plan` simulates: the fleet (device classes, peer groups and their links),
churn, the coordinator's timings and the node settings, loaded from a TOML file.

A fleet file looks like this (every table but `[[group]]` is optional):

    [[group]]                 # peers alike; repeat the table for each kind of peer
    count = 330
    device = "rtx4090"        # a DEVICES name, or "cpu" (the measured CPU profile)
    up_mbit = 80              # uplink (Mbit/s)
    down_mbit = 80            # downlink (Mbit/s)
    rtt_ms = [40, 200]        # RTT to a typical other peer: one value or [low, high]
    loss = 0.0                # packet loss (fraction), caps TCP throughput (Mathis)
    relayed = 0.1             # share of the group reachable only through the relay

    [churn]
    mean_session_min = 240    # a peer's mean time in the run (minutes; 0 = no churn)
    kill_share = 0.3          # departures that are SIGKILLs (connections reset)
    vanish_share = 0.2        # departures where the host vanishes (requests time out)
                              # the rest drain and leave cleanly

    [node]                    # agora-node settings (node/config.py names)
    micro_batch = 8
    seq_len = 128

Nothing here reads the clock or the network; `load_fleet` validates every field once.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Published dense bf16/fp16 tensor throughput (TFLOPS, with fp32 accumulation) and
# memory. `mfu` is an assumed model-FLOPs utilisation, not a measurement: these rows are
# the vendors' figures, labelled as such in every report.
DEVICES: dict[str, dict[str, float]] = {
    "rtx3090": {"tflops": 71.0, "memory_gb": 24.0, "mem_gbps": 936.0, "mfu": 0.35},
    "rtx4090": {"tflops": 165.2, "memory_gb": 24.0, "mem_gbps": 1008.0, "mfu": 0.35},
    "a100": {"tflops": 312.0, "memory_gb": 80.0, "mem_gbps": 2039.0, "mfu": 0.45},
    "h100": {"tflops": 989.0, "memory_gb": 80.0, "mem_gbps": 3350.0, "mfu": 0.45},
    "h200": {"tflops": 989.0, "memory_gb": 141.0, "mem_gbps": 4800.0, "mfu": 0.45},
}
DEVICE_SOURCE = (
    "vendor datasheets: dense bf16/fp16 tensor TFLOPS with fp32 accumulate and memory"
    " bandwidth (GA102 and AD102 whitepapers, A100/H100/H200 SXM datasheets); MFU assumed"
)


@dataclass(kw_only=True, slots=True)
class PeerGroup:
    count: int  # peers in the group
    device: str = "cpu"  # a DEVICES name, or cpu (the measured profile)
    up_mbit: float = 80.0  # uplink (Mbit/s)
    down_mbit: float = 80.0  # downlink (Mbit/s)
    rtt_ms: tuple[float, float] = (40.0, 40.0)  # RTT range to a typical peer (ms)
    loss: float = 0.0  # packet loss (fraction)
    relayed: float = 0.0  # share reachable only through the relay (fraction)
    host: str = ""  # peers naming the same host share its `host_cores` (loopback runs)


@dataclass(kw_only=True, slots=True)
class Churn:
    mean_session_min: float = 0.0  # mean time a peer stays (minutes; 0 = nobody leaves)
    kill_share: float = 0.3  # departures by SIGKILL: peers see a reset within one RTT
    vanish_share: float = 0.2  # departures by a vanished host: requests time out
    startup_s: float = 60.0  # process start, model build and join of a new peer (s)
    # scripted departures: (seconds into the run, stage) kills one replica of the stage
    kills: tuple[tuple[float, int], ...] = ()


@dataclass(kw_only=True, slots=True)
class Timings:
    heartbeat_s: float = 3.0  # node heartbeat and membership refresh interval (s)
    lease_ttl_s: float = 15.0  # lease and peer TTL (s)
    sweep_s: float = 0.5  # coordinator expiry sweep interval (s)
    grant_tokens: int = 8192  # tokens per granted lease range
    request_timeout_s: float = 30.0  # a downstream stage's time for one micro-batch (s)
    # from a SIGKILL to the victim's connections being reset (the kernel closes them as
    # the process is torn down): `agora bench failover` measured 0.03-0.04 s on loopback
    # once a dial to a dead peer failed at its first refusal (docs/reliability.md) (s)
    kill_detect_s: float = 0.03
    relay_rtt_ms: float = 60.0  # extra RTT through the relay (ms)
    relay_mbit: float = 100.0  # cap on a relayed peer's bandwidth, each way (Mbit/s)
    host_cores: int = 2  # cores of a shared host (`PeerGroup.host`) (count)
    # CPU a node spends on each pipeline message it receives outside torch (py-libp2p,
    # msgpack, trio, device copies), serialised with its compute. Fitted, together with
    # msg_cpu_s_per_mb, to four swarms on an H200 box (docs/gpu.md); `--validate`
    # calibrates its own for CPU peers (0.037-0.039 on the 2-core box, docs/plan.md) (s)
    msg_cpu_s: float = 0.08
    # CPU per MB of a pipeline message, both ends together (encode, framing, py-libp2p's
    # Noise and Yamux, decode), charged to its receiver's worker like msg_cpu_s (fitted
    # with it: docs/gpu.md) (s per MB)
    msg_cpu_s_per_mb: float = 0.022
    # always-runnable threads each node's outer process and p2p daemon add to a shared
    # host (count). `agora plan --validate` calibrates it on a 2 x 1 swarm; this default
    # is that calibration on this machine since the outer loop's matchmaking is paced
    # (0.025 of a core a node; it was 0.66, about one thread, before: docs/scale.md)
    node_bg_threads: float = 0.025
    # extra CPU the same work costs on a shared host per runnable thread beyond its cores,
    # per core (switching, caches): 0 charges every task the profile's cost. `agora plan
    # --validate` fits it on a 4 x 1 swarm (docs/plan.md) (fraction)
    cpu_contention: float = 0.0


@dataclass(kw_only=True, slots=True)
class NodeSettings:
    micro_batch: int = 8  # sequences per micro-batch
    seq_len: int = 128  # tokens per sequence
    in_flight: int = 4  # micro-batches a stage-0 node keeps in the pipeline
    lease_pool: int = 16  # leases a stage-0 node keeps open (the node's `lease_pool`)
    activation_cache: int = 16  # micro-batches whose activations a stage keeps (memory)
    recompute: bool = False  # recompute activations in backward: less memory, +1 forward
    inner_batch_tokens: int = 4096  # tokens per inner step
    outer_every_steps: int = 25  # inner steps per outer round (0 = no outer loop)
    # seconds a group gathers before its round at most (from its first member's start:
    # hivemind's min_matchmaking_time), closing early once every replica the stage lists
    # is in; a replica that finds no groupmate steps alone after twice that plus 1 s (the
    # node's averaging timeout)
    outer_matchmaking_s: float = 6.0
    outer_group_size: int = 8  # the largest group (target_group_size)
    outer_bytes_per_param: float = 2.0  # pseudo-gradient codec (fp16: 2, uint8: ~1)
    codec: str = "subspace_int4"  # boundary codec
    precision: str = "bf16"  # GPU compute precision (the CPU profile is fp32)


@dataclass(kw_only=True, slots=True)
class Fleet:
    groups: list[PeerGroup]
    churn: Churn = field(default_factory=Churn)
    timings: Timings = field(default_factory=Timings)
    node: NodeSettings = field(default_factory=NodeSettings)

    @property
    def n_peers(self) -> int:
        return sum(g.count for g in self.groups)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("fleet: at least one [[group]] of peers is needed")
        for i, g in enumerate(self.groups):
            where = f"fleet group {i}"
            if g.count < 1:
                raise ValueError(f"{where}: count={g.count} must be >= 1")
            if g.device != "cpu" and g.device not in DEVICES:
                raise ValueError(
                    f"{where}: device={g.device!r} is not cpu or one of {sorted(DEVICES)}"
                )
            if g.up_mbit <= 0 or g.down_mbit <= 0:
                raise ValueError(f"{where}: up_mbit and down_mbit must be > 0")
            lo, hi = g.rtt_ms
            if not 0 <= lo <= hi < math.inf:
                raise ValueError(f"{where}: rtt_ms={list(g.rtt_ms)} must be 0 <= low <= high")
            if not 0 <= g.loss < 0.5 or not 0 <= g.relayed <= 1:
                raise ValueError(f"{where}: loss must be in [0, 0.5), relayed in [0, 1]")
        c = self.churn
        if c.mean_session_min < 0 or not 0 <= c.kill_share + c.vanish_share <= 1:
            raise ValueError("fleet churn: mean_session_min >= 0, kill + vanish shares <= 1")
        n = self.node
        if min(n.micro_batch, n.seq_len, n.in_flight, n.inner_batch_tokens, n.lease_pool) < 1:
            raise ValueError(
                "fleet node: micro_batch, seq_len, in_flight, inner_batch_tokens, lease_pool >= 1"
            )
        if n.outer_group_size < 2 or n.outer_matchmaking_s <= 0:
            raise ValueError("fleet node: outer_group_size >= 2, outer_matchmaking_s > 0")
        if n.activation_cache < n.in_flight:
            raise ValueError("fleet node: activation_cache must hold at least in_flight")
        if self.timings.cpu_contention < 0:
            raise ValueError("fleet timings: cpu_contention must be >= 0")
        if self.timings.lease_ttl_s < 2 * self.timings.heartbeat_s:
            raise ValueError("fleet timings: lease_ttl_s must be at least twice heartbeat_s")


def _build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a table, not {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    values = dict(data)
    try:
        if "rtt_ms" in values:
            r = values["rtt_ms"]
            values["rtt_ms"] = (float(r), float(r)) if isinstance(r, int | float) else tuple(r)
        if "kills" in values:
            values["kills"] = tuple((float(t), int(s)) for t, s in values["kills"])
        for f in dataclasses.fields(cls):  # TOML gives ints for floats; nothing else converts
            v = values.get(f.name)
            want: Any = {"int": int, "float": (int, float), "str": str, "bool": bool}.get(
                str(f.type)
            )
            if (
                v is not None
                and want is not None
                and (not isinstance(v, want) or (isinstance(v, bool) and f.type != "bool"))
            ):
                raise TypeError(f"{f.name}={v!r} must be a {f.type}")
            if isinstance(v, float) and not math.isfinite(v):
                raise TypeError(f"{f.name}={v!r} must be finite")
        return cls(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ValueError) and str(exc).startswith("fleet"):
            raise
        raise ValueError(f"{where}: {exc}") from exc


def fleet_from_dict(data: dict[str, Any]) -> Fleet:
    unknown = set(data) - {"group", "churn", "timings", "node"}
    if unknown:
        raise ValueError(f"fleet: unknown tables {sorted(unknown)}")
    raw = data.get("group", [])
    if not isinstance(raw, list):
        raise ValueError("fleet: [[group]] must be an array of tables")
    groups = [_build(PeerGroup, g, f"fleet group {i}") for i, g in enumerate(raw)]
    return Fleet(
        groups=groups,
        churn=_build(Churn, data.get("churn", {}), "fleet [churn]"),
        timings=_build(Timings, data.get("timings", {}), "fleet [timings]"),
        node=_build(NodeSettings, data.get("node", {}), "fleet [node]"),
    )


def load_fleet(path: Path) -> Fleet:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"fleet file {path}: {exc}") from exc
    return fleet_from_dict(data)
