"""`agora bench failover --trials 1`: one re-route and one lease re-issue on a real swarm.

Runs the benchmark as a user would (`agora bench failover`, a coordinator and 2 stages x 2
replicas of real processes, real SIGKILLs) and checks its JSON: every key is there,
every time is finite and positive, a lease expires within its bounds, and `agora audit`
finds no lost and no duplicated range. Of the failover goals it asserts the mechanism,
not the timing (a loaded box stretches every micro-batch): the victim's death was
detected as a transport failure, and no stage-0 node sent it a request after its own
detection. About 75 s on the shared 2-core box.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from swarmlab.procs import child_env

REPO = Path(__file__).resolve().parent.parent
TIME_KEYS = (
    "reroute_seconds",
    "reroute_all_seconds",
    "reroute_detect_seconds",
    "victim_dropped_seconds",
    "lease_expire_seconds",
    "lease_regrant_seconds",
    "first_commit_seconds",
)
DELTA_KEYS = ("reroute_after_detection_s", "regrant_after_expiry_s")


@pytest.mark.slow
@pytest.mark.timeout(300)  # the suite's global timeout; the bench bounds itself below it
def test_failover_bench_one_trial(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    proc = subprocess.run(
        [sys.executable, "-m", "swarmlab.cli", "bench", "failover", "--trials", "1",
         "--json", str(out), "--workdir", str(tmp_path / "work"),
         "--start-timeout", "150", "--trial-timeout", "60"],
        capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=285,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in (*TIME_KEYS, *DELTA_KEYS, "retried_microbatches", "sent_after_detection",
                "lost_ranges", "duplicated_ranges", "settings", "summary", "trials", "bounds",
                "goals", "met"):  # fmt: skip
        assert key in report, key
    for key in DELTA_KEYS:
        assert isinstance(report[key], list) and len(report[key]) == 1, (key, report[key])
        assert all(math.isfinite(v) for v in report[key]), (key, report[key])
    for key in TIME_KEYS:
        values = report[key]
        assert isinstance(values, list) and len(values) == 1, (key, values)
        assert all(math.isfinite(v) and v > 0 for v in values), (key, values)
    assert report["lost_ranges"] == 0
    assert report["duplicated_ranges"] == 0
    settings = report["settings"]
    ttl, sweep = settings["lease_ttl_s"], settings["sweep_interval_s"]
    assert settings["operator_defaults"]["lease_ttl_s"] > 0
    # the lease cannot lapse before TTL - heartbeat; a late sweep on a loaded box may add
    # more than one sweep interval, so the upper check is loose
    (expire,) = report["lease_expire_seconds"]
    assert ttl - settings["heartbeat_interval_s"] - 0.1 <= expire <= ttl + sweep + 5.0
    (regrant,), (commit,) = report["lease_regrant_seconds"], report["first_commit_seconds"]
    assert expire <= regrant <= commit
    (first,), (last,) = report["reroute_seconds"], report["reroute_all_seconds"]
    assert first <= last
    assert isinstance(report["retried_microbatches"][0], int)
    reroute = report["trials"][0]
    assert report["retried_microbatches"][0] >= reroute["failed_microbatches"]
    if reroute["failed_requests"]:  # the victim had work in flight when it died
        assert "unreachable" in reroute["failure_kinds"], reroute["failures"]
        assert report["sent_after_detection"] == [0], reroute["failures"]
        (after,) = report["reroute_after_detection_s"]
        assert after >= 0
    assert "failover" in proc.stdout and "agora audit: lost 0" in proc.stdout
