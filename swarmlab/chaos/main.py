"""`agora chaos`: the chaos run and its fault-free comparison run of the same seed, the
combined report, and the command line."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from swarmlab.chaos.byzantine import ByzantineRun, byzantine_ok, byzantine_plan
from swarmlab.chaos.heldout import (
    TOKENS_TOLERANCE,
    HeldOut,
    bracket,
    interpolate,
    relative_gap,
)
from swarmlab.chaos.hostile import HostileRun, hostile_plan
from swarmlab.chaos.run import Run
from swarmlab.chaos.schedule import ChaosConfig, plan
from swarmlab.procs import workdir_path

log = logging.getLogger("agora.chaos")


def chaos(cfg: ChaosConfig) -> dict[str, Any]:
    """Run the chaos swarm (and the fault-free one); return the report."""
    window = cfg.minutes * 60
    if cfg.hostile:
        faulty: Run = HostileRun(cfg, "hostile", hostile_plan(cfg.seed, window, cfg))
    elif cfg.byzantine:
        faulty = ByzantineRun(cfg, "byzantine", byzantine_plan(cfg.seed, window, cfg))
    else:
        faulty = Run(cfg, "chaos", plan(cfg.seed, window, cfg))
    calm = Run(cfg, "fault_free", [], keep_states=True) if cfg.baseline != "none" else None
    report: dict[str, Any]
    base: dict[str, Any] | None = None
    target = 0  # the chaos run's committed tokens, once known (sequential)
    if calm is not None and cfg.measures_model:
        # The fault-free run's models are kept, so training on past the window only adds
        # models; it must reach the chaos run's committed tokens, which grow until the
        # chaos run drains (its end waits for late joiners first).
        if cfg.baseline == "concurrent":
            calm.keep_going = lambda run: not faulty.draining.is_set()
        else:
            calm.keep_going = lambda run: (run.committed_now() or 0) < target
    if calm is not None and cfg.baseline == "concurrent":
        box: dict[str, Any] = {}

        def run_calm() -> None:
            try:
                box["result"] = calm.run()
            except Exception as exc:
                log.exception("fault-free run failed")
                box["error"] = f"{type(exc).__name__}: {exc}"

        t = threading.Thread(target=run_calm, daemon=True)
        t.start()
        report = faulty.run()
        t.join()
        base = box.get("result")
    else:
        report = faulty.run()
        target = int(report["committed_tokens"])
        base = calm.run() if calm is not None else None
    report["seed"] = cfg.seed
    report["minutes"] = cfg.minutes
    report["preset"] = cfg.preset
    report["baseline_mode"] = cfg.baseline
    report["final_loss_fault_free"] = base["final_loss"] if base else None
    if base:
        report["fault_free"] = {
            k: base[k]
            for k in ("lost_ranges", "duplicated_ranges", "committed_tokens", "final_loss",
                      "loss_curve", "max_rss_mb", "rss_peak_mb", "crashed",
                      "trained_twice_tokens", "stage0_commits", "model_states",
                      "trained_past_window_s")
            if k in base
        }  # fmt: skip
        if report["final_loss"] and base["final_loss"]:
            report["final_loss_ratio"] = round(report["final_loss"] / base["final_loss"], 4)
    if cfg.measures_model:
        report.update(compare_heldout(faulty, calm if base else None, report["committed_tokens"]))
    if cfg.byzantine:
        report["ok"] = byzantine_ok(report)
    return report


def compare_heldout(faulty: Run, calm: Run | None, tokens: int) -> dict[str, Any]:
    """The chaos run's exported model against the fault-free run's at equal committed
    tokens: the fault-free models kept on either side of the chaos run's committed
    tokens are exported and evaluated on the same held-out set; the nearer one is the
    comparison, the line through both the interpolated figure."""
    out: dict[str, Any] = {
        "tokens_committed": tokens,
        "heldout_loss": None,
        "heldout_loss_fault_free": None,
        "tokens_committed_fault_free": None,
        "heldout_loss_ratio": None,
    }
    held = HeldOut()
    errors = []
    if faulty.final_point is None:
        errors.append("the chaos run left no stage checkpoint of every stage")
    else:
        try:
            out["heldout_loss"] = round(
                held.evaluate(faulty.final_point, faulty.workdir / "model"), 4
            )
        except Exception as exc:  # a model that cannot be assembled is a finding
            log.exception("chaos model evaluation failed")
            errors.append(f"chaos model: {type(exc).__name__}: {exc}")
    if calm is not None:
        near = bracket(calm.points, tokens)
        if not near:
            errors.append("the fault-free run kept no model of every stage")
        evaluated: list[dict[str, Any]] = []
        for i, p in enumerate(near):
            try:
                loss = held.evaluate(p, calm.workdir / f"model_at_{p.committed}")
            except Exception as exc:
                log.exception("fault-free model evaluation failed")
                errors.append(f"fault-free model at {p.committed}: {type(exc).__name__}: {exc}")
                continue
            evaluated.append({
                "tokens_committed": p.committed, "tokens_on_lineage": p.on_chain,
                "rounds": p.rounds, "heldout_loss": round(loss, 4), "nearest": i == 0,
            })  # fmt: skip
        out["fault_free_points"] = evaluated
        if evaluated and evaluated[0]["nearest"]:
            first = evaluated[0]
            out["heldout_loss_fault_free"] = first["heldout_loss"]
            out["tokens_committed_fault_free"] = first["tokens_committed"]
            out["tokens_on_lineage_fault_free"] = first["tokens_on_lineage"]
            out["model_rounds_fault_free"] = first["rounds"]
            gap = relative_gap(first["tokens_committed"], tokens)
            out["tokens_gap"] = None if gap is None else round(gap, 4)
            out["tokens_within_tolerance"] = gap is not None and abs(gap) <= TOKENS_TOLERANCE
        if len(evaluated) == 2:
            a, b = ((e["tokens_committed"], e["heldout_loss"]) for e in evaluated)
            out["heldout_loss_fault_free_interpolated"] = round(interpolate(a, b, tokens), 4)
        last = calm.points[-1] if calm.points else None
        if last is not None:
            try:
                loss = held.evaluate(last, calm.workdir / "model")
                out["heldout_loss_fault_free_final"] = round(loss, 4)
                out["tokens_committed_fault_free_final"] = last.committed
            except Exception as exc:
                log.exception("fault-free final model evaluation failed")
                errors.append(f"fault-free final model: {type(exc).__name__}: {exc}")
        if calm.snapshots is not None:  # the kept states are not needed past this point
            shutil.rmtree(calm.snapshots.into, ignore_errors=True)
    if out["heldout_loss"] and out["heldout_loss_fault_free"]:
        out["heldout_loss_ratio"] = round(out["heldout_loss"] / out["heldout_loss_fault_free"], 4)
    out["tokens_tolerance"] = TOKENS_TOLERANCE
    out["heldout"] = held.describe()
    out["heldout_errors"] = errors
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="agora chaos",
        epilog="The report (--json) gives lost_ranges, duplicated_ranges,"
        " trained_twice_tokens (agora audit), heldout_loss and tokens_committed (the chaos"
        " model), heldout_loss_fault_free and tokens_committed_fault_free (the fault-free"
        " model nearest in committed tokens; tokens_gap is their relative difference,"
        f" within {TOKENS_TOLERANCE:.0%} counts as equal), heldout_loss_ratio,"
        " heldout_loss_fault_free_interpolated (between the two models either side), and"
        " tokens_on_lineage (committed tokens whose outer round is on the exported stage-0"
        " state's lineage). final_loss is the median training loss stage 0 reports over the"
        " last 10% of the window, at whatever tokens each run reached: not a comparison.",
        description="Run a local swarm (coordinator, 2 stages x 2 replicas) under a seeded"
        " schedule of faults: node SIGKILLs with replacements, SIGSTOP zombies, coordinator"
        " SIGKILL+restart, streams cut mid-message, a rogue peer, joins mid outer round. Then"
        " drain, audit, export the model the nodes drained to (theta_g of each stage's last"
        " outer round, from their checkpoints) and evaluate its held-out loss against the"
        " fault-free run of the same seed at equal committed tokens (the fault-free run"
        " keeps every stage state it checkpoints; the models either side of the chaos"
        " run's committed tokens are evaluated). Exit 0 iff no range is lost or duplicated"
        " and no honest process crashed. With --hostile,"
        " real rogue processes and raw sockets play hostile attacks instead (bad addresses,"
        " msgpack amplification, connection floods, slow drips, poisoned gradients, stranger"
        " lease calls, oversized forwards, forged facility reports, key floods and replays,"
        " maximal address lists) while a probe times heartbeats; exit 0 iff additionally"
        " every heartbeat came back within the lease TTL and commits grew in each third of"
        " the window. With --byzantine, a third replica joins one stage at a time and plays"
        " one attack on the outer loop per slot (state takeover through DHT priority,"
        " inflated round and token claims, a delta x100, a sign-flipped delta, noise of"
        " honest norm, NaN and Inf, a smallest-peer-id bootstrap grab, a forged export"
        " source); exit 0 iff additionally the honest replicas of every stage stayed"
        " bitwise identical, no attack got through, and the held-out loss is within 3% of"
        " the fault-free run's at equal committed tokens.",
    )
    p.add_argument("--minutes", type=float, required=True, help="length of the fault window")
    p.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument(
        "--workdir", type=workdir_path, default=None, help="logs and DBs (default a temp dir)"
    )
    p.add_argument(
        "--baseline", choices=("sequential", "concurrent", "none"), default=None,
        help="the fault-free run of the same seed: after the chaos run (default without"
        " --hostile), at the same time (halves the CPU of each; fits a deadline), or none"
        " (default with --hostile)",
    )  # fmt: skip
    p.add_argument(
        "--hostile", action="store_true",
        help="play hostile attacks (swarmlab.chaos.hostile) instead of crashes; the report"
        " adds attacks, heartbeat_max_s, heartbeat_max_gap_s, commits_by_third and ok",
    )  # fmt: skip
    p.add_argument(
        "--byzantine", action="store_true",
        help="play Byzantine replicas (swarmlab.chaos.byzantine) instead of crashes; the report"
        " adds attacks (each with its count and outcome), attackers_rejected,"
        " honest_replicas_identical, honest_rounds and ok",
    )  # fmt: skip
    p.add_argument(
        "--attacks", default="", metavar="A,B,...",
        help="with --byzantine, the attacks to play (default all: state_takeover,"
        " inflated_claims, scaled_delta, sign_flip, noise, nan_inf, bootstrap_grab,"
        " forged_export); the window is split evenly between them",
    )  # fmt: skip
    p.add_argument("--fault-every", type=float, default=45.0, help="mean seconds between faults")
    p.add_argument(
        "--outer-every-steps", type=int, default=10, help="inner steps between DiLoCo rounds"
    )
    p.add_argument("--plan-only", action="store_true", help="print the schedule and exit")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import tempfile

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="agora-chaos-"))
    try:
        cfg = ChaosConfig(
            minutes=args.minutes, seed=args.seed, preset=args.preset, hostile=args.hostile,
            byzantine=args.byzantine,
            attacks=tuple(a for a in args.attacks.split(",") if a),
            baseline=args.baseline or ("none" if args.hostile else "sequential"),
            fault_every_s=args.fault_every, outer_every_steps=args.outer_every_steps,
            workdir=workdir,
        )  # fmt: skip
    except ValueError as exc:
        print(f"agora chaos: {exc}", file=sys.stderr)
        return 2
    if args.plan_only:
        planner = hostile_plan if cfg.hostile else byzantine_plan if cfg.byzantine else plan
        for f in planner(cfg.seed, cfg.minutes * 60, cfg):
            print(f"{f.at_s:8.1f}s  {f.kind:<17} pick={f.pick:.3f} hold={f.hold_s:.1f}s")
        return 0
    print(f"agora chaos: logs in {workdir}", flush=True)
    try:
        report = chaos(cfg)
    except KeyboardInterrupt:
        print("agora chaos: interrupted", file=sys.stderr)
        return 130
    report["workdir"] = str(workdir)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(
        f"faults {report['faults']}; lost {report['lost_ranges']}, duplicated"
        f" {report['duplicated_ranges']} ranges; trained twice"
        f" {report.get('trained_twice_tokens')} tokens; {heldout_line(report)};"
        f" max RSS {report['max_rss_mb']} MB;"
        f" crashed {sorted(report['crashed']) or 'none'}"
    )
    if cfg.hostile:
        print(
            f"attacks { ({k: v['outcome'] for k, v in report['attacks'].items()}) };"
            f" heartbeat max {report['heartbeat_max_s']} s, longest gap"
            f" {report['heartbeat_max_gap_s']} s (TTL {report['lease_ttl_s']} s); committed"
            f" per third {report['commits_by_third']}"
        )
        return 0 if report["ok"] else 1
    if cfg.byzantine:
        print(
            f"attacks { ({k: v['outcome'] for k, v in report['attacks'].items()}) };"
            f" attackers rejected {report['attackers_rejected']}; honest replicas identical"
            f" {report['honest_replicas_identical']} ({report['honest_rounds']})"
        )
        return 0 if report["ok"] else 1
    ok = not report["lost_ranges"] and not report["duplicated_ranges"] and not report["crashed"]
    return 0 if ok else 1


def heldout_line(report: dict[str, Any]) -> str:
    """The held-out comparison in one phrase, for the summary line."""
    if "heldout_loss" not in report:
        return f"final training loss {report['final_loss']} (no model measured)"
    text = f"held-out loss {report['heldout_loss']} at {report['tokens_committed']} tokens"
    if report.get("heldout_loss_fault_free") is not None:
        text += (
            f" vs fault-free {report['heldout_loss_fault_free']} at"
            f" {report['tokens_committed_fault_free']} (ratio {report['heldout_loss_ratio']},"
            f" tokens gap {report['tokens_gap']:+.1%})"
        )
    if report.get("heldout_errors"):
        text += f" [{'; '.join(report['heldout_errors'])}]"
    return text


if __name__ == "__main__":
    sys.exit(main())
