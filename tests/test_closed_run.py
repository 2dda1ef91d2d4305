"""Closed runs on the data plane: an outsider is refused at join AND by the peers.

For each closed auth mode (`token`, `allowlist`) a real coordinator and two real nodes
(stage 0 and stage 1, tiny preset, no outer loop) run on loopback. A rogue process
(`swarmlab.chaos.rogue`) then:

- `outsider`: with a fresh key, joins without the token (and with a wrong one): the
  coordinator answers `unauthorized`; then it sends a well-formed Forward to the honest
  stage-1 node, which refuses it with `not_member` (it is not in the run's view);
- `control`: with the token / an allowlisted key, it joins and sends the same Forward,
  which is answered: the refusal above is about membership, not a broken request.

Admin calls without the admin token and replayed control requests are covered by
tests/test_coordinator_abuse.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protocol.identity import NodeKey
from swarmlab.procs import child_env
from swarmlab.swarm import LocalSwarm

REPO = Path(__file__).resolve().parent.parent
START_S = 200.0  # seconds for the nodes to import torch, build and serve (loaded box)
STOP_S = 150.0  # seconds for the drain and exit of both nodes (loaded box)
TOKEN = "closed-run-s3cret"


def _wait(swarm: LocalSwarm, what: str, timeout_s: float, pred: Callable[[], object]) -> None:
    """`LocalSwarm.wait_for`, failing at once if a node exits meanwhile."""

    def check() -> object:
        for name, proc in swarm.nodes.items():
            assert proc.alive(), f"{name} exited {proc.popen.returncode}:\n{proc.tail(30)}"
        return pred()

    swarm.wait_for(check, what, timeout_s)


def _closed_swarm(workdir: Path, mode: str, keys: dict[str, NodeKey]) -> LocalSwarm:
    """A swarm whose coordinator runs in auth `mode`; nodes use the token / listed keys."""
    for name, key in keys.items():
        (workdir / f"{name}.key").write_bytes(key.seed)
    auth: dict[str, object] = {}
    if mode == "token":
        auth = {"auth": "token", "join_token": TOKEN}
    elif mode == "allowlist":
        auth = {"auth": "allowlist", "allowlist": [k.peer_id for k in keys.values()]}
    swarm = LocalSwarm(
        workdir=workdir,
        preset="tiny",
        stages=2,
        codec="subspace_int8",
        run_config={"run_id": "closed", **auth},
    )
    node_toml = swarm.write_node_config(outer_every_steps=0)
    token_file = workdir / "join-token"  # not on the command line, where `ps` shows it
    token_file.write_text(TOKEN + "\n")
    swarm.node_args = ["--config", str(node_toml)] + (
        ["--join-token-file", str(token_file)] if mode == "token" else []
    )
    return swarm


@pytest.fixture(params=["token", "allowlist"])
def closed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, LocalSwarm]]:
    mode = request.param
    keys = {n: NodeKey.generate() for n in ("a0", "a1", "insider")}
    swarm = _closed_swarm(tmp_path, mode, keys)
    try:
        swarm.start_coordinator()
        swarm.add_node("a0", 0)
        swarm.add_node("a1", 1)
        yield mode, swarm
    finally:
        swarm.kill_all()


def test_outsider_refused_at_join_and_on_the_data_plane(closed: tuple[str, LocalSwarm]) -> None:
    mode, swarm = closed
    _wait(
        swarm,
        "a1 to serve forwards",
        START_S,
        lambda: swarm.scrape("a1").get("agora_p2p_served_total", 0) > 0,
    )
    refused_before = swarm.scrape("a1").get('agora_p2p_refused_total{reason="not_member"}', 0)
    victim = NodeKey((swarm.workdir / "a1.key").read_bytes()).peer_id
    out = swarm.workdir / "rogue.json"
    rogue = subprocess.run(
        [sys.executable, "-m", "swarmlab.chaos.rogue", "--coordinator", swarm.address,
         "--victim", victim, "--json", str(out), "--attacks", "outsider,control",
         *(["--join-token", TOKEN] if mode == "token" else []),
         "--identity", str(swarm.workdir / "insider.key")],
        env=child_env(), capture_output=True, text=True, timeout=150, cwd=REPO,
    )  # fmt: skip
    assert rogue.returncode == 0, rogue.stdout[-3000:] + rogue.stderr[-3000:]
    results = json.loads(out.read_text())

    outsider = results["outsider"]
    assert outsider["join"] == "unauthorized", outsider
    assert outsider["join_wrong_token"] == "unauthorized", outsider
    assert outsider["forward"] == {"outcome": "refused", "reason": "not_member"}, outsider
    # The control: an insider's identical request is served.
    assert results["control"]["outcome"] == "answered", results["control"]
    assert results["control"]["after"]["outcome"] == "answered", results["control"]

    after = swarm.scrape("a1")
    assert after.get('agora_p2p_refused_total{reason="not_member"}', 0) > refused_before
    status = swarm.status()
    assert sum(st.peers for st in status.stages) == 2, status  # the outsider never joined
    codes = swarm.stop(timeout_s=STOP_S)
    assert codes == {"a0": 0, "a1": 0, "coordinator": 0}, {
        n: p.tail(20) for n, p in swarm.nodes.items()
    }
    assert TOKEN not in "".join(p.log.read_text() for p in swarm.nodes.values())
    assert swarm.coordinator is not None and TOKEN not in swarm.coordinator.log.read_text()
