"""`agora launch`: command building and output parsing for Slurm and PBS on captured
output formats (tests/fixtures/{slurm,pbs}); the PBS side has no live server here."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from node.launch import pbs, slurm
from node.launch.base import (
    ENDED,
    ENDING,
    PENDING,
    RUNNING,
    JobSpec,
    SchedulerError,
    parse_local_time,
    parse_walltime,
)
from node.launch.config import LaunchConfig

REPO = Path(__file__).resolve().parent.parent
FIX = Path(__file__).resolve().parent / "fixtures"


def spec(**kw: object) -> JobSpec:
    base: dict[str, object] = dict(
        name="agora-lab-gpu", partition="workq", walltime_s=4 * 3600, script=Path("/s/job.sh"),
        workdir=Path("/home/alice/agora-launch"),
    )  # fmt: skip
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def local(text: str) -> float:
    return dt.datetime.fromisoformat(text).astimezone().timestamp()


def test_walltime_forms() -> None:
    assert parse_walltime("01:00:00") == 3600
    assert parse_walltime("1-02:00:00") == 26 * 3600
    assert parse_walltime("30") == 1800
    with pytest.raises(ValueError):
        parse_walltime("soon")
    assert parse_local_time("N/A") is None


def test_slurm_submit_command() -> None:
    argv = slurm.submit_args(spec(account="proj42", gpus=2, cpus=8))
    assert argv[:2] == ["sbatch", "--parsable"]
    for want in ("--job-name=agora-lab-gpu", "--partition=workq", "--time=04:00:00",
                 "--account=proj42", "--gpus-per-node=2", "--cpus-per-task=8", "--export=ALL"):  # fmt: skip
        assert want in argv
    assert argv[-1] == "/s/job.sh"
    assert slurm.submit_args(spec(), test_only=True)[1] == "--test-only"
    assert not any(a.startswith("--account") for a in slurm.submit_args(spec()))


def test_slurm_parsers_on_captured_output() -> None:
    err = (FIX / "slurm/sbatch_test_only.err").read_text()
    assert slurm.parse_test_only(err) == local("2026-11-29T19:05:13")
    assert slurm.parse_submit((FIX / "slurm/sbatch_parsable.out").read_text()) == "3410"
    assert slurm.parse_submit("3411;cluster2\n") == "3411"
    with pytest.raises(SchedulerError):
        slurm.parse_submit("sbatch: error: Batch job submission failed\n")
    jobs = {j.job_id: j for j in slurm.parse_jobs((FIX / "slurm/squeue.out").read_text())}
    assert jobs["3401"].state == RUNNING and jobs["3401"].end == local("2026-11-29T18:57:30")
    assert jobs["3402"].state == PENDING
    assert jobs["3395"].state == ENDED and jobs["3395"].exit_ok is False  # pre-empted
    assert jobs["3396"].state == ENDED and jobs["3396"].exit_ok is True
    assert jobs["3397"].state == ENDING
    starts = slurm.parse_starts((FIX / "slurm/squeue_start.out").read_text())
    assert starts == {"3402": local("2026-11-29T19:05:13")}


def test_pbs_submit_command() -> None:
    argv = pbs.submit_args(spec(account="proj42", gpus=1))
    assert argv[0] == "qsub" and argv[-1] == "/s/job.sh"
    joined = " ".join(argv)
    for want in ("-N agora-lab-gpu", "-q workq", "-l walltime=04:00:00",
                 "-l select=1:ncpus=1:ngpus=1", "-A proj42", "-V", "-j oe"):  # fmt: skip
        assert want in joined
    assert "ngpus" not in " ".join(pbs.submit_args(spec()))
    assert pbs.select_args(spec(), "alice") == ["qselect", "-u", "alice", "-N", "agora-lab-gpu"]
    assert pbs.status_args(["1.s"]) == ["qstat", "-x", "-f", "-F", "json", "1.s"]


def test_pbs_parsers_on_captured_output() -> None:
    assert pbs.parse_submit((FIX / "pbs/qsub.out").read_text()) == "4711.pbs01"
    with pytest.raises(SchedulerError):
        pbs.parse_submit("qsub: Unknown queue\n")
    jobs = {j.job_id: j for j in pbs.parse_status((FIX / "pbs/qstat_f_json.json").read_text())}
    run = jobs["4711.pbs01"]
    stime = dt.datetime(2023, 11, 29, 17, 47, 22).astimezone().timestamp()
    assert run.state == RUNNING and run.start == stime and run.end == stime + 4 * 3600
    queued = jobs["4712.pbs01"]
    assert queued.state == PENDING
    assert queued.start == dt.datetime(2023, 11, 29, 18, 30).astimezone().timestamp()
    assert jobs["4698.pbs01"].state == ENDED and jobs["4698.pbs01"].exit_ok is False
    with pytest.raises(SchedulerError):
        pbs.parse_status("qstat: illegally formed job identifier")


def test_pbs_scheduler_over_recorded_commands() -> None:
    """The scheduler's command sequence, replayed from captured outputs."""
    outputs = {
        "qselect": (FIX / "pbs/qselect.out").read_text(),
        "qstat": (FIX / "pbs/qstat_f_json.json").read_text(),
        "qsub": (FIX / "pbs/qsub.out").read_text(),
    }
    calls: list[list[str]] = []

    def replay(argv: Sequence[str], *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        calls.append(list(argv))
        return subprocess.CompletedProcess(list(argv), 0, outputs[argv[0]], "")

    sched = pbs.PbsScheduler(runner=replay, user="alice")
    now = dt.datetime(2023, 11, 29, 18, 0).astimezone().timestamp()
    assert sched.estimate_wait(spec(), now) == pytest.approx(1800.0)
    assert calls[-1][:5] == ["qstat", "-x", "-f", "-F", "json"]
    assert sched.submit(spec()) == "4711.pbs01"


def test_launch_config_validates_and_finds_the_scripts(tmp_path: Path) -> None:
    base = dict(scheduler="slurm", coordinator="h:7700", facility="lab", partition="p",
                max_jobs=2, workdir=tmp_path, launcher_token="t" * 20)  # fmt: skip
    cfg = LaunchConfig(**base)  # type: ignore[arg-type]
    assert cfg.script == REPO / "deploy/slurm/agora-node.sbatch" and cfg.job_name == "agora-lab"
    assert LaunchConfig(**{**base, "scheduler": "pbs"}).script == REPO / "deploy/pbs/agora-node.pbs"  # type: ignore[arg-type]
    for bad in ({"coordinator": "nohost"}, {"time": "00:00:30"}, {"facility": "a b"},
                {"max_jobs": -1}, {"scheduler": "lsf"}):  # fmt: skip
        with pytest.raises(ValueError):
            LaunchConfig(**{**base, **bad})  # type: ignore[arg-type]


def test_the_launcher_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    base = dict(scheduler="slurm", coordinator="h:7700", facility="lab", partition="p",
                max_jobs=2, workdir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="launcher token"):
        LaunchConfig.load(None, base)
    token = tmp_path / "launcher.token"
    token.write_text("from-the-file-0123456789\n")
    cfg = LaunchConfig.load(None, {**base, "launcher_token": "env", "launcher_token_file": token})
    assert cfg.launcher_token == "from-the-file-0123456789"
    assert "from-the-file" not in repr(cfg)
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no token"):
        LaunchConfig.load(None, {**base, "launcher_token_file": empty})
    # the CLI reads AGORA_LAUNCHER_TOKEN; without it (or a file) it says what is missing
    out = subprocess.run(
        [sys.executable, "-m", "swarmlab.cli", "launch", "slurm", "--coordinator", "h:7700",
         "--facility", "lab", "--partition", "p", "--max-jobs", "1", "--once",
         "--workdir", str(tmp_path / "w"), "--identity", str(tmp_path / "k")],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "AGORA_LAUNCHER_TOKEN"},
    )  # fmt: skip
    assert out.returncode == 2 and "AGORA_LAUNCHER_TOKEN" in out.stderr, out.stderr


def test_launcher_is_torch_free_and_helps() -> None:
    code = "import sys, node.launch.cli, node.launch.loop; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
    out = subprocess.run([sys.executable, "-m", "swarmlab.cli", "launch", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "--max-jobs" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "swarmlab.cli", "launch", "slurm", "--coordinator", "x"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "missing settings" in bad.stderr
