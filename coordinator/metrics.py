"""Prometheus metrics of the coordinator (units in names, no peer-id labels) and the
file-SD JSON that lists the nodes' own metrics endpoints for Prometheus."""

from __future__ import annotations

import json
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LAT = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)  # seconds


class CoordinatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.peers = Gauge("agora_coordinator_peers", "Live peers per stage", ["stage"], registry=r)
        self.stage_throughput = Gauge(
            "agora_coordinator_stage_throughput_tokens_per_second",
            "Sum of counted peer throughput per stage (claims checked against witnessed work)",
            ["stage"],
            registry=r,
        )
        self.joins = Counter("agora_coordinator_joins_total", "Joins accepted", registry=r)
        self.leaves = Counter(
            "agora_coordinator_leaves_total",
            "Peers that left the view, by reason (left, dead, banned)",
            ["reason"],
            registry=r,
        )
        self.accusations = Counter(
            "agora_coordinator_accusations_total",
            "Accusations replicas sent, by outcome (recorded, ignored, banned: the accused "
            "was banned by it)",
            ["outcome"],
            registry=r,
        )
        self.witnessed = Gauge(
            "agora_coordinator_witnessed_tokens",
            "Tokens of work members reported seeing adjacent members do, since the start",
            registry=r,
        )
        self.capped = Gauge(
            "agora_coordinator_throughput_capped_peers",
            "Members counted below their claimed throughput at the last recount (their claim"
            " is more than the work others witnessed backs)",
            registry=r,
        )
        self.moves = Counter(
            "agora_coordinator_rebalance_moves_total", "Peers moved between stages", registry=r
        )
        self.leases = Gauge(
            "agora_coordinator_shards", "Shards of this data epoch by state", ["state"], registry=r
        )
        self.active_leases = Gauge(
            "agora_coordinator_active_leases", "Active DARL leases", registry=r
        )
        self.fenced = Counter(
            "agora_coordinator_fenced_calls_total",
            "Lease calls refused because the lease was fenced",
            registry=r,
        )
        self.fence_records = Counter(
            "agora_coordinator_fence_records_total",
            "Fenced lease calls put on the audit record (the first per lease)",
            registry=r,
        )
        self.expired = Counter(
            "agora_coordinator_expired_leases_total", "Leases expired by TTL", registry=r
        )
        self.committed = Counter(
            "agora_coordinator_committed_tokens_total", "Tokens committed", registry=r
        )
        self.data_epoch = Gauge("agora_coordinator_data_epoch", "Current data epoch", registry=r)
        self.membership_version = Gauge(
            "agora_coordinator_membership_version", "Membership view version", registry=r
        )
        self.heartbeat_latency = Histogram(
            "agora_coordinator_heartbeat_latency_seconds",
            "Heartbeat handling time including the durable write",
            buckets=_LAT,
            registry=r,
        )
        self.rpc_latency = Histogram(
            "agora_coordinator_rpc_latency_seconds",
            "Request handling time including the durable write, by request type",
            ["method"],
            buckets=_LAT,
            registry=r,
        )
        self.errors = Counter(
            "agora_coordinator_error_replies_total", "Error replies by code", ["code"], registry=r
        )
        self.session_requests = Counter(
            "agora_coordinator_session_requests_total",
            "Requests answered without a signature check: their key had proven itself"
            " earlier on the same TLS connection (a request bound to this certificate)",
            registry=r,
        )
        self.bad_frames = Counter(
            "agora_coordinator_bad_frames_total",
            "Malformed or oversized frames received",
            registry=r,
        )
        self.edge_refusals = Counter(
            "agora_coordinator_edge_refusals_total",
            "Connections or requests refused at the edge, by reason (host_connections,"
            " buffer_budget, frame_deadline, host_rate)",
            ["reason"],
            registry=r,
        )
        self.rejected_connections = Counter(
            "agora_coordinator_rejected_connections_total",
            "Connections refused at the connection limit",
            registry=r,
        )
        self.connections = Gauge(
            "agora_coordinator_connections", "Open client connections", registry=r
        )
        self.audit_problems = Gauge(
            "agora_coordinator_audit_problem_ranges",
            "Lost or duplicated committed token ranges (kind) found by the live audit replay"
            " of the current and the last completed data epoch; should be 0",
            ["kind"],
            registry=r,
        )
        for kind in ("lost", "duplicated"):
            self.audit_problems.labels(kind).set(0)
        self.attested_round = Gauge(
            "agora_coordinator_attested_round",
            "Outer round of each stage's attested state (-1: none yet)",
            ["stage"],
            registry=r,
        )
        self.disagreeing_states = Gauge(
            "agora_coordinator_disagreeing_state_reports",
            "State reports of an attested round with another digest, since start",
            registry=r,
        )
        self.contradicted_commits = Gauge(
            "agora_coordinator_commits_off_attested",
            "Commits refused for riding in another state of an attested round, since start",
            registry=r,
        )
        self.group_commits = Counter(
            "agora_coordinator_group_commits_total", "SQLite write transactions", registry=r
        )
        self.group_commit_seconds = Histogram(
            "agora_coordinator_group_commit_seconds",
            "Duration of one durable write transaction",
            buckets=_LAT,
            registry=r,
        )

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP exporter; returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)


def write_file_sd(path: Path, run_id: str, targets_by_stage: dict[int, list[str]]) -> None:
    """Prometheus file-SD JSON, one target group per stage, replaced atomically."""
    groups = [
        {"targets": sorted(t), "labels": {"job": "agora-node", "run": run_id, "stage": str(s)}}
        for s, t in sorted(targets_by_stage.items())
        if t
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups, indent=1))
    os.replace(tmp, path)
