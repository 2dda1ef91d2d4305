"""A replica declares where its outer DHT listens beside its state-sharing priority
(`<prefix>.addrs`), so a replica that downloads state from it can dial it even when its
p2p daemon has never met it ("routing: not found"). Read back from the DHT by a hivemind
client (with the record validator, which checks and strips the replica's signature) in a
child process (hivemind and libp2p do not share a process, and
this test session imports libp2p)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from swarmlab.procs import child_env, free_port, wait_for

SCRIPT = r"""
import json, sys, time, uuid
import torch
from node.outer_link import OuterConfig, OuterLink
from swarmlab.procs import child_env

cfg = OuterConfig(compression="fp16", matchmaking_s=1.5, request_timeout_s=1.0,
                  round_timeout_s=4.0, state_timeout_s=10.0, **json.loads(sys.argv[1]))
run = uuid.uuid4().hex[:8]
link = OuterLink.start(run_id=run, stage=0, numel=64, initial_peers=[], config=cfg,
                       env=child_env())
try:
    link.set_initial_state([torch.zeros(64)])
    from hivemind import DHT
    from node.outer.dht_records import MemberRecords
    from protocol.identity import NodeKey
    # a replica's records carry its signature: a reader checks and strips it
    dht = DHT(initial_peers=link.dht_addrs(), start=True, client_mode=True,
              record_validators=[MemberRecords(NodeKey.generate())])
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


def run_replica(settings: dict[str, object]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(settings)], env=child_env(),
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(got, dict)
    return got


def test_a_replica_declares_its_listen_addresses_in_the_dht() -> None:
    got = run_replica({})
    declared = list(got["declared"].values())
    assert len(declared) == 1, got
    # what the link announces to the coordinator, without the /p2p/<id> suffix
    assert declared[0] == [a.split("/p2p/")[0] for a in got["dht_addrs"]], got


def test_a_replica_behind_a_forwarded_port_announces_and_is_reached_there(
    tmp_path: Path,
) -> None:
    """`port` and `announce` (the node's outer_port / outer_announce): the DHT listens on
    the fixed port, announces only the forwarded one, and a client that knows only the
    announced address reaches it through the forwarder (bench.shaping_proxy)."""
    port, forwarded = free_port(), free_port()
    ready, stats = tmp_path / "ready", tmp_path / "stats.json"
    proxy = subprocess.Popen(
        [sys.executable, "-m", "bench.shaping_proxy", "--rate-mbit", "1000", "--delay-ms", "0",
         f"--route=replica:{forwarded}={port}", "--ready-file", str(ready), "--stats", str(stats)],
        env=child_env(),
    )  # fmt: skip
    try:
        wait_for(ready.exists, "the forwarder to listen", 30)
        announced = f"/ip4/127.0.0.1/tcp/{forwarded}"
        got = run_replica({"port": port, "announce": [announced]})
    finally:
        proxy.send_signal(signal.SIGINT)
        proxy.wait(30)
    dht_addrs = got["dht_addrs"]
    assert isinstance(dht_addrs, list) and dht_addrs
    assert all(a.split("/p2p/")[0] == announced for a in dht_addrs), got
    declared = list(got["declared"].values())  # type: ignore[attr-defined]
    assert declared == [[announced]], got
    replica = json.loads(stats.read_text())["hosts"]["replica"]
    assert replica["connections_in"] >= 1 and replica["bytes_up"] > 0, replica
