"""`agora chaos`: the chaos run and its fault-free comparison run of the same seed, the
combined report, and the command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

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
    else:
        faulty = Run(cfg, "chaos", plan(cfg.seed, window, cfg))
    report: dict[str, Any]
    if cfg.baseline == "concurrent":
        calm = Run(cfg, "fault_free", [])
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
        base = Run(cfg, "fault_free", []).run() if cfg.baseline == "sequential" else None
    report["seed"] = cfg.seed
    report["minutes"] = cfg.minutes
    report["preset"] = cfg.preset
    report["baseline_mode"] = cfg.baseline
    report["final_loss_fault_free"] = base["final_loss"] if base else None
    if base:
        report["fault_free"] = {
            k: base[k]
            for k in ("lost_ranges", "duplicated_ranges", "committed_tokens", "final_loss",
                      "loss_curve", "max_rss_mb", "rss_peak_mb", "crashed")
        }  # fmt: skip
        if report["final_loss"] and base["final_loss"]:
            report["final_loss_ratio"] = round(report["final_loss"] / base["final_loss"], 4)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="agora chaos",
        description="Run a local swarm (coordinator, 2 stages x 2 replicas) under a seeded"
        " schedule of faults: node SIGKILLs with replacements, SIGSTOP zombies, coordinator"
        " SIGKILL+restart, streams cut mid-message, a rogue peer, joins mid outer round. Then"
        " drain, audit, and compare the loss with a fault-free run of the same seed. Exit 0"
        " iff no range is lost or duplicated and no honest process crashed. With --hostile,"
        " real rogue processes and raw sockets play hostile attacks instead (bad addresses,"
        " msgpack amplification, connection floods, slow drips, poisoned gradients, stranger"
        " lease calls, oversized forwards, forged facility reports, key floods and replays,"
        " maximal address lists) while a probe times heartbeats; exit 0 iff additionally"
        " every heartbeat came back within the lease TTL and commits grew in each third of"
        " the window.",
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
            baseline=args.baseline or ("none" if args.hostile else "sequential"),
            fault_every_s=args.fault_every, outer_every_steps=args.outer_every_steps,
            workdir=workdir,
        )  # fmt: skip
    except ValueError as exc:
        print(f"agora chaos: {exc}", file=sys.stderr)
        return 2
    if args.plan_only:
        planner = hostile_plan if cfg.hostile else plan
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
        f" {report['duplicated_ranges']} ranges; final loss {report['final_loss']}"
        f" (fault-free {report['final_loss_fault_free']}); max RSS {report['max_rss_mb']} MB;"
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
    ok = not report["lost_ranges"] and not report["duplicated_ranges"] and not report["crashed"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
