"""`agora launch` configuration: one dataclass, from TOML (`[launch]` table or top level)
with CLI flags on top. The launcher token (the credential facility reports need) comes
from `launcher_token_file` or the environment (`AGORA_LAUNCHER_TOKEN`, read by the CLI),
never from the command line."""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

from node.identity import read_token_file
from node.launch.base import parse_walltime
from protocol.pinning import CoordinatorAddress, parse_address

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {
    "slurm": REPO / "deploy/slurm/agora-node.sbatch",
    "pbs": REPO / "deploy/pbs/agora-node.pbs",
}


@dataclasses.dataclass(kw_only=True, slots=True)
class LaunchConfig:
    scheduler: str  # slurm | pbs
    coordinator: str  # HOST:PORT of agora-coordinator
    facility: str  # unique name of this cluster (and partition) in the run
    partition: str  # Slurm partition / PBS queue
    max_jobs: int  # never more jobs than this, pending + running
    account: str | None = None  # charged account / project
    time: str = "01:00:00"  # walltime of each job, [D-]HH:MM:SS
    gpus_per_job: int = 0  # GPUs per job
    cpus_per_job: int = 1  # CPUs per job
    interval_s: float = 60.0  # seconds between polls of the queue and the coordinator
    startup_s: float = 120.0  # seconds from job start to useful work (reported)
    script: Path | None = None  # batch script (default: deploy/<scheduler>/agora-node.*)
    workdir: Path = Path("~/agora-launch")  # job logs and per-job identity keys
    identity: Path = Path("~/.config/agora/launcher.key")  # the launcher's ed25519 seed
    node_command: str = f"{sys.executable} -m node.main"  # how a job starts agora-node
    node_args: str = ""  # extra agora-node flags for every job
    join_token: str = dataclasses.field(default="", repr=False)  # for closed runs
    launcher_token: str = dataclasses.field(default="", repr=False)  # the run's launcher token
    launcher_token_file: Path | None = None  # file whose first line is the launcher token

    def __post_init__(self) -> None:
        if not self.launcher_token:
            raise ValueError(
                "the coordinator takes facility reports only with the run's launcher token:"
                " pass --launcher-token-file FILE or set AGORA_LAUNCHER_TOKEN"
            )
        if self.scheduler not in SCRIPTS:
            raise ValueError(f"scheduler must be slurm or pbs, got {self.scheduler!r}")
        _ = self.coordinator_addr  # validates --coordinator
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,48}", self.facility):
            raise ValueError(f"--facility must be 1-48 of [A-Za-z0-9_.-], got {self.facility!r}")
        if not 0 <= self.max_jobs <= 4096:
            raise ValueError(f"--max-jobs must be in [0, 4096], got {self.max_jobs}")
        _ = self.walltime_s  # validates --time
        if self.gpus_per_job < 0 or self.cpus_per_job < 1:
            raise ValueError("--gpus-per-job must be >= 0 and cpus_per_job >= 1")
        if self.interval_s <= 0 or self.startup_s < 0:
            raise ValueError("interval_s must be > 0 and startup_s >= 0")
        shlex.split(self.node_args)  # raises ValueError on unbalanced quotes
        self.workdir = Path(self.workdir).expanduser().resolve()
        self.identity = Path(self.identity).expanduser()
        self.script = Path(self.script or SCRIPTS[self.scheduler]).expanduser().resolve()
        if not self.script.is_file():
            raise ValueError(f"batch script {self.script} not found: pass --script FILE")

    @property
    def walltime_s(self) -> int:
        seconds = parse_walltime(self.time)
        if seconds < 60:
            raise ValueError(f"--time {self.time!r} is under a minute")
        return seconds

    @property
    def job_name(self) -> str:
        return f"agora-{self.facility}"

    @property
    def coordinator_addr(self) -> CoordinatorAddress:
        """HOST:PORT[#sha256:HEX]; the jobs get the same text (pin included)."""
        try:
            return parse_address(self.coordinator)
        except ValueError as exc:
            raise ValueError(f"--coordinator: {exc}") from None

    @classmethod
    def load(cls, path: Path | None, overrides: dict[str, Any]) -> LaunchConfig:
        table: dict[str, Any] = {}
        if path is not None:
            with open(path, "rb") as fh:
                raw = tomllib.load(fh)
            table = dict(raw.get("launch", raw))
        unknown = set(table) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown launch settings {sorted(unknown)}")
        table.update({k: v for k, v in overrides.items() if v is not None})
        if table.get("launcher_token_file"):  # the file wins over the environment
            table["launcher_token"] = read_token_file(Path(table["launcher_token_file"]))
        missing = [
            k for k in ("coordinator", "facility", "partition", "max_jobs") if k not in table
        ]
        if missing:
            raise ValueError(
                f"missing settings: {', '.join('--' + m.replace('_', '-') for m in missing)}"
            )
        return cls(**table)
