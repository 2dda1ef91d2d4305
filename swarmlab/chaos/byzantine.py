"""`agora chaos --byzantine`: a Byzantine third replica inside a stage, one attack at a
time, and the judgement of what the two honest replicas of every stage did meanwhile.

`ByzantineRun` is a `Run` (2 stages x 2 honest replicas) whose schedule
(`byzantine_plan`, a pure function of the seed) gives each attack of `ATTACKS` one slot
of the window, in a seeded order, on a seeded stage. In its slot a fresh attacker joins
that stage as its third replica, plays, and is stopped at the slot's end:

- `state_takeover`, `inflated_claims`, `scaled_delta`, `sign_flip`, `noise`, `nan_inf`:
  a real `agora-node` that trains honestly, whose outer-loop process is the rogue one of
  `swarmlab.chaos.rogue_outer` (`NodeConfig.outer_program`): it declares DHT priority
  2**62 and serves a forged state of round 2**62; claims round 2**62 and 10**15 tokens;
  contributes its pseudo-gradient x100, negated, as noise of the same norm, or with NaNs
  and Infs;
- `dht_forgery`: the same, whose outer process stores "not looking for a group" under
  every other member's subkey of the stage's group key, unsigned, before each round;
- `bootstrap_grab`: an honest `agora-node` under a key ground for the smallest peer id
  among `GRIND_KEYS` (the run's DHT bootstrap used to be the smallest peer id);
- `forged_export`: a member serving a forged state of round 2**62 (every weight 1e3)
  over `/agora/state/1` (`swarmlab.chaos.member_attacks`), while `agora export
  --coordinator` runs.

Each play is judged from the honest nodes' structured events (`node.events`) over its
slot, the coordinator's record of the attacker (banned or not) and, for `forged_export`,
the export's summary. Outcomes: `banned` (the coordinator dropped the
attacker on its stage's accusations), `rejected` (an honest reducer left its contribution
out), `ignored` (its claim or offer was not taken: no honest replica reached its forged
round, moved to its DHT or exported its state; for `dht_forgery`, honest DHTs refused
records, counted in their `dht_records_refused` events, while group rounds went on),
`bounded` (its contribution was averaged in, within the robust aggregator's bounds: sign
flips and noise in a group of three are clipped, not refused), `not_defended` (an honest replica took its state, round, DHT or
export) or `not_reached` (it never shared a group round with an honest replica). The
report adds `attacks`, `attackers_rejected` (plays banned, rejected or ignored),
`honest_replicas_identical`, `honest_rounds` (per stage: group rounds all honest replicas
applied, and how many held equal digests), `honest_max_round`, `bans_on_accusations`
(the coordinator's `agora_coordinator_accusations_total{outcome="banned"}`) and `ok`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from coordinator.store import read_peer_states
from node.events import read_events
from protocol.identity import NodeKey
from swarmlab.chaos.run import Run
from swarmlab.chaos.schedule import BYZANTINE, ChaosConfig, Fault
from swarmlab.procs import REPO, child_env, spawn
from swarmlab.swarm import EVENTS_SUFFIX, scrape_metrics

log = logging.getLogger("agora.chaos")

OUTER = {  # chaos attack -> swarmlab.chaos.rogue_outer --attack
    "state_takeover": "state_takeover",
    "inflated_claims": "inflated_claims",
    "scaled_delta": "scaled_delta",
    "sign_flip": "sign_flip",
    "noise": "noise",
    "nan_inf": "nan_delta",
    "dht_forgery": "dht_forgery",
}
ATTACKS = BYZANTINE
HONEST = {"a0": 0, "b0": 0, "a1": 1, "b1": 1}  # Run.start's nodes and their stages
TAKEN_OVER = 2**61  # an honest round past this came from a forged claim
GRIND_KEYS = 2000  # keys `bootstrap_grab` draws to find the smallest peer id
SLOT_GAP_S = 5.0  # seconds between one attacker's stop and the next one's start
EXPORT_AFTER_S = 3.0  # seconds the forger serves as a member before the export starts
EXPORT_TIMEOUT_S = 180.0  # seconds the export may take
BANNED = 'agora_coordinator_accusations_total{outcome="banned"}'
# reasons an honest contribution is left out too (it trained nothing yet, or on an old
# state): not a defence, so not counted as one
BENIGN = ("no tokens", "staleness")


def byzantine_plan(seed: int, window_s: float, cfg: ChaosConfig) -> list[Fault]:
    """One slot per attack over the window, in a seeded order (pure). `pick` chooses the
    stage; `hold_s` is the slot less `SLOT_GAP_S`."""
    attacks = list(cfg.attacks or ATTACKS)
    rng = random.Random(f"{seed}-byzantine")
    rng.shuffle(attacks)
    slot = window_s / len(attacks)
    return [
        Fault(round(i * slot, 2), kind, rng.random(), round(slot - SLOT_GAP_S, 2))
        for i, kind in enumerate(attacks)
    ]


def ground_key(tries: int = GRIND_KEYS) -> NodeKey:
    """The key with the smallest peer id among `tries` fresh ones."""
    return min((NodeKey.generate() for _ in range(tries)), key=lambda k: k.peer_id)


def write_key(path: Path, key: NodeKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.seed)


class ByzantineRun(Run):
    """The chaos swarm with one Byzantine replica at a time (see the module docstring)."""

    def __init__(self, cfg: ChaosConfig, name: str, faults: list[Fault]) -> None:
        super().__init__(cfg, name, faults)
        self.swarm.metrics = True  # the run's count of bans (bans_on_accusations)
        self.counts = {k: 0 for k in ATTACKS}
        self.skipped = {k: 0 for k in ATTACKS}
        self.plays: list[dict[str, Any]] = []

    def _banned(self, peer_id: str) -> bool:
        """Whether the coordinator banned `peer_id` (its database's record, read-only)."""
        try:
            return bool(peer_id) and read_peer_states(self.swarm.db).get(peer_id) == "banned"
        except sqlite3.Error:
            return False

    def _bans_counted(self) -> float:
        """The coordinator's count of bans on accusations (its metric)."""
        coord = self.swarm.coordinator
        if coord is None or coord.metrics_port is None:
            return 0.0
        return scrape_metrics(f"127.0.0.1:{coord.metrics_port}").get(BANNED, 0.0)

    def inject(self, f: Fault) -> None:
        stage = int(f.pick * self.swarm.stages)
        with self.lock:
            self.serial += 1
            name = f"byz{self.serial}-{f.kind}-s{stage}"
            self.killed.add(name)  # an attacker's exit (a ban, our stop) is not a crash
            self.counts[f.kind] += 1
        started, wall0 = self.now(), time.time()
        self.note("attack", attack=f.kind, stage=stage, node=name)
        if f.kind == "forged_export":
            play = self._forged_export(name, stage, f.hold_s)
        else:
            play = self._rogue_node(f.kind, name, stage, f.hold_s)
        wall1 = time.time()
        play.update(
            attack=f.kind, stage=stage, node=name, started_s=round(started, 1),
            ended_s=round(self.now(), 1), banned=self._banned(play.get("peer_id", "")),
        )  # fmt: skip
        play.update(honest_view(self.workdir, stage, play.get("peer_id", ""), wall0, wall1))
        play["outcome"] = judge(f.kind, play)
        with self.lock:
            self.plays.append(play)
        self.note("attack_done", attack=f.kind, outcome=play["outcome"])

    def _rogue_node(self, kind: str, name: str, stage: int, hold_s: float) -> dict[str, Any]:
        """An `agora-node` on `stage` (a rogue outer process, or a ground key), for `hold_s`."""
        key = ground_key() if kind == "bootstrap_grab" else NodeKey.generate()
        write_key(self.workdir / f"{name}.key", key)
        extra: list[str] = []
        if kind in OUTER:
            program = ["-m", "swarmlab.chaos.rogue_outer", "--attack", OUTER[kind]]
            extra = ["--config", str(self.swarm.write_node_config(name, outer_program=program))]
        proc = self.swarm.add_node(name, stage, *extra)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline and proc.alive():
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        exit_code = proc.popen.poll()
        if exit_code is None:
            exit_code = self.swarm.stop_node(name, self.cfg.stop_timeout_s)
        out: dict[str, Any] = {"peer_id": key.peer_id, "exit": exit_code}
        if kind == "bootstrap_grab":
            honest_ids = [NodeKey((self.workdir / f"{n}.key").read_bytes()).peer_id for n in HONEST]
            out["smallest_peer_id"] = key.peer_id < min(honest_ids)
        return out

    def _forged_export(self, name: str, stage: int, hold_s: float) -> dict[str, Any]:
        """The forging member for `hold_s`, and an `agora export --coordinator` meanwhile."""
        result = self.workdir / f"{name}.json"
        args = ["-m", "swarmlab.chaos.member_attacks", "--coordinator", self.swarm.address,
                "--attack", "forged_export", "--stage", str(stage), "--hold", str(hold_s),
                "--json", str(result)]  # fmt: skip
        peers_before = self._stage_peers(stage)
        popen = spawn(self.workdir / f"{name}.log", args, cwd=REPO)
        # the export starts once the forger is a member (so the exporter sees it), at most
        # half the hold later
        deadline = time.monotonic() + hold_s / 2
        while self._stage_peers(stage) <= peers_before and time.monotonic() < deadline:
            time.sleep(1.0)
        time.sleep(EXPORT_AFTER_S)
        summary = self.workdir / f"{name}-export.json"
        try:
            export = subprocess.run(
                [sys.executable, "-m", "swarmlab.cli", "export", "--coordinator",
                 self.swarm.address, "--out", str(self.workdir / f"{name}-model"),
                 "--json", str(summary), "--timeout", str(EXPORT_TIMEOUT_S),
                 "--attest-wait", str(EXPORT_TIMEOUT_S / 2), "--no-progress"],
                env=child_env(), capture_output=True, text=True, cwd=REPO,
                timeout=EXPORT_TIMEOUT_S + 60,
            )  # fmt: skip
            export_exit: int | None = export.returncode
            export_tail = (export.stdout + export.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            export_exit, export_tail = None, "timed out"
        try:
            popen.wait(hold_s + 120)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)
        attacker = _read_json(result)
        got = _read_json(summary)
        rounds = {int(s): int(r) for s, r in got.get("rounds", {}).items()}
        sources = {int(s): str(p) for s, p in got.get("sources", {}).items()}
        return {
            "peer_id": attacker.get("peer_id", ""), "attacker": attacker,
            "export_exit": export_exit, "export_rounds": rounds, "export_sources": sources,
            "export_tail": "" if export_exit == 0 else export_tail,
        }  # fmt: skip

    def _stage_peers(self, stage: int) -> int:
        """The coordinator's count of live peers on `stage` (-1 when it does not answer)."""
        try:
            return next(
                st.peers for st in self.swarm.status(timeout_s=3).stages if st.stage == stage
            )
        except Exception:  # the coordinator may be busy: the caller polls again
            return -1

    def finish(self) -> dict[str, Any]:
        bans = self._bans_counted()  # before the drain stops the coordinator
        report = super().finish()
        per_stage = honest_rounds(self.workdir)
        attacks = summarize(self.plays, self.cfg.attacks or ATTACKS)
        report.update(
            byzantine=True,
            attacks=attacks,
            attackers_rejected=sum(
                1 for p in self.plays if p["outcome"] in ("banned", "rejected", "ignored")
            ),
            honest_rounds=per_stage,
            honest_replicas_identical=bool(per_stage)
            and all(
                s["compared"] > 0 and s["identical"] == s["compared"] for s in per_stage.values()
            ),
            honest_max_round=max((s["max_round"] for s in per_stage.values()), default=0),
            bans_on_accusations=bans,
        )
        return report


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def honest_events(workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """The honest nodes' events, by node name."""
    return {n: read_events(workdir / f"{n}{EVENTS_SUFFIX}") for n in HONEST}


def honest_view(workdir: Path, stage: int, peer: str, t0: float, t1: float) -> dict[str, Any]:
    """What the honest replicas of `stage` did about `peer` between unix times t0 and t1
    (plus the round that was under way at t1)."""
    rejected: dict[str, int] = {}  # kinds of rejection that defend (see BENIGN)
    left_out: dict[str, int] = {}
    accused = 0
    group_rounds: set[int] = set()  # round numbers
    full_rounds: set[int] = set()
    max_round = 0
    moved_to = 0
    refused = 0  # DHT records refused (by anyone's fault: the slot has one attacker)
    for name, events in honest_events(workdir).items():
        if HONEST[name] != stage:
            continue
        for ev in events:
            t = float(ev["t"])
            if not t0 <= t <= t1 + 30.0:
                continue
            if ev["event"] == "round_applied":
                max_round = max(max_round, int(ev["round"]))
                if int(ev["group_size"]) >= 2:
                    group_rounds.add(int(ev["round"]))
                if int(ev["group_size"]) >= 3:  # two honest replicas and the attacker
                    full_rounds.add(int(ev["round"]))
                why = (ev.get("rejected") or {}).get(peer)
                if why:
                    reason = reason_kind(str(why))
                    into = left_out if reason in BENIGN else rejected
                    into[reason] = into.get(reason, 0) + 1
            elif ev["event"] == "accused" and ev["peer"] == peer:
                accused += 1
            elif ev["event"] == "dht_move" and peer and ev.get("root") == peer:
                moved_to += 1
            elif ev["event"] == "dht_records_refused":
                refused += int(ev["count"])
    return {
        "honest_rejections": rejected, "honest_left_out": left_out,
        "honest_accusations": accused,
        "honest_group_rounds": len(group_rounds), "rounds_with_attacker": len(full_rounds),
        "honest_max_round": max_round, "honest_moves_to_attacker": moved_to,
        "honest_records_refused": refused,
    }  # fmt: skip


def reason_kind(why: str) -> str:
    """What kind of rejection a reason is, without its numbers and parts: "part 0: norm
    171 above ...; part 1: ..." -> "norm"; "part 2: pair: cosine -0.3 below ..." ->
    "pair: cosine"."""
    first = re.sub(r"^part \d+: ", "", why.split("; ")[0])
    return re.split(r"\s[-\d.]", first, maxsplit=1)[0][:40]


def honest_rounds(workdir: Path) -> dict[str, dict[str, int]]:
    """Per stage: the group rounds (size >= 2) that every honest replica of the stage
    applied, how many of them left the replicas with one digest, and the newest round."""
    applied: dict[str, dict[int, tuple[str, int]]] = {}
    for name, events in honest_events(workdir).items():
        applied[name] = {
            int(e["round"]): (str(e.get("digest", "")), int(e["group_size"]))
            for e in events
            if e["event"] == "round_applied"
        }
    out: dict[str, dict[str, int]] = {}
    for stage in sorted(set(HONEST.values())):
        names = [n for n, s in HONEST.items() if s == stage]
        common = set.intersection(*(set(applied[n]) for n in names))
        grouped = [r for r in common if all(applied[n][r][1] >= 2 for n in names)]
        same = [r for r in grouped if len({applied[n][r][0] for n in names}) == 1]
        out[str(stage)] = {
            "compared": len(grouped),
            "identical": len(same),
            "max_round": max((r for n in names for r in applied[n]), default=0),
        }
    return out


def judge(kind: str, play: dict[str, Any]) -> str:
    """One play's outcome (see the module docstring)."""
    if play["honest_max_round"] >= TAKEN_OVER or play["honest_moves_to_attacker"]:
        return "not_defended"
    if kind == "forged_export":
        if play["export_exit"] != 0 or not play["attacker"].get("chunks_served"):
            return "not_reached"  # no export, or the exporter never asked the forger
        forged = any(r >= TAKEN_OVER for r in play["export_rounds"].values()) or (
            play["peer_id"] in play["export_sources"].values()
        )
        return "not_defended" if forged else "ignored"
    if kind == "dht_forgery":  # it trains honestly: what it does to its groups is no defence
        refused = play["honest_records_refused"] and play["honest_group_rounds"]
        return "ignored" if refused else "not_reached"
    if play["banned"]:
        return "banned"
    if play["honest_rejections"]:
        return "rejected"
    if kind in ("state_takeover", "inflated_claims", "bootstrap_grab"):
        return "ignored" if play["honest_group_rounds"] else "not_reached"
    return "bounded" if play["rounds_with_attacker"] else "not_reached"


def summarize(plays: list[dict[str, Any]], attacks: tuple[str, ...]) -> dict[str, Any]:
    """Per attack: times played, the outcome over its plays, and the plays."""
    out: dict[str, Any] = {}
    for kind in attacks:
        mine = [p for p in plays if p["attack"] == kind]
        outcomes = sorted({p["outcome"] for p in mine})
        outcome = outcomes[0] if len(outcomes) == 1 else ("mixed" if outcomes else "not played")
        out[kind] = {"count": len(mine), "outcome": outcome, "plays": mine}
    return out


def byzantine_ok(report: dict[str, Any], max_loss_ratio: float = 1.03) -> bool:
    """No honest crash, nothing lost or duplicated, honest replicas identical, no attack
    that got through, and (when measured) the held-out loss within `max_loss_ratio` of
    the fault-free run's at equal committed tokens."""
    ratio = report.get("heldout_loss_ratio")
    return (
        not report["crashed"]
        and report["lost_ranges"] == 0
        and report["duplicated_ranges"] == 0
        and bool(report["honest_replicas_identical"])
        and all(a["outcome"] != "not_defended" for a in report["attacks"].values())
        and (ratio is None or ratio <= max_loss_ratio)
    )
