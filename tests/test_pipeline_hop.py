"""The pipeline hop over the in-process transport, with faults placed by (peer, step).

Real stages of the tiny preset (real forward, backward and boundary codecs) on one
torch worker per peer; the transport encodes and decodes every message as the libp2p
one does. Routing is made deterministic (no jitter), so the first choice of each hop is
the first replica in the membership view, and a fault at that peer's step 0 cuts
exactly the first attempt."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
import trio.testing
from prometheus_client import REGISTRY

from node import pipeline_hop
from node.events import EventLog, read_events
from node.model import preset
from node.p2p.inproc import FaultPlan, InProcessNetwork
from node.p2p.transport import RequestRefused, TransportError
from node.peer_view import PeerView
from node.pipeline_hop import PipelineHop
from node.routing import Router
from node.stage_compute import InnerConfig, StageCompute
from node.worker import TorchWorker
from protocol.control import PeerInfo
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.pipeline import FORWARD_PROTOCOL, Backward, Forward
from protocol.tensors import EncodedTensor, TensorFrame

SEQ = 32
MICRO_BATCH = 4  # sequences per micro-batch in these swarms
SERVED, ROUND_TRIP = "agora_node_serve_seconds", "agora_node_microbatch_seconds"
INNER = InnerConfig(lr=1e-3, warmup_steps=1, weight_decay=0.0, inner_batch_tokens=10**9,
                    cache_size=8)  # fmt: skip


class Swarm:
    """Peers on one in-process network: `layout` is (name, stage) per peer, in the
    membership view's order; stage 0 writes its events to `events`, the serving stages
    to `events` with the suffix `.served.jsonl`."""

    def __init__(
        self, layout: list[tuple[str, int]], faults: FaultPlan, events: Path, affinity: float = 0.0
    ) -> None:
        self.ids = {name: NodeKey.generate().peer_id for name, _ in layout}
        self.network = InProcessNetwork(faults)
        n_stages = max(stage for _, stage in layout) + 1
        members = {
            self.ids[name]: PeerInfo(peer_id=self.ids[name], stage=stage, addrs=[], device="cpu",
                                     throughput=0.0)
            for name, stage in layout
        }  # fmt: skip
        self.hops: dict[str, PipelineHop] = {}
        self.workers: list[TorchWorker] = []
        cfg = preset("tiny")
        for name, stage in layout:
            transport = self.network.transport(self.ids[name])
            router = Router(jitter=0.0, explore=0.0, affinity=affinity)
            view = PeerView(transport, router, stage=stage)
            view.update(1, members)
            worker = TorchWorker()
            self.workers.append(worker)
            hop = PipelineHop(
                transport, view, worker, request_timeout_s=5.0, max_rows=MICRO_BATCH,
                events=EventLog(events if stage == 0 else events.with_suffix(".served.jsonl")),
            )  # fmt: skip
            hop.stage_built(StageCompute(cfg, stage, n_stages, "subspace_int4", INNER))
            transport.set_handler(FORWARD_PROTOCOL, hop.serve_forward)
            transport.set_membership(view.is_member)
            self.hops[name] = hop

    def fault(self, name: str) -> str:
        return self.ids[name]

    def served(self, name: str) -> int:
        return self.network.peers[self.ids[name]].served


@contextmanager
def swarm(
    layout: list[tuple[str, int]], faults: FaultPlan, events: Path, affinity: float = 0.0
) -> Iterator[Swarm]:
    s = Swarm(layout, faults, events, affinity)
    try:
        yield s
    finally:
        for w in s.workers:
            w.close()


def rows(n: int = 2) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(n, SEQ + 1), dtype=np.uint8)


def test_a_dropped_route_is_retried_on_the_other_replica(tmp_path: Path) -> None:
    layout = [("s0", 0), ("a", 1), ("b", 1)]
    plan = FaultPlan()
    with swarm(layout, plan, tmp_path / "events.jsonl") as s:
        plan.add(s.fault("a"), 0, "drop")
        hop = s.hops["s0"]
        loss = trio.run(hop.run_microbatch, "1.1.0", rows(), lambda failures: failures > 3)
        assert loss is not None and math.isfinite(loss)
        assert s.served("a") == 0 and s.served("b") == 1
        assert hop.router.peers[s.ids["a"]].banned_until > 0  # avoided for a while
        assert hop.tokens_trained == 2 * SEQ
        [failed] = read_events(tmp_path / "events.jsonl", "forward_failed")
        assert failed["peer"] == s.ids["a"] and failed["mb_id"] == "1.1.0"


def test_a_dead_replica_gets_no_micro_batch_after_its_first_transport_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dropped stream marks the replica down: the micro-batch is retried through the
    other one at once (a back-off of a minute would not fit the deadline), and no later
    micro-batch goes to the dead one although its ban lapsed at once, until a
    membership view shows it alive again."""
    monkeypatch.setattr(pipeline_hop, "RETRY_WAIT_S", 60.0)
    layout = [("s0", 0), ("a", 1), ("b", 1)]
    plan = FaultPlan()
    with swarm(layout, plan, tmp_path / "events.jsonl") as s:
        plan.add(s.fault("a"), 0, "drop")
        hop = s.hops["s0"]
        hop.router.ban_base_s = 1e-6  # only being down keeps it out
        a = s.ids["a"]

        async def main() -> list[str]:
            with trio.fail_after(50):  # 60 s of back-off would not fit
                for i in range(4):
                    assert await hop.run_microbatch(f"1.1.{i}", rows(), lambda f: f > 3)
            assert hop.router.is_down(a) and s.network.sent[a] == 1
            # a view asked for after the failure still lists it: alive after all
            return hop.router.listed(hop.peers.members, trio.current_time())

        assert trio.run(main) == [a]
        assert not hop.router.is_down(a)
        assert s.served("a") == 0 and s.served("b") == 4
        [failed] = read_events(tmp_path / "events.jsonl", "forward_failed")
        assert failed["peer"] == a and failed["kind"] == "unreachable"
        [rerouted] = read_events(tmp_path / "events.jsonl", "forward_rerouted")
        assert rerouted["mb_id"] == "1.1.0" and rerouted["peer"] == s.ids["b"]
        assert rerouted["failures"] == 1
        # the retried forward, timed where it was served and where it was sent
        [served] = read_events(tmp_path / "events.served.jsonl", "retry_served")
        assert served["mb_id"] == "1.1.0"
        assert 0 <= served["queued_s"] <= served["held_s"] <= rerouted["attempt_s"]
        assert 0 < served["job_cpu_s"] and served["job_s"] <= served["held_s"]
        assert rerouted["attempt_s"] <= rerouted["seconds"]


def test_the_worker_gate_orders_jobs_and_survives_a_cancelled_waiter() -> None:
    gate = pipeline_hop.WorkerGate()
    order: list[str] = []

    async def job(name: str, priority: int, scope: trio.CancelScope | None = None) -> None:
        with scope or trio.CancelScope():
            async with gate.turn(priority):
                order.append(name)
                await trio.sleep(0)

    async def main() -> None:
        gone = trio.CancelScope()
        jobs = [("fresh1", pipeline_hop.FRESH, None), ("gone", pipeline_hop.RETRIED, gone),
                ("backward", pipeline_hop.BACKWARD, None), ("fresh2", pipeline_hop.FRESH, None),
                ("retry", pipeline_hop.RETRIED, None)]  # fmt: skip
        async with trio.open_nursery() as nursery:
            async with gate.turn(pipeline_hop.FRESH):  # busy: the jobs below wait, in order
                for name, priority, scope in jobs:
                    nursery.start_soon(job, name, priority, scope)
                    await trio.testing.wait_all_tasks_blocked()
                gone.cancel()  # a waiter that gives up leaves no turn stuck behind it
                await trio.testing.wait_all_tasks_blocked()
        assert order == ["retry", "backward", "fresh1", "fresh2"]
        with trio.fail_after(5):
            async with gate.turn(pipeline_hop.FRESH):
                pass

    trio.run(main)


@pytest.mark.parametrize("fault", ["timeout", "refuse", "garbage"])
def test_each_fault_costs_one_attempt(tmp_path: Path, fault: str) -> None:
    layout = [("s0", 0), ("a", 1), ("b", 1)]
    plan = FaultPlan()
    with swarm(layout, plan, tmp_path / "events.jsonl") as s:
        plan.add(s.fault("a"), 0, fault)  # type: ignore[arg-type]
        hop = s.hops["s0"]
        hop.request_timeout_s = 1.0
        loss = trio.run(hop.run_microbatch, "1.1.0", rows(), lambda failures: failures > 3)
        assert loss is not None
        [failed] = read_events(tmp_path / "events.jsonl", "forward_failed")
        assert failed["kind"] == {"timeout": "timeout", "refuse": "refused"}.get(fault, "bad_reply")
        assert not hop.router.is_down(s.ids["a"])  # a lapsing ban only
        # a garbage reply was computed by `a` and thrown away; the others never reached it
        assert s.served("a") == (1 if fault == "garbage" else 0)
        assert s.served("b") == 1


def test_give_up_ends_a_micro_batch_that_cannot_get_through(tmp_path: Path) -> None:
    layout = [("s0", 0), ("a", 1)]
    plan = FaultPlan()
    with swarm(layout, plan, tmp_path / "events.jsonl") as s:
        for step in range(3):
            plan.add(s.fault("a"), step, "drop")
        hop = s.hops["s0"]
        hop.router.ban_base_s = 0.01  # retry at once instead of waiting out the ban
        seen: list[int] = []

        def give_up(failures: int) -> bool:
            seen.append(failures)
            return failures >= 2

        assert trio.run(hop.run_microbatch, "1.1.0", rows(), give_up) is None
        assert seen == [0, 1, 2] and hop.tokens_trained == 0
        assert hop.compute is not None and not hop.compute._cache  # its activations dropped


def test_a_middle_stage_reroutes_around_a_failed_last_stage_replica(tmp_path: Path) -> None:
    layout = [("s0", 0), ("m", 1), ("a", 2), ("b", 2)]
    plan = FaultPlan()
    with swarm(layout, plan, tmp_path / "events.jsonl") as s:
        plan.add(s.fault("a"), 0, "drop")
        loss = trio.run(s.hops["s0"].run_microbatch, "2.1.0", rows(), lambda f: f > 0)
        assert loss is not None and math.isfinite(loss)  # the first attempt got through
        assert s.served("m") == 1 and s.served("a") == 0 and s.served("b") == 1
        assert s.hops["m"].router.peers[s.ids["a"]].banned_until > 0


def _seconds(name: str) -> tuple[float, float]:
    """(count, sum) of a node histogram in this process."""
    count, total = (REGISTRY.get_sample_value(f"{name}_{x}") or 0.0 for x in ("count", "sum"))
    return count, total


def test_each_serving_stage_times_what_it_held_within_its_callers_round_trip(
    tmp_path: Path,
) -> None:
    layout = [("s0", 0), ("m", 1), ("last", 2)]
    with swarm(layout, FaultPlan(), tmp_path / "events.jsonl") as s:
        served0, rtt0 = _seconds(SERVED), _seconds(ROUND_TRIP)
        loss = trio.run(s.hops["s0"].run_microbatch, "3.1.0", rows(), lambda f: f > 0)
        assert loss is not None
        served1, rtt1 = _seconds(SERVED), _seconds(ROUND_TRIP)
    # stages 1 and 2 each held the micro-batch once, stages 0 and 1 each waited for it;
    # each caller's round trip holds its callee's serving time
    assert served1[0] - served0[0] == 2 and rtt1[0] - rtt0[0] == 2
    assert 0 < served1[1] - served0[1] <= rtt1[1] - rtt0[1]


def test_serving_refuses_non_members_and_bans_bad_shapes(tmp_path: Path) -> None:
    layout = [("s0", 0), ("a", 1)]
    with swarm(layout, FaultPlan(), tmp_path / "events.jsonl") as s:
        stranger = s.network.transport(NodeKey.generate().peer_id)
        member = s.network.peers[s.ids["s0"]]
        a = s.ids["a"]
        hidden = s.hops["s0"]
        assert hidden.compute is not None
        good_rows = rows()
        encoded = hidden.compute.forward("x", good_rows, None)

        def forward(block: np.ndarray, hidden: EncodedTensor = encoded) -> Forward:
            return Forward(mb_id="x", tokens=TensorFrame.from_numpy(block), hidden=hidden,
                           route=[member.peer_id], deadline=1e12)  # fmt: skip

        too_many = rows(MICRO_BATCH + 1)  # more sequences than a micro-batch of the run
        too_many_hidden = hidden.compute.forward("y", too_many, None)

        async def main() -> None:
            with pytest.raises(RequestRefused, match="not_member"):
                await stranger.request(a, [], FORWARD_PROTOCOL, forward(good_rows), timeout=5)
            too_long = np.zeros((2, preset("tiny").max_seq_len + 2), dtype=np.uint8)
            with pytest.raises(TransportError, match="out of bounds"):
                await member.request(a, [], FORWARD_PROTOCOL, forward(too_long), timeout=5)
            block = forward(too_many, too_many_hidden)  # a well-formed forward, too big
            with pytest.raises(TransportError, match=r"shape \[5, 33\] is out of bounds"):
                await member.request(a, [], FORWARD_PROTOCOL, block, timeout=5)
            # token ids of another width than the run's (vocabulary 256: uint8)
            wide = forward(good_rows.astype(np.uint16))
            with pytest.raises(TransportError, match="dtype uint16, expected uint8"):
                await member.request(a, [], FORWARD_PROTOCOL, wide, timeout=5)

        trio.run(main)
        assert s.served("a") == 0


def test_a_replica_still_building_refuses_and_is_not_taken_for_dead(tmp_path: Path) -> None:
    """A forward whose deadline passes while the stage is built is refused as the
    receiver's own fault: the sender sees `Refused`, a lapsing ban, not a dead peer."""
    layout = [("s0", 0), ("a", 1)]
    with swarm(layout, FaultPlan(), tmp_path / "events.jsonl") as s:
        sender, a = s.hops["s0"], s.hops["a"]
        a.compute, a.built = None, trio.Event()  # a cold joiner, its stage not built yet
        assert sender.compute is not None
        encoded = sender.compute.forward("x", rows(), None)
        msg = Forward(mb_id="x", tokens=TensorFrame.from_numpy(rows()), hidden=encoded,
                      route=[s.ids["s0"]], deadline=time.time() + 0.2)  # fmt: skip

        async def main() -> None:
            with pytest.raises(RequestRefused, match="internal") as err:
                await sender.transport.request(s.ids["a"], [], FORWARD_PROTOCOL, msg, timeout=5)
            assert pipeline_hop.failure_kind(err.value) == "refused"

        trio.run(main)


def _poisoned(grad: EncodedTensor, scale: float) -> EncodedTensor:
    """The same codes with a forged global scale (the last part of a subspace encoding)."""
    forged = TensorFrame.from_numpy(np.array([scale], dtype=np.float32))
    return EncodedTensor(codec=grad.codec, shape=grad.shape, parts=[*grad.parts[:-1], forged])


@pytest.mark.parametrize("scale", [3e38, float("nan"), float("inf")])
def test_a_poisoned_gradient_counts_against_its_sender(tmp_path: Path, scale: float) -> None:
    """A last-stage replica answers with a gradient that decodes to NaN, Inf or absurd
    values: stage 0 refuses it before any weight sees it, avoids that replica, and trains
    through the honest one."""
    layout = [("s0", 0), ("rogue", 1), ("b", 1)]
    with swarm(layout, FaultPlan(), tmp_path / "events.jsonl") as s:
        honest = s.hops["rogue"].serve_forward

        async def rogue(peer_id: str, msg: Message) -> Message:
            reply = await honest(peer_id, msg)
            assert isinstance(reply, Backward)
            return dataclasses.replace(reply, grad=_poisoned(reply.grad, scale))

        s.network.peers[s.ids["rogue"]].set_handler(FORWARD_PROTOCOL, rogue)
        hop = s.hops["s0"]
        assert hop.compute is not None
        before = [p.detach().clone() for p in hop.compute.parameters()]
        loss = trio.run(hop.run_microbatch, "1.1.0", rows(), lambda failures: failures > 3)
        assert loss is not None and s.served("b") == 1
        assert hop.router.peers[s.ids["rogue"]].banned_until > 0
        [failed] = read_events(tmp_path / "events.jsonl", "forward_failed")
        assert failed["peer"] == s.ids["rogue"]
        hop.compute.step()  # the honest gradient alone reaches the weights
        after = hop.compute.parameters()
        assert all(bool(torch.isfinite(p).all()) for p in after)
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_forwards_only_from_the_previous_stage_and_cached_per_sender(tmp_path: Path) -> None:
    layout = [("s0", 0), ("t0", 0), ("m", 1), ("z", 2)]
    with swarm(layout, FaultPlan(), tmp_path / "events.jsonl") as s:
        m = s.ids["m"]
        s0, t0 = s.hops["s0"], s.hops["t0"]
        assert s0.compute is not None and t0.compute is not None
        block = rows()

        def forward(sender: PipelineHop) -> Forward:
            assert sender.compute is not None
            hidden = sender.compute.forward("same-id", block, None)
            assert isinstance(hidden, EncodedTensor)
            return Forward(mb_id="same-id", tokens=TensorFrame.from_numpy(block), hidden=hidden,
                           route=[sender.transport.peer_id], deadline=1e12)  # fmt: skip

        async def main() -> None:
            # two stage-0 members may use the same micro-batch id: each gets its own entry
            async with trio.open_nursery() as nursery:
                for sender in (s0, t0):
                    request = partial(sender.transport.request, timeout=5.0)
                    nursery.start_soon(request, m, [], FORWARD_PROTOCOL, forward(sender))
            # a stage-2 member is not a previous-stage peer of stage 1
            z = s.network.peers[s.ids["z"]]
            with pytest.raises(TransportError, match="stage 0 members only"):
                await z.request(m, [], FORWARD_PROTOCOL, forward(s0), timeout=5)

        trio.run(main)
        # every stage counts the tokens it finished backward for, a middle one too
        assert s.served("m") == 2 and s.hops["m"].tokens_trained == 2 * len(rows()) * SEQ
        m_compute = s.hops["m"].compute
        assert m_compute is not None and m_compute.recomputes == 0


@pytest.mark.parametrize("affinity", [0.0, 4.0])
def test_with_affinity_each_sender_keeps_to_its_paired_replica(
    tmp_path: Path, affinity: float
) -> None:
    """Each stage-0 replica sends its micro-batches to its partner (`PeerView.partners`)
    with affinity on, so each pair of replicas trains as one model; without it, every
    micro-batch goes to the fastest-looking replica, whoever sent it."""
    layout = [("x", 0), ("y", 0), ("a", 1), ("b", 1)]
    with swarm(layout, FaultPlan(), tmp_path / "events.jsonl", affinity) as s:
        served: dict[str, dict[str, int]] = {}
        for sender in ("x", "y"):
            before = {r: s.served(r) for r in ("a", "b")}
            for i in range(4):
                mb = f"{sender}.1.{i}"
                loss = trio.run(s.hops[sender].run_microbatch, mb, rows(), lambda f: f > 3)
                assert loss is not None
            served[sender] = {r: s.served(r) - before[r] for r in ("a", "b")}
        name = {s.ids[r]: r for r in ("a", "b")}
        partners = {x: name[p] for x in ("x", "y") for p in s.hops[x].peers.partners()}
        assert sorted(partners.values()) == ["a", "b"]  # one to one
        paired = {x: {r: 4 * (r == partners[x]) for r in "ab"} for x in "xy"}
        if affinity:
            assert served == paired
        else:  # the first replica in the view answered first, and both senders keep to it
            assert served == {x: {"a": 4, "b": 0} for x in "xy"} != paired
