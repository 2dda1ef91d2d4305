"""`agora-node`'s command line: where the join token comes from (never only the command
line, which `ps` shows to every user of the machine), and a real node process whose
`--memory-limit` holds no stage of the run: refused at join, it exits 3 with the
coordinator's reason (the stage's need and its parts), no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from coordinator_harness import write_config

from node.main import join_token, parse_args
from swarmlab.coordinator import start_coordinator
from swarmlab.procs import REPO, child_env


def test_join_token_from_flag_file_or_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    env = {"AGORA_JOIN_TOKEN": "from-env"}
    assert join_token(parse_args(["--join-token", "flag"]), env) == "flag"
    assert join_token(parse_args(["--join-token-file", str(token_file)]), env) == "from-file"
    assert join_token(parse_args([]), env) == "from-env"
    assert join_token(parse_args([]), {}) is None  # the config file's, if any
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no token"):
        join_token(parse_args(["--join-token-file", str(tmp_path / "empty")]), env)


def test_a_node_whose_memory_limit_holds_no_stage_is_refused_with_the_need(
    tmp_path: Path,
) -> None:
    cfg = write_config(tmp_path, model_preset="tiny", n_stages=2)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    try:
        node = subprocess.run(
            [sys.executable, "-m", "node.main", "--coordinator", coord.address,
             "--device", "cpu", "--memory-limit", "0.001", "--outer-every-steps", "0",
             "--identity", str(tmp_path / "node.key"), "--log-level", "WARNING"],
            env=child_env(), capture_output=True, text=True, timeout=180, cwd=REPO,
        )  # fmt: skip
    finally:
        coord.stop()
    err = node.stderr
    assert node.returncode == 3, node.stdout[-2000:] + err[-3000:]
    assert "Traceback" not in err, err
    assert "refused the join (no_stage_fits)" in err, err
    assert "the smallest stage needs" in err and "1.0 MiB free" in err, err
    assert "weights" in err and "activations" in err, err
