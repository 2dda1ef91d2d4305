"""`agora export --coordinator`: observer membership against a real coordinator (auth
modes, no lease, no stage, no scrape target, gone after the export), and a live export
from a real swarm over py-libp2p that evaluates better than the untrained model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from coordinator_harness import write_config

from coordinator.journal import Journal
from coordinator.membership import LEFT, Membership, Peer
from node.baseline import evaluate_weights
from node.checkpoint import GlobalState
from node.coordinator_client import ClientConfig, CoordinatorClient, CoordinatorError
from node.data import load_dataset
from node.export import main as export_main
from node.export_live import (
    LiveExportError,
    LiveOptions,
    StageLayout,
    StageState,
    _Fetcher,
    fetch_attested,
)
from node.model import build_stage, load_export
from node.p2p.host import Libp2pTransport
from node.p2p.transport import P2PConfig
from node.state_server import StateServer
from node.worker import TorchWorker
from protocol import control as c
from protocol.identity import NodeKey
from protocol.lineage import state_digest
from protocol.state import STATE_PROTOCOL
from swarmlab.coordinator import start_coordinator
from swarmlab.procs import child_env, wait_for
from swarmlab.swarm import LocalSwarm

REPO = Path(__file__).resolve().parent.parent
FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)
TOKEN = "j0in-t0ken"


async def _error_code(coro: Any) -> str:
    try:
        await coro
    except CoordinatorError as exc:
        return exc.code
    raise AssertionError("the call succeeded but an error reply was expected")


def _sd_targets(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {t for group in json.loads(path.read_text()) for t in group["targets"]}


def test_observer_membership(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Token auth applies to observers; an observer is listed (flagged, on no stage) but
    gets no lease, is in no stage's count, metrics or file-SD; `agora export` names what
    is missing and leaves the run when it fails."""
    sd = tmp_path / "sd.json"
    cfg = write_config(
        tmp_path, auth="token", join_token=TOKEN, prometheus_sd=str(sd),
        lease_ttl_s=20.0, heartbeat_interval_s=1.0,
    )  # fmt: skip
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite", metrics=True)
    metrics_url = f"http://127.0.0.1:{coord.metrics_port}/metrics"
    kobs, knode = NodeKey.generate(), NodeKey.generate()
    address = coord.address

    async def main() -> None:
        port = coord.port
        async with (
            CoordinatorClient("127.0.0.1", port, kobs, config=FAST, pin=coord.fingerprint) as obs,
            CoordinatorClient("127.0.0.1", port, knode, config=FAST, pin=coord.fingerprint) as node,
        ):
            assert await _error_code(obs.join(c.JoinRequest(observer=True))) == "unauthorized"
            bad = c.JoinRequest(observer=True, join_token=TOKEN, stage=0)
            assert await _error_code(obs.join(bad)) == "bad_request"
            joined = await obs.join(
                c.JoinRequest(observer=True, join_token=TOKEN, metrics_port=9102)
            )
            assert joined.stage == joined.run.n_stages == 2  # on no stage
            placed = await node.join(c.JoinRequest(join_token=TOKEN, metrics_port=9101))
            assert placed.stage == 0  # placement did not count the observer

            evict = c.JoinRequest(observer=True, join_token=TOKEN)
            assert await _error_code(node.join(evict)) == "bad_request"  # a live node's key
            grant = await obs.acquire_grant()
            assert grant.lease is None and grant.reason == "observer"
            beat = await obs.heartbeat()
            assert beat.stage == 2 and not beat.moved
            view = await node.membership()
            assert view.peers[kobs.peer_id].observer and view.peers[kobs.peer_id].stage == 2
            assert not view.peers[knode.peer_id].observer
            status = await obs.status()
            assert (status.peers, status.observers) == (1, 1)
            assert [s.peers for s in status.stages] == [1, 0]
            await trio.to_thread.run_sync(
                lambda: wait_for(lambda: _sd_targets(sd), "the file-SD with the node")
            )
            assert _sd_targets(sd) == {"127.0.0.1:9101"}  # the observer is no target

            # the export CLI: refused without the token; with it, stage 1 has no replica
            args = ["--coordinator", address, "--out", str(tmp_path / "m"), "--no-progress"]
            assert await trio.to_thread.run_sync(export_main, args) == 2
            assert "unauthorized" in capsys.readouterr().err
            with_token = [*args, "--join-token", TOKEN, "--timeout", "60"]
            assert await trio.to_thread.run_sync(export_main, with_token) == 2
            err = capsys.readouterr().err
            assert "no live replica of stage(s) [1]" in err, err
            status = await obs.status()
            assert (status.peers, status.observers) == (1, 1)  # the exporter left

    trio.run(main)
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    assert 'agora_coordinator_peers{stage="0"} 1.0' in text
    assert 'agora_coordinator_peers{stage="1"} 0.0' in text
    assert coord.stop() == 0


def test_observer_on_an_allowlist(tmp_path: Path) -> None:
    allowed, other = NodeKey.generate(), NodeKey.generate()
    cfg = write_config(tmp_path, auth="allowlist", allowlist=[allowed.peer_id])
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")

    async def main() -> None:
        async with (
            CoordinatorClient(
                "127.0.0.1", coord.port, allowed, config=FAST, pin=coord.fingerprint
            ) as a,
            CoordinatorClient(
                "127.0.0.1", coord.port, other, config=FAST, pin=coord.fingerprint
            ) as b,
        ):
            assert await _error_code(b.join(c.JoinRequest(observer=True))) == "unauthorized"
            assert (await a.join(c.JoinRequest(observer=True))).stage == 2
            await a.leave()
            assert (await a.status()).observers == 0

    trio.run(main)
    assert coord.stop() == 0


# --- end to end: a live export from a real swarm ---------------------------------------------


def _poll(predicate: Callable[[], Any], timeout_s: float, what: str, swarm: LocalSwarm) -> Any:
    """`LocalSwarm.wait_for`: poll until truthy; on timeout fail with the log tails."""
    return swarm.wait_for(predicate, what, timeout_s)


def _outer_steps(swarm: LocalSwarm, name: str) -> float:
    return swarm.scrape(name).get("agora_node_outer_steps_total", 0.0)


@pytest.mark.timeout(600)  # three interpreters importing torch + hivemind on a loaded 2-core box
def test_live_export_from_a_swarm(tmp_path: Path) -> None:
    """Coordinator + 2 stages x 1 replica with outer rounds every 3 inner steps: once each
    stage applied rounds, `agora export --coordinator` (a subprocess, joining as an
    observer over py-libp2p) writes a model that beats the untrained one; the swarm
    trains on and drains cleanly afterwards."""
    swarm = LocalSwarm(workdir=tmp_path / "run", preset="tiny")
    toml = swarm.write_node_config(
        outer_every_steps=3, inner_batch_tokens=1024, outer_matchmaking_s=1.0, warmup_steps=1
    )
    swarm.node_args = ["--config", str(toml)]
    names = {"s0": 0, "s1": 1}
    try:
        swarm.start_coordinator()
        for name, stage in names.items():
            swarm.add_node(name, stage)
        _poll(
            lambda: all(_outer_steps(swarm, n) >= 3 for n in names),
            400,
            "three applied outer rounds on each stage",
            swarm,
        )
        out, summary = tmp_path / "model", tmp_path / "export.json"
        proc = subprocess.run(
            [sys.executable, "-m", "swarmlab.cli", "export", "--coordinator", swarm.address,
             "--out", str(out), "--json", str(summary), "--timeout", "180",
             "--member-wait", "60", "--chunk-elements", "100000"],
            env=child_env(), capture_output=True, text=True, timeout=240, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = json.loads(summary.read_text())
        assert got["run_id"] == "local-swarm"
        assert set(got["rounds"]) == {"0", "1"} and min(got["rounds"].values()) >= 1, got
        # each stage's state was checked against the digest its lone replica attested
        assert set(got["digests"]) == {"0", "1"}, got
        peer_ids = {
            str(s): NodeKey((swarm.workdir / f"{n}.key").read_bytes()).peer_id
            for n, s in names.items()
        }
        assert got["sources"] == peer_ids
        status = swarm.status()
        assert status.observers == 0 and status.peers == 2  # the exporter left
        at_export = status.committed_tokens
        _poll(
            lambda: swarm.status().committed_tokens > at_export,
            120,
            "training to go on after the export",
            swarm,
        )
        codes = swarm.stop(timeout_s=120)
    finally:
        swarm.kill_all()
    assert codes == {"s0": 0, "s1": 0, "coordinator": 0}, {
        n: p.tail(30) for n, p in swarm.nodes.items()
    }
    served = [p.log.read_text() for p in swarm.nodes.values()]
    assert all("state: serving stage" in log for log in served)

    config, tensors = load_export(out)
    data = load_dataset()
    kw = {"batch_size": 8, "seq_len": 128, "n_batches": 4}
    trained = evaluate_weights(config, tensors, data, **kw)
    untrained = evaluate_weights(config, build_stage(config, 0, 1).state_dict(), data, **kw)
    assert trained < untrained - 0.3, (trained, untrained)


# --- the download client against real libp2p state servers (in process) --------------------


class _Link:
    """An outer loop's live theta_g and round."""

    def __init__(self, values: torch.Tensor, round_: int) -> None:
        self.values, self.round = values, round_


RUN = c.RunInfo(
    run_id="r1", model_preset="tiny", n_stages=2, codec="subspace_int8", seed=0,
    heartbeat_interval_s=1.0, lease_ttl_s=10.0, dataset_name="d", dataset_hash="0" * 64,
    shards=1, data_epoch=0,
)  # fmt: skip


def _state_replica(
    worker: TorchWorker, members: Callable[[str], bool]
) -> tuple[StateServer, Libp2pTransport]:
    """A stage-1 replica's state server on its own py-libp2p transport, answering the
    peers `members` admits."""
    t = Libp2pTransport(NodeKey.generate(), P2PConfig())
    srv = StateServer(
        worker, run_id="r1", stage=lambda: 1, params=list, outer=True, max_frame=4096 + 16
    )
    t.set_handler(STATE_PROTOCOL, srv.handle)
    t.set_membership(members)
    return srv, t


def test_download_picks_the_newest_round_tolerates_dead_replicas_and_restarts() -> None:
    """Two replicas serve (rounds 3 and 5) over real py-libp2p streams, a third is dead:
    the client takes round 5 in 4-element chunks, starts again when the served round
    changes mid-download, and waits out a `not_member` refusal until it is admitted."""
    n = 18
    worker = TorchWorker()
    client_key = NodeKey.generate()
    admitted: set[str] = set()
    servers, transports = [], []
    for round_ in (3, 5):
        srv, t = _state_replica(worker, lambda peer: peer in admitted)
        servers.append((srv, _Link(torch.arange(n, dtype=torch.float32) * round_, round_)))
        transports.append(t)
    dead = NodeKey.generate().peer_id
    opts = LiveOptions(request_timeout_s=5.0, member_wait_s=20.0, chunk_elements=4)
    layout = StageLayout(names=["w"], shapes=[torch.Size([n])])
    seen: list[tuple[int, int]] = []

    def progress(stage: int, done: int, total: int, round_: int, peer_id: str) -> None:
        seen.append((done, round_))
        if len(seen) == 2:  # the newest replica applies a round mid-download
            srv, link = servers[1]
            link.values, link.round = torch.arange(n, dtype=torch.float32) * 6, 6
            srv.hold(GlobalState(theta_g=link.values.clone(), momentum=None, round=6))

    async def main() -> StageState:
        async with trio.open_nursery() as nursery:
            for srv, link in servers:
                srv.hold(GlobalState(theta_g=link.values.clone(), momentum=None, round=link.round))
            fetcher, replicas = await _fetching(nursery, transports, client_key, opts, progress)
            replicas.append(
                c.PeerInfo(peer_id=dead, stage=1, addrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{dead}"],
                           device="cpu", throughput=0.0)
            )  # fmt: skip

            async def admit_later() -> None:
                await trio.sleep(1.5)  # the nodes' next membership refresh
                admitted.add(client_key.peer_id)

            nursery.start_soon(admit_later)
            got = await fetcher.download(1, layout, replicas)
            nursery.cancel_scope.cancel()
        return got

    try:
        got = trio.run(main)
    finally:
        worker.close()
    assert got.round == 6 and got.peer_id == transports[1].peer_id
    assert got.flat.tolist() == [6.0 * i for i in range(n)]
    assert seen[0] == (1, 5) and seen[-1] == (n, 6), seen  # the probe asks one element


async def _fetching(
    nursery: trio.Nursery,
    transports: list[Libp2pTransport],
    key: NodeKey,
    opts: LiveOptions,
    progress: Any = lambda *_: None,
) -> tuple[_Fetcher, list[c.PeerInfo]]:
    """Start the replicas' transports and a client under `key`: the client's fetcher
    (reporting to `progress`) and the replicas as stage 1's membership view lists them."""
    for t in transports:
        await nursery.start(_run_transport, t)
    client = Libp2pTransport(key, P2PConfig(listen=[]))
    await nursery.start(_run_transport, client)
    replicas = [
        c.PeerInfo(peer_id=t.peer_id, stage=1, addrs=t.listen_addrs, device="cpu",
                   throughput=0.0)
        for t in transports
    ]  # fmt: skip
    return _Fetcher(client, RUN, opts, progress), replicas


def test_download_takes_the_attested_state_and_refuses_forged_ones() -> None:
    """Four replicas serve over real py-libp2p streams: the honest one the stage's
    attested state (round 5), two forgers round 5 with other weights or other momentum,
    one round 9. The client takes only the attested round, downloads theta_g and m, and
    keeps the replica whose state's digest is the attested one."""
    n = 12
    worker = TorchWorker()
    theta, m = torch.arange(n, dtype=torch.float32), torch.full((n,), 0.5)
    served = [
        GlobalState(theta_g=theta.clone(), momentum=m.clone(), round=5),
        GlobalState(theta_g=theta * 2, momentum=m.clone(), round=5),
        GlobalState(theta_g=theta.clone(), momentum=m * 3, round=5),
        GlobalState(theta_g=theta * 9, momentum=m.clone(), round=9),
    ]
    want = c.StateRef(round=5, digest=state_digest(5, theta.numpy().data, m.numpy().data))
    client_key = NodeKey.generate()
    servers, transports = [], []
    for state in served:
        srv, t = _state_replica(worker, lambda peer: peer == client_key.peer_id)
        srv.hold(state)
        servers.append(srv)
        transports.append(t)
    opts = LiveOptions(request_timeout_s=5.0, member_wait_s=5.0, chunk_elements=4)
    layout = StageLayout(names=["w"], shapes=[torch.Size([n])])

    async def main() -> StageState:
        async with trio.open_nursery() as nursery:
            fetcher, replicas = await _fetching(nursery, transports, client_key, opts)
            got = await fetcher.download(1, layout, replicas, want)
            with pytest.raises(LiveExportError, match="attested round 7"):
                await fetcher.download(1, layout, replicas, c.StateRef(round=7, digest="ab"))
            nursery.cancel_scope.cancel()
        return got

    try:
        got = trio.run(main)
    finally:
        worker.close()
    assert got.round == 5 and got.peer_id == transports[0].peer_id
    assert torch.equal(got.flat, theta)
    assert servers[3].served_chunks == 2  # the round-9 forger: probed twice, never downloaded


def test_the_export_waits_while_replicas_are_ahead_of_the_attested_state() -> None:
    """Two replicas hold round 6 while the coordinator still attests round 5 (they stepped
    before both reported it): the export asks again until round 6 is attested, then takes
    it; with the attestation stuck it gives up after `attest_wait_s`, naming the flag."""
    n = 8
    worker = TorchWorker()
    theta, m = torch.arange(n, dtype=torch.float32), torch.full((n,), 0.25)
    new = GlobalState(theta_g=theta.clone(), momentum=m.clone(), round=6)
    old_ref = c.StateRef(round=5, digest="ab" * 32)
    new_ref = c.StateRef(round=6, digest=state_digest(6, theta.numpy().data, m.numpy().data))
    client_key = NodeKey.generate()
    transports = []
    for _ in range(2):
        srv, t = _state_replica(worker, lambda peer: peer == client_key.peer_id)
        srv.hold(new)
        transports.append(t)
    layout = StageLayout(names=["w"], shapes=[torch.Size([n])])
    asked: list[int] = []

    async def attested() -> c.StateRef:
        asked.append(len(asked))
        return new_ref if len(asked) >= 3 else old_ref

    async def stuck() -> c.StateRef:
        return old_ref

    async def main() -> tuple[StageState, str, float]:
        async with trio.open_nursery() as nursery:
            opts = LiveOptions(request_timeout_s=5.0, member_wait_s=5.0, attest_wait_s=30.0)
            fetcher, listed = await _fetching(nursery, transports, client_key, opts)

            async def replicas() -> list[c.PeerInfo]:
                return listed

            got = await fetch_attested(fetcher, 1, layout, attested, replicas)
            fetcher.opts = dataclasses.replace(opts, attest_wait_s=3.0)
            t0 = trio.current_time()
            with pytest.raises(LiveExportError) as failed:
                await fetch_attested(fetcher, 1, layout, stuck, replicas)
            waited = trio.current_time() - t0
            nursery.cancel_scope.cancel()
        return got, str(failed.value), waited

    try:
        got, error, waited = trio.run(main)
    finally:
        worker.close()
    assert got.round == 6 and torch.equal(got.flat, theta) and len(asked) == 3
    assert got.digest == new_ref.digest
    assert "attested round 5" in error and "[6]" in error, error
    assert "--attest-wait 3 s" in error and 1.5 <= waited < 6.0, (error, waited)


def test_a_stage_with_nothing_attested_is_refused_unless_unattested() -> None:
    """The coordinator attests nothing for the stage (no majority has reported yet): the
    export asks again for `attest_wait_s`, then refuses, naming `--unattested`; with
    `unattested` it takes the newest round served, and marks it unchecked (no digest)."""
    n = 8
    worker = TorchWorker()
    theta, m = torch.arange(n, dtype=torch.float32), torch.full((n,), 0.25)
    client_key = NodeKey.generate()
    transports = []
    for round_ in (3, 4):
        srv, t = _state_replica(worker, lambda peer: peer == client_key.peer_id)
        srv.hold(GlobalState(theta_g=theta + round_, momentum=m.clone(), round=round_))
        transports.append(t)
    layout = StageLayout(names=["w"], shapes=[torch.Size([n])])
    asked: list[float] = []

    async def nothing() -> None:
        asked.append(trio.current_time())

    async def main() -> tuple[str, float, StageState]:
        async with trio.open_nursery() as nursery:
            opts = LiveOptions(request_timeout_s=5.0, member_wait_s=5.0, attest_wait_s=3.0)
            fetcher, listed = await _fetching(nursery, transports, client_key, opts)

            async def replicas() -> list[c.PeerInfo]:
                return listed

            t0 = trio.current_time()
            with pytest.raises(LiveExportError) as refused:
                await fetch_attested(fetcher, 1, layout, nothing, replicas)
            waited = trio.current_time() - t0
            fetcher.opts = dataclasses.replace(opts, unattested=True)
            got = await fetch_attested(fetcher, 1, layout, nothing, replicas)
            nursery.cancel_scope.cancel()
        return str(refused.value), waited, got

    try:
        error, waited, got = trio.run(main)
    finally:
        worker.close()
    assert "stage 1 has no attested state" in error and "--attest-wait 3 s" in error, error
    assert "--unattested" in error and 1.5 <= waited < 6.0 and len(asked) >= 2, (error, waited)
    assert got.round == 4 and torch.equal(got.flat, theta + 4) and got.digest == ""


async def _run_transport(t: Libp2pTransport, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with t.run():
        task_status.started()
        await trio.sleep_forever()


def test_observer_survives_the_store_and_stays_off_the_stages() -> None:
    """The observer flag is persisted (in the addrs JSON: no schema change), and the
    per-stage aggregates, placement and rebalancing never see an observer."""
    obs = Peer(
        "obs", b"k", 2, [], [], "export", 0.0, None, None, None, True, 0.0, 100.0,
        observer=True,
    )  # fmt: skip
    back = Peer.from_row(obs.row())
    assert back.observer and back.stage == 2
    assert not Peer.from_row(dataclasses.replace(obs, observer=False).row()).observer
    members = [
        Peer(f"n{i}", b"k", 0, [], [], "cpu", 100.0, None, None, None, False, 0.0, 100.0)
        for i in range(3)
    ]
    view = Membership(
        n_stages=2, stage_costs=[1.0, 1.0], ttl_s=10.0, journal=Journal(), peers=[back, *members]
    )
    assert view.observers == 1 and view.stage_counts() == [3, 0]
    assert view.place() == 1
    moved = view.rebalance(0.9, lambda pid: False)
    assert moved is not None and moved.peer_id != "obs" and view.observers == 1
    view.remove("obs", LEFT)
    assert view.observers == 0 and sum(view.stage_counts()) == 3
