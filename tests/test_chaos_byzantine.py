"""`agora chaos --byzantine`: its schedule, its judgement of honest events, and a short
run against real processes.

The short run plays two attacks in a 2 stages x 2 honest replicas swarm (tiny preset,
outer rounds every 10 inner steps), each from a third replica that joins one stage for
its slot: `nan_inf` (a real node whose outer process contributes its pseudo-gradient
with NaNs and Infs: refused from its first group round on, where a x100 contribution
built on a few steps may still fit the bounds) and `forged_export` (a member serving a
forged state of round 2**62 while `agora export --coordinator` runs). It asserts what
the honest side did: the honest reducers left the poisoned contributions out (or the
coordinator banned the attacker), the export took the attested state, the honest
replicas of each stage ended
every shared group round bitwise identical, and the audit found nothing lost or
duplicated. The fault-free comparison of held-out loss belongs to the long run
(docs/reliability.md); this test does not time anything.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from node.events import EventLog
from swarmlab.chaos.byzantine import (
    HONEST,
    byzantine_plan,
    ground_key,
    honest_rounds,
    honest_view,
    judge,
    reason_kind,
)
from swarmlab.chaos.schedule import BYZANTINE, FORGED_ROUND, ChaosConfig
from swarmlab.procs import child_env
from swarmlab.swarm import EVENTS_SUFFIX

REPO = Path(__file__).resolve().parent.parent


def test_plan_gives_every_attack_one_slot_in_a_seeded_order() -> None:
    cfg = ChaosConfig(minutes=18, seed=3, byzantine=True)
    a = byzantine_plan(3, 1080, cfg)
    assert a == byzantine_plan(3, 1080, cfg)
    assert sorted(f.kind for f in a) == sorted(BYZANTINE)
    assert [f.at_s for f in a] == [i * 120.0 for i in range(len(BYZANTINE))]
    assert all(f.hold_s < 120.0 for f in a)
    assert [f.kind for f in byzantine_plan(4, 1080, cfg)] != [f.kind for f in a]


def test_config_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="unknown Byzantine"):
        ChaosConfig(minutes=10, byzantine=True, attacks=("nope",))
    with pytest.raises(ValueError, match="too short"):
        ChaosConfig(minutes=2, byzantine=True)
    with pytest.raises(ValueError, match="choose one"):
        ChaosConfig(minutes=10, byzantine=True, hostile=True)
    with pytest.raises(ValueError, match="need byzantine"):
        ChaosConfig(minutes=10, attacks=("noise",))
    with pytest.raises(ValueError, match="outer_every_steps"):
        ChaosConfig(minutes=10, byzantine=True, outer_every_steps=0)


def test_a_ground_key_has_the_smallest_peer_id_of_its_draws() -> None:
    key = ground_key(50)
    assert len(key.peer_id) > 40 and key.peer_id.startswith("12D3KooW")


def _events(workdir: Path, name: str, events: list[tuple[str, dict[str, object]]]) -> None:
    log = EventLog(workdir / f"{name}{EVENTS_SUFFIX}")
    for event, fields in events:
        log.emit(event, **fields)
    log.close()


def _round(r: int, digest: str, size: int, rejected: dict[str, str] | None = None) -> tuple:
    return ("round_applied", {"round": r, "group_size": size, "tokens": 1, "seconds": 1.0,
                              "rebased": False, "contributed": True, "joined_early": False,
                              "digest": digest, "rejected": rejected or {}})  # fmt: skip


def test_honest_rounds_compare_the_group_rounds_every_honest_replica_applied(
    tmp_path: Path,
) -> None:
    _events(tmp_path, "a0", [_round(1, "x", 2), _round(2, "y", 1), _round(3, "z", 3)])
    _events(tmp_path, "b0", [_round(1, "x", 2), _round(2, "w", 1), _round(3, "z", 3)])
    _events(tmp_path, "a1", [_round(1, "p", 2), _round(4, "q", 2)])
    _events(tmp_path, "b1", [_round(1, "P", 2), _round(4, "q", 2)])
    got = honest_rounds(tmp_path)
    # stage 0: rounds 1 and 3 were group rounds for both (round 2 was lone: not compared)
    assert got["0"] == {"compared": 2, "identical": 2, "max_round": 3}
    # stage 1: round 1 differs, a divergence inside a group round
    assert got["1"] == {"compared": 2, "identical": 1, "max_round": 4}
    assert set(HONEST) == {"a0", "b0", "a1", "b1"}


def test_judgement_reads_rejections_bans_and_forged_rounds(tmp_path: Path) -> None:
    rogue = "12D3KooWrogue"
    why = "part 0: norm 171 above max_rel_norm * ||theta_g|| = 16; part 1: norm 165 above"
    _events(tmp_path, "a0", [_round(5, "x", 3, {rogue: why})])
    _events(tmp_path, "b0", [_round(5, "x", 3), ("accused", {"peer": rogue, "round": 5,
                                                             "reason": "norm"}),
                             ("dht_records_refused", {"count": 2, "round": 5}),
                             _round(6, "y", 3, {rogue: "part 0: no tokens; part 1: no tokens"})])  # fmt: skip
    for n in ("a1", "b1"):
        _events(tmp_path, n, [])
    view = honest_view(tmp_path, 0, rogue, 0.0, 4e9)
    assert view["honest_rejections"] == {"norm": 1}  # an empty contribution is no defence
    assert view["honest_left_out"] == {"no tokens": 1}
    assert reason_kind("part 2: pair: cosine -0.31 below 4 / sqrt(n) = 0.02") == "pair: cosine"
    assert reason_kind("non-finite values") == "non-finite values"
    assert view["honest_accusations"] == 1 and view["rounds_with_attacker"] == 2  # 5 and 6
    assert view["honest_records_refused"] == 2
    play = {**view, "banned": False}
    assert judge("scaled_delta", play) == "rejected"
    assert judge("scaled_delta", {**play, "banned": True}) == "banned"
    assert judge("sign_flip", {**play, "honest_rejections": {}}) == "bounded"
    assert judge("state_takeover", {**play, "honest_max_round": FORGED_ROUND}) == "not_defended"
    export = {**play, "peer_id": rogue, "export_exit": 0, "export_rounds": {0: 5, 1: 5},
              "export_sources": {0: "12D3KooWhonest", 1: "12D3KooWother"},
              "attacker": {"chunks_served": 1}}  # fmt: skip
    assert judge("forged_export", export) == "ignored"
    assert judge("forged_export", {**export, "export_sources": {0: rogue}}) == "not_defended"
    assert judge("forged_export", {**export, "export_exit": 1}) == "not_reached"
    assert judge("forged_export", {**export, "attacker": {}}) == "not_reached"
    assert judge("dht_forgery", play) == "ignored"  # refused, and groups went on
    assert judge("dht_forgery", {**play, "honest_records_refused": 0}) == "not_reached"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_short_byzantine_run(tmp_path: Path) -> None:
    out = tmp_path / "byzantine.json"
    proc = subprocess.run(
        [sys.executable, "-m", "swarmlab.cli", "chaos", "--byzantine", "--minutes", "2.5",
         "--seed", "1", "--attacks", "nan_inf,forged_export", "--baseline", "none",
         "--json", str(out), "--workdir", str(tmp_path / "run")],
        env=child_env(), capture_output=True, text=True, timeout=1400, cwd=REPO,
    )  # fmt: skip
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    attacks = report["attacks"]
    detail = json.dumps(attacks, indent=1)[:4000]
    assert attacks["nan_inf"]["count"] == 1 and attacks["forged_export"]["count"] == 1
    assert attacks["nan_inf"]["outcome"] in ("rejected", "banned"), detail
    assert attacks["forged_export"]["outcome"] == "ignored", detail
    assert report["attackers_rejected"] == 2
    assert report["honest_replicas_identical"], report["honest_rounds"]
    assert report["lost_ranges"] == 0 and report["duplicated_ranges"] == 0
    assert not report["crashed"], report["crashed"]
    assert report["ok"] and proc.returncode == 0, proc.stdout[-2000:]
