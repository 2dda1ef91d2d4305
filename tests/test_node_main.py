"""`agora-node`'s command line: where the join token comes from (never only the command
line, which `ps` shows to every user of the machine), the listen address (every
interface by default; refused unless it is /ip4|ip6/IP/tcp/PORT), and a real node process whose
`--memory-limit` holds no stage of the run: refused at join, it exits 3 with the
coordinator's reason (the stage's need and its parts), no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from coordinator_harness import write_config

from node.config import NodeConfig
from node.main import join_token, parse_args
from protocol.identity import NodeKey
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


@pytest.mark.parametrize(
    "listen",
    ["/ip4/10.0.0.1/udp/4001", "/dns4/example.org/tcp/1", "garbage",
     f"/ip4/0.0.0.0/tcp/0/p2p/{NodeKey.generate().peer_id}", "/ip4/999.0.0.1/tcp/1"],
)  # fmt: skip
def test_node_config_refuses_a_listen_address_it_cannot_bind(listen: str) -> None:
    with pytest.raises(ValueError, match="listen"):
        NodeConfig(coordinator="10.0.0.1:7700", listen=listen)
    assert NodeConfig(coordinator="h:1", listen="/ip6/::/tcp/4001").listen == "/ip6/::/tcp/4001"


def test_node_config_refuses_a_state_download_rate_of_zero() -> None:
    with pytest.raises(ValueError, match="outer_min_rate_mb_s must be > 0"):
        NodeConfig(coordinator="h:1", outer_min_rate_mb_s=0.0)


@pytest.mark.parametrize("affinity", [0.5, -1.0, float("nan"), float("inf")])
def test_node_config_refuses_a_route_affinity_that_is_not_a_ratio(affinity: float) -> None:
    with pytest.raises(ValueError, match="route_affinity"):
        NodeConfig(coordinator="h:1", route_affinity=affinity)
    assert NodeConfig(coordinator="h:1", route_affinity=4).route_affinity == 4


def test_node_config_announces_dialable_addresses_on_a_fixed_outer_port() -> None:
    cfg = NodeConfig(
        coordinator="h:1", announce=["/ip4/203.0.113.9/tcp/4001"], outer_port=4002,
        outer_announce=["/dns4/node.example/tcp/4002"],
    )  # fmt: skip
    assert cfg.announce == ["/ip4/203.0.113.9/tcp/4001"] and cfg.outer_port == 4002
    for bad, match in [
        ({"announce": ["/ip4/0.0.0.0/tcp/4001"]}, "announce"),
        ({"announce": ["/ip4/1.2.3.4/tcp/0"]}, "announce"),
        ({"announce": ["/ip4/1.2.3.4/tcp/1"], "no_listen": True}, "no_listen"),
        ({"outer_announce": ["/ip4/1.2.3.4/tcp/1"]}, "fixed outer_port"),
        ({"outer_port": 70000}, "outer_port"),
    ]:
        with pytest.raises(ValueError, match=match):
            NodeConfig(coordinator="h:1", **bad)
