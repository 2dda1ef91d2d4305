"""Prometheus metrics of a training node (no peer-id labels; bounded label sets)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("agora_node_tokens_total", "Tokens this node finished backward for")
COMMITTED = Counter("agora_node_committed_tokens_total", "Lease tokens this node committed")
LOSS = Gauge("agora_node_loss", "Mean training loss of recent micro-batches (nats per byte)")
MICROBATCHES = Counter(
    "agora_node_microbatches_total",
    "Micro-batches by outcome",
    ["result"],  # done | retried | dropped
)
IN_FLIGHT = Gauge("agora_node_microbatches_in_flight", "Micro-batches sent and not yet returned")
BYTES = Counter(
    "agora_node_boundary_bytes_total",
    "Bytes crossing this node's stage boundaries",
    ["direction", "kind"],  # direction: fwd | bwd; kind: raw | wire
)
COMPRESSION = Gauge(
    "agora_node_compression_ratio", "Raw fp32 bytes over wire bytes, both directions"
)
INNER_STEPS = Counter("agora_node_inner_steps_total", "Inner optimizer steps")
RECOMPUTES = Counter(
    "agora_node_recomputes_total",
    "Backward passes that ran the forward again (evicted, or the weights moved since)",
)
OUTER_STEPS = Counter("agora_node_outer_steps_total", "Outer (DiLoCo) steps applied")
OUTER_ROUNDS = Counter(
    "agora_node_outer_rounds_total",
    "Outer rounds by outcome",
    ["result"],  # ok | failed
)
OUTER_ROUND_SECONDS = Histogram(
    "agora_node_outer_round_seconds",
    "Outer round duration, from snapshot to the merged result",
    buckets=(0.5, 1, 2, 5, 10, 20, 60, 120),
)
OUTER_GROUP_SIZE = Gauge("agora_node_outer_group_size", "Replicas averaged in the last outer round")
OUTER_BYTES = Counter("agora_node_outer_bytes_total", "Pseudo-gradient bytes sent on the wire")
OUTER_STATE_BYTES = Counter(
    "agora_node_outer_state_bytes_total",
    "Global-state bytes (theta_g and m, fp32) the outer process downloaded from (in) or"
    " served to (out) other replicas: joins, rebases, adoptions",
    ["direction"],
)
for _direction in ("in", "out"):  # both series exist from the start (scraped as 0)
    OUTER_STATE_BYTES.labels(_direction)
OUTER_RECORDS_REFUSED = Counter(
    "agora_node_outer_dht_records_refused_total",
    "Records the outer loop's DHT refused to store or believe: unsigned, signed by"
    " another peer than the one they name, or of a peer not listed on the stage",
)
STAGE = Gauge("agora_node_stage", "Pipeline stage this node serves")
DEVICE_PEAK = Gauge(
    "agora_node_device_peak_bytes", "Peak GPU memory the stage allocated (0 on the CPU)"
)
TORCH_CPU = Counter(
    "agora_node_torch_cpu_seconds_total",
    "CPU seconds of the torch thread (forward, backward, inner steps, codecs, merges)",
)
MB_SECONDS = Histogram(
    "agora_node_microbatch_seconds",
    "Round trip of a micro-batch through the downstream stages",
    buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30),
)
SERVE_SECONDS = Histogram(
    "agora_node_serve_seconds",
    "Time a served forward took, from its arrival to its reply (downstream stages included)",
    buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30),
)
HEARTBEAT_SECONDS = Histogram(
    "agora_node_heartbeat_seconds",
    "Coordinator heartbeat round trip",
    buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3),
)
