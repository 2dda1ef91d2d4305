"""The coordinator's run configuration: a dataclass loaded from TOML, then CLI overrides.

Secrets (`join_token`, `admin_token`, `launcher_token`) may come from the environment
instead (`AGORA_JOIN_TOKEN`, `AGORA_ADMIN_TOKEN`, `AGORA_LAUNCHER_TOKEN`) so they stay off
command lines, and the join and launcher tokens from files (`join_token_file`,
`launcher_token_file`: a container secret); they are never printed (`repr=False`).

Example `run.toml` (every key optional; flat, or under a `[coordinator]` table):

    run_id = "stdlib-small"
    model_preset = "small"
    n_stages = 2
    stage_layers = [1, 3]       # optional: layers per stage (`agora memory` helps choose)
    dataset = "stdlib"          # or text files, .jsonl, Parquet or a `datasets` directory
    tokenizer = "bytes"         # or a tokenizer.json (`agora tokenizer train`)
    lease_ttl_s = 15.0
    heartbeat_interval_s = 3.0
    auth = "token"              # open | token | allowlist
    join_token = "..."
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from protocol.control import MAX_PEER_INFO_BYTES, MAX_PEERS_PER_PAGE
from protocol.corpus import DEFAULT_HELDOUT_EVERY, DEFAULT_SHARD_TOKENS
from protocol.model_config import check_split, preset
from protocol.tensors import CODECS

AUTH_MODES = ("open", "token", "allowlist")


@dataclasses.dataclass(kw_only=True, slots=True)
class CoordinatorConfig:
    # run
    run_id: str = "agora-run"  # name of the run
    model_preset: str = "small"  # model preset the nodes build
    n_stages: int = 2  # pipeline stages
    # layers of each stage (counts, summing to the preset's n_layers), so that stages fit
    # the members' device memory (`agora memory`); None = an even split
    stage_layers: list[int] | None = None
    codec: str = "subspace_int4"  # activation codec id
    seed: int = 0  # run seed
    stage_costs: list[float] | None = None  # relative compute per stage (default all 1.0)
    # dataset
    # "stdlib" (embedded corpus), a directory of text files, a .jsonl, a .parquet file or
    # a directory of them, or a directory written by `datasets`' save_to_disk
    dataset: str = "stdlib"
    text_column: str = "text"  # the column (or .jsonl key) that holds the text
    # "bytes" (one token a byte, vocabulary 256) or a tokenizer.json of `tokenizers`
    # (`agora tokenizer train`); nodes fetch it from the coordinator, checked by hash
    tokenizer: str = "bytes"
    # directory of tokenized corpora (None: "<db>.tokens" beside the database; "": none)
    token_cache: str | None = None
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # tokens per shard
    heldout_every: int = DEFAULT_HELDOUT_EVERY  # every n-th shard is held out
    # network
    host: str = "127.0.0.1"  # listen address
    port: int = 7700  # listen port (0 = OS-chosen)
    port_file: str | None = None  # write the bound port here
    metrics_port: int | None = None  # Prometheus port (0 = OS-chosen, None = off)
    metrics_host: str = "127.0.0.1"  # Prometheus listen address
    prometheus_sd: str | None = None  # file-SD JSON listing node metrics endpoints
    relay: bool = False  # run a circuit-relay v2 hop (child process) for --no-listen nodes
    relay_port: int = 0  # relay listen port on `host` (0 = OS-chosen; fix it for restarts)
    relay_announce: str | None = None  # host/IP put in the relay's address (None: `host`)
    relays: list[str] = dataclasses.field(default_factory=list)  # relay multiaddrs for nodes
    # the relay child serves live members only, within these limits
    relay_circuit_bytes: int = 1 << 30  # bytes one relayed circuit carries (both ways)
    relay_circuit_duration_s: float = 3600.0  # seconds one relayed circuit may last
    relay_reservation_ttl_s: float = 600.0  # seconds a reservation lasts unless renewed
    # storage
    db: str = "coordinator.sqlite"  # SQLite file (WAL mode)
    # "full": fsync every group commit; "normal": survive a killed process, not a power
    # cut. Heartbeat renewals are not written at all (soft state, coordinator/leases.py)
    sync: str = "full"
    # membership and leases
    heartbeat_interval_s: float = 3.0  # seconds between node heartbeats
    # seconds without heartbeat before a peer/lease lapses; also the grace a restarted
    # coordinator gives every stored live peer and lease (renewals are not stored)
    lease_ttl_s: float = 15.0
    sweep_interval_s: float = 0.5  # seconds between expiry sweeps
    # active leases one peer may hold (count): a stage-0 node keeps lease_pool (8) open
    # plus the finished ones that wait for their outer round to commit them
    max_leases_per_peer: int = 64
    # cap on a granted range (tokens; 0 = the rest of the shard): small grants from
    # shards in round robin spread training over the corpus (docs/outer-loop.md)
    grant_tokens: int | None = 8192
    min_grant_tokens: int = 1024  # smallest range worth granting before a deadline
    deadline_margin_s: float = 60.0  # seconds kept free before a node's deadline
    rebalance_ratio: float = 0.5  # move a peer when a stage's rate < ratio * strongest's
    rebalance_interval_s: float = 30.0  # seconds between rebalance checks
    # largest share of one stage's replicas that members joining from one source IP may
    # hold (fraction; one member per source is always allowed; loopback sources, i.e. a
    # swarm on one machine, are exempt); 1.0 = no cap. 0.5 suits open runs.
    max_source_share: float = 1.0
    # a replica is banned when more than half of the other live replicas of its stage
    # (at least two) each caught it in this many distinct outer rounds (coordinator/accuse.py)
    accuse_strikes: int = 3  # rounds
    accuse_window_s: float = 900.0  # seconds an accusation counts
    # claimed throughput is checked against the work adjacent members witnessed over this
    # window (coordinator/witness.py); 0 = claims are trusted (seconds)
    witness_window_s: float = 120.0
    witness_slack: float = 2.0  # a claim may be this x its stage's median claim/work (ratio)
    claim_ratio: float = 4.0  # a member younger than a window: x its stage's median (ratio)
    # security and limits
    auth: str = "open"  # open | token | allowlist
    join_token: str = dataclasses.field(default="", repr=False)  # for auth = "token"
    allowlist: list[str] = dataclasses.field(default_factory=list)  # peer ids (allowlist)
    admin_token: str = dataclasses.field(default="", repr=False)  # empty: admin calls off
    max_frame_bytes: int = 8 << 20  # bytes per reply frame (a shard's bytes fit in one)
    max_request_bytes: int = 1 << 20  # bytes per request frame (requests are small)
    # members (or ids that left) in one membership reply; more come in further pages
    # (the page must fit max_frame_bytes at the largest member entry)
    membership_page_peers: int = 512
    max_connections: int = 20_000  # concurrent connections
    # concurrent connections from one source (an IPv4 address or an IPv6 /64); a NAT
    # with more nodes behind it than this needs it raised (each node holds one)
    max_connections_per_host: int = 64
    # bytes of partially received request frames, all connections together; a connection
    # whose next read would pass it is closed (one connection holds <= max_request_bytes)
    max_buffered_bytes: int = 256 << 20
    frame_deadline_s: float = 10.0  # seconds from a request frame's first byte to its last
    idle_timeout_s: float = 300.0  # seconds a silent connection stays open between frames
    # sustained requests/s from one source host, counted before signature checks (0: no
    # limit; many nodes behind one NAT share it, so it is far above rate_per_peer)
    rate_per_host: float = 1000.0
    host_burst: float = 5000.0  # request burst per source host
    rate_per_peer: float = 50.0  # sustained requests/s per key
    rate_burst: float = 200.0  # request burst per key
    clock_skew_s: float = 60.0  # seconds of signature timestamp tolerance
    verify_threads: int = 2  # threads checking request signatures off the event loop (0: inline)
    # keys one TLS connection may prove (by a request signed for this certificate) and
    # then send without a signature check (0: check every request)
    session_keys: int = 4096
    join_token_file: str | None = None  # file whose first line is the join token
    # facility reports from `agora launch` (coordinator/facilities.py)
    launcher_token: str = dataclasses.field(default="", repr=False)  # empty: reports refused
    launcher_token_file: str | None = None  # file whose first line is the launcher token
    facility_stale_s: float = 600.0  # seconds after which a silent facility's report is dropped
    max_facilities: int = 64  # facilities reporting at once (count); a new one past it is refused
    # TLS on the control port (coordinator/tls.py): an operator's PEM certificate and key;
    # both None: a self-signed one made once beside the database (<db>.tls-cert.pem/-key.pem)
    tls_cert: str | None = None  # PEM certificate file (with tls_key)
    tls_key: str | None = None  # PEM private key file (with tls_cert)
    tls_handshake_s: float = 10.0  # seconds a new connection has to finish its TLS handshake

    def __post_init__(self) -> None:
        self.validate()

    def costs(self) -> list[float]:
        return list(self.stage_costs) if self.stage_costs else [1.0] * self.n_stages

    def validate(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"invalid coordinator config: {what}")

        need(
            self.n_stages >= 2,
            f"n_stages must be >= 2 (a pipeline; one stage is `agora baseline`), got"
            f" {self.n_stages}",
        )
        try:
            model = preset(self.model_preset)
        except ValueError as exc:
            raise ValueError(f"invalid coordinator config: model_preset: {exc}") from None
        n_layers = model.n_layers
        need(self.codec in CODECS, f"codec must be one of {CODECS}, got {self.codec!r}")
        need(
            not self.codec.startswith("subspace") or model.subspace_rank > 0,
            f"codec {self.codec!r} needs a preset with a residual subspace (subspace_rank >"
            f" 0); preset {self.model_preset!r} has none: use fp16 or int8",
        )
        need(
            self.n_stages <= n_layers,
            f"n_stages ({self.n_stages}) must be at most the {n_layers} layers of preset"
            f" {self.model_preset!r}",
        )
        if self.stage_layers is not None:
            need(
                isinstance(self.stage_layers, list)
                and all(type(n) is int for n in self.stage_layers),
                f"stage_layers must be a list of layer counts, got {self.stage_layers!r}",
            )
            try:
                check_split(self.stage_layers, n_layers, self.n_stages)
            except ValueError as exc:
                raise ValueError(
                    f"invalid coordinator config: {exc} (preset {self.model_preset!r})"
                ) from None
        need(
            self.stage_costs is None
            or (len(self.stage_costs) == self.n_stages and min(self.stage_costs) > 0),
            f"stage_costs needs {self.n_stages} positive numbers, got {self.stage_costs}",
        )
        need(self.auth in AUTH_MODES, f"auth must be one of {AUTH_MODES}, got {self.auth!r}")
        need(self.auth != "token" or bool(self.join_token), "auth = 'token' needs a join_token")
        need(
            self.auth != "allowlist" or bool(self.allowlist),
            "auth = 'allowlist' needs a non-empty allowlist",
        )
        need(self.sync in ("full", "normal"), f"sync must be 'full' or 'normal': {self.sync!r}")
        need(self.heartbeat_interval_s > 0, "heartbeat_interval_s must be > 0")
        need(
            self.lease_ttl_s >= 2 * self.heartbeat_interval_s,
            f"lease_ttl_s ({self.lease_ttl_s}) must be at least twice heartbeat_interval_s"
            f" ({self.heartbeat_interval_s}) so one lost heartbeat does not kill a peer",
        )
        need(0 < self.sweep_interval_s <= self.lease_ttl_s, "0 < sweep_interval_s <= lease_ttl_s")
        need(0 <= self.port <= 65535, f"port out of range: {self.port}")
        need(0 <= self.relay_port <= 65535, f"relay_port out of range: {self.relay_port}")
        need(
            self.metrics_port is None or 0 <= self.metrics_port <= 65535,
            f"metrics_port out of range: {self.metrics_port}",
        )
        need(self.shard_tokens >= 1 and self.heldout_every >= 2, "shard_tokens/heldout_every")
        need(self.max_leases_per_peer >= 1, "max_leases_per_peer must be >= 1")
        need(self.grant_tokens is None or self.grant_tokens >= 0, "grant_tokens must be >= 0")
        need(0 < self.rebalance_ratio <= 1, "rebalance_ratio must be in (0, 1]")
        need(0 < self.max_source_share <= 1, "max_source_share must be in (0, 1]")
        need(self.accuse_strikes >= 1, "accuse_strikes must be >= 1")
        need(self.accuse_window_s > 0, "accuse_window_s must be > 0")
        need(self.witness_window_s >= 0, "witness_window_s must be >= 0")
        need(self.witness_slack >= 1 and self.claim_ratio >= 1, "witness_slack, claim_ratio >= 1")
        need(self.max_frame_bytes >= 4096, "max_frame_bytes must be >= 4096")
        need(
            4096 <= self.max_request_bytes <= self.max_frame_bytes,
            "max_request_bytes must be in [4096, max_frame_bytes]",
        )
        need(bool(self.text_column), "text_column must not be empty")
        need(bool(self.tokenizer), "tokenizer must be 'bytes' or a tokenizer.json path")
        need(
            self.max_frame_bytes >= self.shard_tokens + 4096,
            f"max_frame_bytes ({self.max_frame_bytes}) must exceed shard_tokens"
            f" ({self.shard_tokens}) so a shard fits one frame",
        )
        need(self.max_connections >= 1, "max_connections must be >= 1")
        need(
            1 <= self.membership_page_peers <= MAX_PEERS_PER_PAGE
            and self.membership_page_peers * MAX_PEER_INFO_BYTES + 4096 <= self.max_frame_bytes,
            f"membership_page_peers ({self.membership_page_peers}) must be in"
            f" [1, {MAX_PEERS_PER_PAGE}] and a page of that many members at"
            f" {MAX_PEER_INFO_BYTES} bytes each must fit max_frame_bytes ({self.max_frame_bytes})",
        )
        need(self.max_connections_per_host >= 1, "max_connections_per_host must be >= 1")
        need(
            self.max_buffered_bytes >= self.max_request_bytes,
            f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least"
            f" max_request_bytes ({self.max_request_bytes}): one whole request must fit",
        )
        need(
            self.frame_deadline_s > 0 and self.idle_timeout_s > 0, "frame_deadline_s/idle_timeout_s"
        )
        need(self.rate_per_peer > 0 and self.rate_burst >= 1, "rate_per_peer/rate_burst")
        need(
            self.rate_per_host >= 0 and self.host_burst >= 1,
            "rate_per_host must be >= 0 (0: no limit) and host_burst >= 1",
        )
        need(
            self.rate_per_host == 0 or self.rate_per_host >= self.rate_per_peer,
            "rate_per_host must be 0 or at least rate_per_peer (one node must get through)",
        )
        need(
            0 <= self.verify_threads <= 64,
            f"verify_threads must be in [0, 64]: {self.verify_threads}",
        )
        need(
            0 <= self.session_keys <= 1_000_000,
            f"session_keys must be in [0, 1000000]: {self.session_keys}",
        )
        need(
            not self.launcher_token or len(self.launcher_token) >= 16,
            "launcher_token must be at least 16 characters",
        )
        need(
            not self.launcher_token or self.launcher_token != self.join_token,
            "launcher_token must differ from join_token (every member knows the join token)",
        )
        need(self.facility_stale_s > 0, "facility_stale_s must be > 0")
        need(4096 <= self.relay_circuit_bytes < 1 << 63, "relay_circuit_bytes in [4096, 2**63)")
        need(1 <= self.relay_circuit_duration_s < 1 << 31, "relay_circuit_duration_s >= 1")
        need(
            120 <= self.relay_reservation_ttl_s < 1 << 31,
            "relay_reservation_ttl_s must be >= 120 (nodes renew every 60 s)",
        )
        need(self.max_facilities >= 1, "max_facilities must be >= 1")
        need((self.tls_cert is None) == (self.tls_key is None), "set tls_cert and tls_key together")
        need(self.tls_handshake_s > 0, "tls_handshake_s must be > 0")


def read_token_file(path: Path) -> str:
    """The first line of `path`, stripped; `ValueError` if it holds no token."""
    lines = path.expanduser().read_text().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"{path} holds no token")
    return token


def load_config(path: Path | None, overrides: dict[str, Any]) -> CoordinatorConfig:
    """TOML file (optional) < environment secrets < CLI overrides (None values ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
        values.update(data.get("coordinator", data))
    for key, env in (
        ("join_token", "AGORA_JOIN_TOKEN"),
        ("admin_token", "AGORA_ADMIN_TOKEN"),
        ("launcher_token", "AGORA_LAUNCHER_TOKEN"),
    ):
        if os.environ.get(env):
            values[key] = os.environ[env]
    values.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("join_token", "launcher_token"):
        if values.get(f"{key}_file"):
            if values.get(key):
                raise ValueError(f"set {key} or {key}_file, not both")
            values[key] = read_token_file(Path(values[f"{key}_file"]))
    known = {f.name for f in dataclasses.fields(CoordinatorConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown coordinator config keys: {', '.join(unknown)}")
    return CoordinatorConfig(**values)
