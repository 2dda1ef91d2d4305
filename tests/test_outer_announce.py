"""A replica declares where its outer DHT listens beside its state-sharing priority
(`<prefix>.addrs`), so a replica that downloads state from it can dial it even when its
p2p daemon has never met it ("routing: not found"). Read back from the DHT by a plain
hivemind client in a child process (hivemind and libp2p do not share a process, and
this test session imports libp2p)."""

from __future__ import annotations

import json
import subprocess
import sys

from swarmlab.procs import child_env

SCRIPT = r"""
import json, sys, time, uuid
import torch
from node.outer_link import OuterConfig, OuterLink
from swarmlab.procs import child_env

cfg = OuterConfig(compression="fp16", matchmaking_s=1.5, request_timeout_s=1.0,
                  round_timeout_s=4.0, state_timeout_s=10.0)
run = uuid.uuid4().hex[:8]
link = OuterLink.start(run_id=run, stage=0, numel=64, initial_peers=[], config=cfg,
                       env=child_env())
try:
    link.set_initial_state([torch.zeros(64)])
    from hivemind import DHT
    dht = DHT(initial_peers=link.dht_addrs(), start=True, client_mode=True)
    deadline = time.monotonic() + 30
    found = {}
    while not found and time.monotonic() < deadline:
        rec = dht.get(f"agora-{run}-stage0.addrs", latest=True)
        found = {} if rec is None else {
            k.hex(): v.value for k, v in rec.value.items()
        }
        time.sleep(0.5)
    dht.shutdown()
    print(json.dumps({"dht_addrs": link.dht_addrs(), "declared": found}))
finally:
    link.close()
"""


def test_a_replica_declares_its_listen_addresses_in_the_dht() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=child_env(), capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    declared = list(got["declared"].values())
    assert len(declared) == 1, got
    # what the link announces to the coordinator, without the /p2p/<id> suffix
    assert declared[0] == [a.split("/p2p/")[0] for a in got["dht_addrs"]], got
