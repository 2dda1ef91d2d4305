"""The simulator's core: processor sharing, the FIFO torch worker, links."""

from __future__ import annotations

import math

import pytest

from swarmlab.plan.engine import (
    BACKWARD,
    RETRIED,
    URGENT,
    Engine,
    Host,
    Link,
    Worker,
    transfer,
)


def test_processor_sharing_splits_cores() -> None:
    eng = Engine()
    one, two = Host(eng, 1.0), Host(eng, 2.0)
    done: dict[str, float] = {}
    for name, host in (("a1", one), ("b1", one), ("a2", two), ("b2", two), ("c2", two)):
        host.submit(1.0, lambda n=name: done.__setitem__(n, eng.now))
    eng.run(10.0)
    assert done["a1"] == pytest.approx(2.0) and done["b1"] == pytest.approx(2.0)
    # three tasks on two cores: each at 2/3 of a core
    assert all(done[k] == pytest.approx(1.5) for k in ("a2", "b2", "c2"))
    assert one.busy_s == pytest.approx(2.0) and two.busy_s == pytest.approx(3.0)


def test_oversubscription_costs_contention_per_thread_beyond_the_cores() -> None:
    """Four tasks on two cores with contention 0.3: twice the threads the cores hold, so
    each progresses at 2/4 / (1 + 0.3) of a core; two tasks (no oversubscription) pay
    nothing extra."""
    eng = Engine()
    crowded, calm = Host(eng, 2.0, contention=0.3), Host(eng, 2.0, contention=0.3)
    done: dict[str, float] = {}
    for i in range(4):
        crowded.submit(1.0, lambda i=i: done.__setitem__(f"crowded{i}", eng.now))
    for i in range(2):
        calm.submit(1.0, lambda i=i: done.__setitem__(f"calm{i}", eng.now))
    eng.run(10.0)
    assert all(done[f"crowded{i}"] == pytest.approx(2.0 * 1.3) for i in range(4))
    assert all(done[f"calm{i}"] == pytest.approx(1.0) for i in range(2))
    # the work each served, weighted by the oversubscription it ran under: 4 on 2 cores is 1
    assert crowded.over_s == pytest.approx(crowded.busy_s) and crowded.busy_s > 0
    assert calm.over_s == 0.0 and calm.busy_s == pytest.approx(2.0)


def test_a_task_submitted_later_shares_from_then_on() -> None:
    eng = Engine()
    host = Host(eng, 1.0)
    done: dict[str, float] = {}
    host.submit(1.0, lambda: done.__setitem__("first", eng.now))
    eng.at(0.5, lambda: host.submit(0.25, lambda: done.__setitem__("second", eng.now)))
    eng.run(5.0)
    assert done["second"] == pytest.approx(1.0)  # 0.25 at half speed from 0.5
    assert done["first"] == pytest.approx(1.25)


def test_worker_runs_one_job_at_a_time_in_the_gates_order() -> None:
    eng = Engine()
    w = Worker(Host(eng, 4.0))
    order: list[str] = []
    w.submit(1.0, lambda: order.append("fresh1"))  # runs at once: the worker is idle
    w.submit(1.0, lambda: order.append("fresh2"))
    w.submit(1.0, lambda: order.append("backward"), BACKWARD)
    w.submit(1.0, lambda: order.append("retry"), RETRIED)
    w.submit(1.0, lambda: order.append("step"), URGENT)
    eng.run(4.5)  # one job at a time, even on four cores
    assert order == ["fresh1", "step", "retry", "backward"]
    w.stop()
    eng.run(10.0)
    assert order == ["fresh1", "step", "retry", "backward"]  # stopped: nothing more


def test_a_stopped_worker_frees_its_share_of_the_cores_at_once() -> None:
    """A SIGKILLed node's running job stops using the host: the other task, sharing one
    core with it, runs at full speed from the kill on and its job's callback never runs."""
    eng = Engine()
    host = Host(eng, 1.0)
    killed = Worker(host)
    done: dict[str, float] = {}
    killed.submit(1.0, lambda: done.__setitem__("killed", eng.now))
    host.submit(1.0, lambda: done.__setitem__("other", eng.now))
    eng.at(0.5, killed.stop)
    eng.run(5.0)
    assert "killed" not in done
    assert done["other"] == pytest.approx(1.25)  # 0.25 done at half speed, 0.75 alone
    assert host.busy_s == pytest.approx(1.25)


def test_transfer_serialises_the_uplink_and_adds_latency() -> None:
    eng = Engine()
    a = Link(up_bps=8e6, down_bps=8e6, rtt_s=0.1)
    b = Link(up_bps=8e6, down_bps=8e6, rtt_s=0.1)
    at: list[float] = []
    transfer(eng, a, b, 1_000_000, lambda: at.append(eng.now))  # 1 s on the wire
    transfer(eng, a, b, 1_000_000, lambda: at.append(eng.now))
    eng.run(10.0)
    assert at == [pytest.approx(1.05), pytest.approx(2.05)]
    assert a.sent == b.received == 2_000_000


def test_loss_caps_the_rate_as_tcp_does() -> None:
    eng = Engine()
    a = Link(up_bps=1e9, down_bps=1e9, rtt_s=0.1, loss=0.01)
    b = Link(up_bps=1e9, down_bps=1e9, rtt_s=0.1)
    at: list[float] = []
    transfer(eng, a, b, 1_000_000, lambda: at.append(eng.now))
    eng.run(100.0)
    mathis = 1460 * 8 / (0.1 * math.sqrt(2 * 0.01 / 3))  # bit/s
    assert at[0] == pytest.approx(8e6 / mathis + 0.05)
