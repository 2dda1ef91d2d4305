"""A swarm across hosts: every process in a Linux network namespace of its own, one node
behind NAT that trains only through the coordinator's relay.

The network (built per test run, names unique, torn down in the fixture's finalizer
even on failure):

    namespace LAN: bridge br0
      |-- veth -- namespace C   10.X.0.1  agora-coordinator --host 10.X.0.1 --relay
      |-- veth -- namespace A0  10.X.0.2  stage-0 node (listens on 0.0.0.0, the default)
      |-- veth -- namespace A1  10.X.0.3  stage-1 node
      `-- veth -- namespace R   10.X.0.4  NAT router: nftables masquerade out of eth0,
                                  |        forward only what the inside opened
                                  `-- veth -- namespace N1  10.X.1.2 (default via 10.X.1.1)
                                               stage-1 node, --no-listen: it dials out,
                                               nobody can dial in

So the two stage-1 replicas are a1 (direct) and n1 (behind NAT): a0's forwards to n1
cross the relay in C, and the DiLoCo rounds of stage 1 average a1 with n1 through
hivemind connections n1 opened itself. The test asserts, from structured events and
the coordinator's SQLite file (never from logs): every node joined; n1 applied outer
rounds in a group of two with its own contribution; a0 committed tokens; no membership
entry holds a 127.0.0.1 or 0.0.0.0 address, a0 and a1 announce their namespace's IP and
n1 only circuit addresses; then a clean stop (exit 0 everywhere) and `agora audit` finds
nothing lost or duplicated.

Needs root, `ip netns` (iproute2) and `nft` (Debian: apt-get install nftables, as
.ci/run does); it skips with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from node.events import read_events
from protocol.addrs import is_loopback, is_wildcard
from protocol.identity import NodeKey
from swarmlab.coordinator import audit
from swarmlab.procs import Proc, child_env, wait_for
from swarmlab.swarm import EVENTS_SUFFIX, LocalSwarm

START_S = 180.0  # seconds for the processes to import torch, reserve and join (loaded box)
TRAIN_S = 240.0  # seconds for a group round across the NAT and commits
STOP_S = 90.0  # seconds for the nodes' drains
CMD_S = 20.0  # seconds one `ip` / `nft` command may take

IP = shutil.which("ip")
NFT = shutil.which("nft")
NODES = ("a0", "a1", "n1")  # n1 is behind the NAT


def _netns_problem() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if IP is None:
        return "the `ip` command (iproute2) is not installed"
    if NFT is None:
        return "the `nft` command is not installed (Debian: apt-get install -y nftables)"
    probe = f"agora-probe-{secrets.token_hex(3)}"
    made = subprocess.run(
        [IP, "netns", "add", probe], capture_output=True, text=True, timeout=CMD_S
    )
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()[:200]}"
    try:
        nat = subprocess.run(
            [IP, "netns", "exec", probe, NFT, "add", "table", "ip", "probe"],
            capture_output=True, text=True, timeout=CMD_S,
        )  # fmt: skip
        if nat.returncode != 0:
            return f"nftables does not work in a namespace here: {nat.stderr.strip()[:200]}"
    finally:
        subprocess.run([IP, "netns", "del", probe], capture_output=True, timeout=CMD_S)
    return None


_PROBLEM = _netns_problem()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")]


def sh(*args: str, stdin: str | None = None) -> None:
    """Run one command; raise with its output if it fails."""
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=CMD_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-500:]}")


@dataclass
class Net:
    """The namespaces of one test run: `ns[name]` is the namespace of host `name`."""

    prefix: str  # unique per run: every namespace name starts with it
    subnet: int  # the X of 10.X.0.0/24 (LAN) and 10.X.1.0/24 (behind the NAT)
    ns: dict[str, str] = field(default_factory=dict)

    def ip(self, host: str) -> str:
        return {"c": f"10.{self.subnet}.0.1", "a0": f"10.{self.subnet}.0.2",
                "a1": f"10.{self.subnet}.0.3", "r": f"10.{self.subnet}.0.4",
                "n1": f"10.{self.subnet}.1.2"}[host]  # fmt: skip

    def run_in(self, host: str, *args: str, stdin: str | None = None) -> None:
        assert IP is not None
        sh(IP, "netns", "exec", self.ns[host], *args, stdin=stdin)

    def build(self) -> None:
        assert IP is not None and NFT is not None
        for host in ("lan", "c", "a0", "a1", "r", "n1"):
            self.ns[host] = f"{self.prefix}-{host}"
            sh(IP, "netns", "add", self.ns[host])
            sh(IP, "-n", self.ns[host], "link", "set", "lo", "up")
        lan = self.ns["lan"]
        sh(IP, "-n", lan, "link", "add", "br0", "type", "bridge")
        sh(IP, "-n", lan, "link", "set", "br0", "up")
        for host in ("c", "a0", "a1", "r"):  # eth0 in the host, port `host` on the bridge
            sh(IP, "link", "add", "eth0", "netns", self.ns[host], "type", "veth",
               "peer", "name", host, "netns", lan)  # fmt: skip
            sh(IP, "-n", lan, "link", "set", host, "master", "br0", "up")
            sh(IP, "-n", self.ns[host], "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
            sh(IP, "-n", self.ns[host], "link", "set", "eth0", "up")
        inside = f"10.{self.subnet}.1.1"
        sh(IP, "link", "add", "in0", "netns", self.ns["r"], "type", "veth",
           "peer", "name", "eth0", "netns", self.ns["n1"])  # fmt: skip
        sh(IP, "-n", self.ns["r"], "addr", "add", f"{inside}/24", "dev", "in0")
        sh(IP, "-n", self.ns["r"], "link", "set", "in0", "up")
        sh(IP, "-n", self.ns["n1"], "addr", "add", f"{self.ip('n1')}/24", "dev", "eth0")
        sh(IP, "-n", self.ns["n1"], "link", "set", "eth0", "up")
        sh(IP, "-n", self.ns["n1"], "route", "add", "default", "via", inside)
        self.run_in("r", "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        # masquerade what leaves through eth0; forward from outside only replies
        self.run_in(
            "r",
            NFT,
            "-f",
            "-",
            stdin="""
table ip agora_nat {
    chain nat_out { type nat hook postrouting priority srcnat; oifname "eth0" masquerade; }
    chain inbound {
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "in0" oifname "eth0" accept
    }
}
""",
        )

    def destroy(self) -> None:
        assert IP is not None
        for name in self.ns.values():  # deleting a namespace deletes its veth ends too
            subprocess.run([IP, "netns", "del", name], capture_output=True, timeout=CMD_S)


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net(prefix=f"agora-{secrets.token_hex(3)}", subnet=100 + secrets.randbelow(100))
    try:
        n.build()
        yield n
    finally:
        n.destroy()


def spawn_in(net: Net, host: str, workdir: Path, name: str, args: list[str]) -> Proc:
    """`python ARGS` in host's namespace (`ip netns exec` execs it: the pid is python's)."""
    assert IP is not None
    log = workdir / f"{name}.log"
    with log.open("ab") as fh:
        popen = subprocess.Popen(
            [IP, "netns", "exec", net.ns[host], sys.executable, *args],
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=child_env(), cwd=workdir,
        )  # fmt: skip
    return Proc(name, popen, log)


def ordered_keys(workdir: Path) -> dict[str, str]:
    """Identity files for the nodes, n1's peer id the smallest: when the smallest id
    announcing a DHT was the run's DHT root, n1 behind the NAT took the role and nobody
    could dial it; the coordinator now assigns the root among directly reachable members
    (`coordinator.membership.Membership.dht_root`)."""
    keys = sorted((NodeKey.generate() for _ in NODES), key=lambda k: k.peer_id, reverse=True)
    ids = {}
    for name, key in zip(NODES, keys, strict=True):
        (workdir / f"{name}.key").write_bytes(key.seed)
        ids[name] = key.peer_id
    return ids


def membership(db: Path) -> dict[str, dict[str, Any]]:
    """The coordinator's stored membership: peer id -> state, stage, p2p and DHT addrs."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        rows = conn.execute("SELECT peer_id, state, stage, addrs FROM peers").fetchall()
    out = {}
    for pid, state, stage, book in rows:
        addrs = json.loads(book)
        out[pid] = {"state": state, "stage": stage, "p2p": addrs["p2p"], "dht": addrs["dht"]}
    return out


def test_a_swarm_across_namespaces_trains_with_a_node_behind_nat(net: Net, tmp_path: Path) -> None:
    assert IP is not None
    sw = LocalSwarm(workdir=tmp_path / "run", preset="tiny", stages=2)  # its config writers
    work = sw.workdir
    run_toml = sw.write_run_config()
    node_toml = sw.write_node_config(
        outer_every_steps=3, inner_batch_tokens=2048, outer_matchmaking_s=2.0
    )
    ids = ordered_keys(work)
    db = work / "coordinator.sqlite"
    port_file = work / "coordinator.port"
    procs: dict[str, Proc] = {}

    def tails() -> str:
        return "\n".join(f"--- {p.name}:\n{p.tail(25)}" for p in procs.values())

    def poll(predicate: Any, what: str, timeout_s: float) -> Any:
        for p in procs.values():
            if not p.alive():
                raise AssertionError(f"{p.name} exited with {p.popen.returncode}\n{tails()}")
        return wait_for(predicate, what, timeout_s, poll_s=0.5, detail=tails)

    def events(name: str, kind: str) -> list[dict[str, Any]]:
        return read_events(work / f"{name}{EVENTS_SUFFIX}", kind)

    def alive_and(check: Any) -> Any:
        def predicate() -> Any:
            dead = [p for p in procs.values() if not p.alive()]
            if dead:
                raise AssertionError(f"{dead[0].name} exited early\n{tails()}")
            return check()

        return predicate

    try:
        procs["coordinator"] = spawn_in(net, "c", work, "coordinator", [
            "-m", "coordinator.main", "--host", net.ip("c"), "--port", "0",
            "--port-file", str(port_file), "--db", str(db), "--config", str(run_toml),
            "--relay",
        ])  # fmt: skip
        port = poll(alive_and(lambda: port_file.exists() and port_file.read_text().strip()),
                    "the coordinator's port", START_S)  # fmt: skip
        coordinator = f"{net.ip('c')}:{port}"
        for name, host, stage, extra in (
            ("a0", "a0", 0, []), ("a1", "a1", 1, []), ("n1", "n1", 1, ["--no-listen"])
        ):  # fmt: skip
            procs[name] = spawn_in(net, host, work, name, [
                "-m", "node.main", "--coordinator", coordinator, "--config", str(node_toml),
                "--identity", str(work / f"{name}.key"), "--stage", str(stage),
                "--events", str(work / f"{name}{EVENTS_SUFFIX}"), "--device", "cpu", *extra,
            ])  # fmt: skip

        poll(alive_and(lambda: all(events(n, "joined") for n in NODES)), "every join", START_S)
        # Nobody dials into the NAT: not even a route to n1 from the LAN.
        blocked = subprocess.run(
            [IP, "netns", "exec", net.ns["a1"], "bash", "-c",
             f"exec 3<>/dev/tcp/{net.ip('n1')}/9"],
            capture_output=True, text=True, timeout=CMD_S,
        )  # fmt: skip
        assert blocked.returncode != 0, "a LAN host reached the NAT'd node directly"

        # The NAT'd stage-1 replica trains (only relayed forwards reach it) and averages
        # with a1 in DiLoCo rounds over connections it opened itself.
        def grouped() -> bool:
            return any(
                e["group_size"] >= 2 and e["contributed"] for e in events("n1", "round_applied")
            )

        poll(alive_and(grouped), "a group round of n1 with its contribution", TRAIN_S)
        poll(
            alive_and(lambda: sum(e["end"] - e["start"] for e in events("a0", "lease_committed"))
                      >= 4096),
            "a0's commits", TRAIN_S,
        )  # fmt: skip

        view = membership(db)
        live = {pid: m for pid, m in view.items() if m["state"] == "live"}
        assert set(live) == set(ids.values()), view
        every = [a for m in view.values() for a in (*m["p2p"], *m["dht"])]
        assert not [a for a in every if is_loopback(a) or is_wildcard(a)], view
        for name in ("a0", "a1"):
            mine = live[ids[name]]
            assert mine["p2p"] and mine["dht"], mine
            assert all(f"/ip4/{net.ip(name)}/" in a for a in mine["p2p"]), mine
            assert any(f"/ip4/{net.ip(name)}/" in a for a in mine["dht"]), mine
        nat = live[ids["n1"]]
        assert nat["p2p"] and all("/p2p-circuit/" in a for a in nat["p2p"]), nat
        assert all(f"/ip4/{net.ip('c')}/" in a for a in nat["p2p"]), nat  # the relay in C

        for name in NODES:
            procs[name].signal(signal.SIGINT)
        codes = {n: procs[n].popen.wait(STOP_S) for n in NODES}
        procs["coordinator"].signal(signal.SIGINT)
        codes["coordinator"] = procs["coordinator"].popen.wait(STOP_S)
        assert codes == dict.fromkeys([*NODES, "coordinator"], 0), tails()
    finally:
        for p in procs.values():
            if p.alive():
                p.signal(signal.SIGKILL)
                p.popen.wait(10)

    report = audit(db)
    assert report.clean, report.stdout
    assert report.lost_ranges == 0 and report.duplicated_ranges == 0, report.summary()
    assert report.committed_tokens >= 4096, report.summary()
    stored = [a for m in membership(db).values() for a in (*m["p2p"], *m["dht"])]
    assert not [a for a in stored if is_loopback(a) or is_wildcard(a)], stored
