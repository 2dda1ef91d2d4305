"""`agora bench coordinator`: its statistics refuse to guess, and a smoke-sized run against
a real coordinator reports successes, errors and the two latency kinds apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.coordinator import MIN_SAMPLES, capacity, main, percentiles, within_capacity


def test_percentiles_need_enough_samples() -> None:
    assert percentiles([0.001] * (MIN_SAMPLES - 1)) == (None, None)
    p50, p99 = percentiles([i / 1000 for i in range(1, 1001)])
    assert p50 is not None and p99 is not None and 499 < p50 < 502 and 989 < p99 < 992


def test_capacity_is_the_highest_rate_that_kept_up() -> None:
    def step(rate: float, got: float, p99: float | None) -> dict[str, float | None]:
        return {"target_heartbeats_per_s": rate, "heartbeats_per_s": got, "heartbeat_p99_ms": p99}

    steps = [step(500, 500, 10.0), step(1000, 999, 30.0), step(2000, 1500, 20.0)]
    assert within_capacity(steps[1], 50.0) and not within_capacity(steps[2], 50.0)
    assert capacity(steps, 50.0) == 1000
    assert capacity([step(500, 500, None)], 50.0) is None  # too few samples is not a pass
    assert capacity([step(500, 500, 60.0)], 50.0) is None


@pytest.mark.parametrize("session_keys", ["4096", "0"])
def test_a_small_run_reports_successes_and_latencies_by_kind(
    tmp_path: Path, session_keys: str
) -> None:
    """With proven keys the load generator sends unsigned requests after each join; with
    `--session-keys 0` it signs every one. Either way no request is refused."""
    out = tmp_path / "c.json"
    args = ["--peers", "300", "--interval", "1", "--duration", "3", "--procs", "1",
            "--conns", "2", "--lease-peers", "2", "--session-keys", session_keys,
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    got = json.loads(out.read_text())
    assert got["errors"] == {} and got["peers_after_restart"] == 300
    assert got["heartbeat_samples"] >= MIN_SAMPLES and got["heartbeat_p99_ms"] is not None
    assert got["p99_ms"] == got["heartbeat_p99_ms"]
    assert 0 < got["heartbeats_per_s"] <= 1.2 * got["target_heartbeats_per_s"]
    if got["lease_samples"] < MIN_SAMPLES:
        assert got["lease_p99_ms"] is None
