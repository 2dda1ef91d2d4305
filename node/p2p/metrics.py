"""Prometheus counters of the data-plane transport (no peer-id labels, bounded label sets)."""

from __future__ import annotations

from prometheus_client import Counter

REFUSED = Counter(
    "agora_p2p_refused_total",
    "Inbound requests refused before being served, by reason",
    ["reason"],  # banned | not_member | streams | rate | bytes
)
BANS = Counter("agora_p2p_bans_total", "Peers banned for sending bad input")
BAD_FRAMES = Counter(
    "agora_p2p_bad_frames_total",
    "Inbound frames rejected as malformed, oversized or invalid, by kind",
    ["kind"],  # oversized | malformed | invalid
)
CUT_STREAMS = Counter(
    "agora_p2p_cut_streams_total", "Inbound streams that ended or reset mid-request"
)
SERVED = Counter("agora_p2p_served_total", "Inbound requests answered")
RELAY_RESERVATIONS = Counter(
    "agora_p2p_relay_reservations_total", "Slots reserved on a circuit relay (new, not renewed)"
)
RELAY_CIRCUITS = Counter(
    "agora_p2p_relay_circuits_total", "Outbound connections opened through a circuit relay"
)
RELAY_REFUSED = Counter(
    "agora_p2p_relay_refused_total",
    "Reservations and circuits this relay hop refused to non-members, by what",
    ["what"],  # reservation | circuit
)
RELAY_DROPPED = Counter(
    "agora_p2p_relay_dropped_total", "Reservations this relay hop dropped when their peer left"
)
