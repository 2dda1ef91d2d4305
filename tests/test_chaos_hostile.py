"""A short `agora chaos --hostile` run: hostile attacks from real rogue processes, raw
sockets and a relay flooder against a real local swarm (whose coordinator runs its
circuit relay), judged by what the honest processes experienced.

One run of `agora chaos --hostile --minutes 0.75 --seed 1 --outer-every-steps 0` (every
micro-batch commits at once, so commit growth shows within each 15 s third): every
attack is played once. Asserted: nothing lost or duplicated, no honest process crashed,
bounded RSS, every probe heartbeat answered within the lease TTL, commits grew in each
third, and every attack got the defended answer (for `relay_flood`: the member's own
reservation accepted, every stranger's refused, none in another's name, the circuit cut).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swarmlab.chaos.hostile import (
    ATTACKS,
    RELAY_CIRCUIT_BYTES,
    attack_hold_s,
    hostile_plan,
    summarize,
)
from swarmlab.chaos.member_attacks import poison_bound
from swarmlab.chaos.relay_attacks import STRANGERS, judge
from swarmlab.chaos.schedule import ChaosConfig
from swarmlab.procs import child_env

REPO = Path(__file__).resolve().parent.parent
MAX_RSS_MB = 1536.0  # per honest process, as in tests/test_chaos.py


def test_hostile_plan_plays_every_attack_and_is_a_function_of_the_seed() -> None:
    cfg = ChaosConfig(minutes=0.75, seed=1, hostile=True)
    a = hostile_plan(1, 45, cfg)
    assert a == hostile_plan(1, 45, cfg) and a != hostile_plan(2, 45, cfg)
    assert sorted(f.kind for f in a) == sorted(ATTACKS)
    assert all(f.hold_s == attack_hold_s(45) for f in a) and 5 <= attack_hold_s(45) <= 20
    assert max(f.at_s for f in a) < 45 * 0.85
    assert poison_bound(9.0) < poison_bound(600.0) < 9.0 * 2 / 0.3  # far below one per batch


def test_summary_names_every_attack_played_or_not() -> None:
    plays = [
        {"attack": "amplify", "outcome": "defended"},
        {"attack": "amplify", "outcome": "error"},
    ]
    out = summarize(plays)
    assert out["amplify"]["played"] == 2 and out["amplify"]["outcome"] == "mixed"
    assert out["slow_drip"] == {"played": 0, "outcome": "not played", "plays": []}
    assert set(out) == set(ATTACKS) and "relay_flood" in ATTACKS


def test_relay_flood_is_defended_only_if_every_answer_refused_and_the_circuit_was_cut() -> None:
    refused = "PERMISSION_DENIED"
    out = {
        "own_reservation": "OK",
        "in_others_names": {"honest_node": refused, "other_member": refused},
        "circuit_to_stranger": "reset",
        "non_members": {
            "answers": {refused: 49, "NO_RESERVATION": 1},
            "circuit_to_member": refused,
        },
        "circuit_cut": {"circuits": 2},
    }
    assert judge(out) is True
    for path, value in ((("non_members", "answers"), {refused: 49, "OK": 1}),
                        (("in_others_names",), {"honest_node": "OK"}),
                        (("non_members", "answers"), {refused: 49, "timeout": 1}),
                        (("circuit_cut",), {"circuits": 1})):  # fmt: skip
        bad = json.loads(json.dumps(out))
        inner = bad
        for k in path[:-1]:
            inner = inner[k]
        inner[path[-1]] = value
        assert judge(bad) is False, (path, value)
    assert judge(out | {"own_reservation": "PERMISSION_DENIED"}) is None  # relay served nobody


@pytest.mark.timeout(480)  # swarm start-up on a loaded 2-core box, 45 s of attacks, drain
def test_short_hostile_run(tmp_path: Path) -> None:
    out = tmp_path / "hostile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "swarmlab.cli", "chaos", "--hostile", "--minutes", "0.75",
         "--seed", "1", "--outer-every-steps", "0", "--workdir", str(tmp_path / "w"),
         "--json", str(out)],
        env=child_env(), capture_output=True, text=True, timeout=450, cwd=REPO,
    )  # fmt: skip
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(out.read_text())
    attacks = report["attacks"]
    summary = {k: report[k] for k in ("crashed", "audit", "heartbeat_max_s",
                                      "heartbeat_max_gap_s", "commits_by_third")}  # fmt: skip
    summary["outcomes"] = {k: v["outcome"] for k, v in attacks.items()}

    assert report["lost_ranges"] == 0 and report["duplicated_ranges"] == 0, summary
    assert report["crashed"] == {}, summary
    assert 0 < report["max_rss_mb"] < MAX_RSS_MB, report["rss_peak_mb"]
    assert report["heartbeats"] > 10 and report["heartbeat_max_s"] < report["lease_ttl_s"], summary
    assert report["heartbeat_max_gap_s"] < report["lease_ttl_s"], summary
    assert report["commits_kept_growing"], summary
    assert all(isinstance(n, int) and n > 0 for n in report["commits_by_third"]), summary
    for kind in ATTACKS:
        assert attacks[kind]["played"] == 1, (kind, summary)
        if kind == "poison_backward":  # a defended rogue may also never be routed to
            assert attacks[kind]["outcome"] in ("defended", "not_reached"), attacks[kind]
        else:
            assert attacks[kind]["outcome"] == "defended", (kind, attacks[kind])
    replay = attacks["key_flood"]["plays"][0]["result"]["replay"]
    assert replay[-1] == "replay", replay
    relay = attacks["relay_flood"]["plays"][0]["result"]
    assert relay["own_reservation"] == "OK", relay  # the relay serves a member
    assert relay["non_members"]["answers"] == {"PERMISSION_DENIED": STRANGERS}, relay
    assert set(relay["in_others_names"].values()) == {"PERMISSION_DENIED"}, relay
    cut = relay["circuit_cut"]
    assert cut["circuits"] >= 2 and cut["pushed_bytes"] > RELAY_CIRCUIT_BYTES, cut
    assert report["ok"] is True and proc.returncode == 0, proc.stdout[-3000:]
