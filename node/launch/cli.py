"""`agora launch slurm|pbs`: run on a cluster login node, as yourself, to keep agora-node
jobs queued in the numbers the run's coordinator asks of this facility."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import trio

from node.identity import load_or_create_key
from node.launch.base import SchedulerError
from node.launch.config import LaunchConfig
from protocol.identity import NodeKey
from protocol.pinning import PinMismatch

log = logging.getLogger("agora.launch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agora launch",
        description="Keep agora-node batch jobs on this cluster in the numbers the run's "
        "coordinator asks for: estimate the queue wait, report it with the running and "
        "pending jobs, submit or cancel jobs, replace failed or pre-empted ones. Each job "
        "gets its walltime end as the node's --deadline. Runs as you; needs no privileges.",
    )
    p.add_argument("scheduler", choices=("slurm", "pbs"), help="the cluster's batch scheduler")
    p.add_argument(
        "--coordinator", metavar="HOST:PORT#sha256:HEX",
        help="the run's agora-coordinator, pinned by the fingerprint of its TLS certificate"
        " (printed by agora-coordinator at start): the launcher token is sent to no other",
    )  # fmt: skip
    p.add_argument("--facility", help="a unique name for this cluster in the run, e.g. jureca-gpu")
    p.add_argument("--partition", help="Slurm partition / PBS queue the jobs go to")
    p.add_argument("--max-jobs", type=int, help="never more than N jobs (pending + running)")
    p.add_argument("--account", help="account / project the jobs are charged to")
    p.add_argument("--time", help="walltime of each job, HH:MM:SS (default 01:00:00)")
    p.add_argument("--gpus-per-job", type=int, help="GPUs per job (default 0)")
    p.add_argument("--cpus-per-job", type=int, help="CPUs per job (default 1)")
    p.add_argument("--interval", dest="interval_s", type=float, help="seconds between polls (60)")
    p.add_argument("--startup", dest="startup_s", type=float,
                   help="seconds from job start to useful work, reported (default 120)")  # fmt: skip
    p.add_argument("--script", type=Path, help="batch script (default deploy/<scheduler>/...)")
    p.add_argument("--workdir", type=Path, help="job logs and keys (default ~/agora-launch)")
    p.add_argument("--identity", type=Path, help="launcher key (~/.config/agora/launcher.key)")
    p.add_argument(
        "--node-command", help="how a job starts a node (default: this python -m node.main)"
    )
    p.add_argument("--node-args", help='extra agora-node flags, e.g. "--device cuda"')
    p.add_argument(
        "--launcher-token-file", type=Path, metavar="FILE",
        help="the run's launcher token, first line of FILE (or set AGORA_LAUNCHER_TOKEN)",
    )  # fmt: skip
    p.add_argument("--config", type=Path, help="TOML file with a [launch] table")
    p.add_argument("--once", action="store_true", help="poll once and exit (for cron)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    return p.parse_args(argv)


async def _run(cfg: LaunchConfig, key: NodeKey, once: bool) -> None:
    from node.coordinator_client import ClientConfig, CoordinatorClient
    from node.launch.loop import Launcher
    from node.launch.pbs import PbsScheduler
    from node.launch.slurm import SlurmScheduler

    scheduler = SlurmScheduler() if cfg.scheduler == "slurm" else PbsScheduler()
    client_cfg = ClientConfig(call_timeout_s=min(30.0, cfg.interval_s * 2 + 5))
    async with CoordinatorClient.to(cfg.coordinator_addr, key, config=client_cfg) as client:
        await Launcher(cfg, scheduler, client).run(once=once)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        cfg = LaunchConfig.load(
            args.config,
            {
                "scheduler": args.scheduler,
                "coordinator": args.coordinator,
                "facility": args.facility,
                "partition": args.partition,
                "max_jobs": args.max_jobs,
                "account": args.account,
                "time": args.time,
                "gpus_per_job": args.gpus_per_job,
                "cpus_per_job": args.cpus_per_job,
                "interval_s": args.interval_s,
                "startup_s": args.startup_s,
                "script": args.script,
                "workdir": args.workdir,
                "identity": args.identity,
                "node_command": args.node_command,
                "node_args": args.node_args,
                "join_token": os.environ.get("AGORA_JOIN_TOKEN"),
                "launcher_token": os.environ.get("AGORA_LAUNCHER_TOKEN") or None,
                "launcher_token_file": args.launcher_token_file,
            },
        )
        if cfg.coordinator_addr.pin is None:
            raise ValueError(
                "--coordinator must carry the coordinator's fingerprint (HOST:PORT#sha256:HEX):"
                " the launcher token goes only to an authenticated coordinator"
            )
        cfg.workdir.mkdir(parents=True, exist_ok=True)
        key = load_or_create_key(cfg.identity)
    except (ValueError, OSError) as exc:
        print(f"agora launch: {exc}", file=sys.stderr)
        return 2
    log.info(
        "launching on %s facility %s (partition %s, up to %d jobs of %s) for %s as %s",
        cfg.scheduler, cfg.facility, cfg.partition, cfg.max_jobs, cfg.time,
        cfg.coordinator, key.peer_id,
    )  # fmt: skip
    try:
        trio.run(_run, cfg, key, args.once)
    except KeyboardInterrupt:
        log.info("interrupted; jobs keep running (they drain at their deadline)")
        return 130
    except (SchedulerError, PinMismatch) as exc:
        print(f"agora launch: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
