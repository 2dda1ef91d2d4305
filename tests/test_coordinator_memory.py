"""Memory-aware placement: a real coordinator places a node only on a stage whose
estimate (protocol.memory) fits the free memory it reported, refuses a join that no
stage (or not the asked-for stage) fits with `no_stage_fits` and the need in the
detail, serves the run's unequal `stage_layers`, and places a node that reported
nothing as before. Pure parts: the membership's placement and rebalancing honour the
stages a peer fits, which survive a restart (the peer's row), and the run config
checks the preset and the split at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from coordinator_harness import write_config

from coordinator.config import load_config
from coordinator.journal import Journal
from coordinator.membership import Membership, Peer
from coordinator.placement import MemoryFit
from node.coordinator_client import ClientConfig, CoordinatorClient, CoordinatorError
from protocol import control as c
from protocol.identity import NodeKey
from protocol.memory import settings_of, stage_needs
from protocol.model_config import preset
from swarmlab.coordinator import start_coordinator

FAST = ClientConfig(call_timeout_s=5.0, retry_deadline_s=20.0)
PRESET, SPLIT = "llama-125m", [4, 8]
MODEL = preset(PRESET).replace(stage_layers=tuple(SPLIT))


def _report(free: int, recompute: bool = False) -> c.DeviceMemory:
    return c.DeviceMemory(total_bytes=free, free_bytes=free, cuda=True, recompute=recompute)


def _needs(report: c.DeviceMemory) -> list[int]:
    return [n.total for n in stage_needs(MODEL, 2, settings_of(report))]


async def _refusal(client: CoordinatorClient, req: c.JoinRequest) -> CoordinatorError:
    try:
        await client.join(req)
    except CoordinatorError as exc:
        return exc
    raise AssertionError("the join succeeded but a refusal was expected")


def test_a_real_coordinator_places_by_memory_and_refuses_what_fits_nowhere(
    tmp_path: Path,
) -> None:
    cfg = write_config(tmp_path, model_preset=PRESET, codec="fp16", n_stages=2, stage_layers=SPLIT)
    coord = start_coordinator(tmp_path, config=cfg, db=tmp_path / "c.sqlite")
    probe = _report(1)
    needs = _needs(probe)
    small = min(range(2), key=lambda s: needs[s])
    big = 1 - small
    assert needs[small] < needs[big]
    only_small = needs[small] + (needs[big] - needs[small]) // 2  # bytes: one stage fits
    ka, kb, kc, kd, ke = (NodeKey.generate() for _ in range(5))

    async def main() -> None:
        port = coord.port
        async with (
            CoordinatorClient("127.0.0.1", port, ka, config=FAST) as a,
            CoordinatorClient("127.0.0.1", port, kb, config=FAST) as b,
            CoordinatorClient("127.0.0.1", port, kc, config=FAST) as cc,
            CoordinatorClient("127.0.0.1", port, kd, config=FAST) as d,
            CoordinatorClient("127.0.0.1", port, ke, config=FAST) as e,
        ):
            # a strong peer on the small stage: by rate alone the next goes to the other
            joined = await a.join(c.JoinRequest(throughput=1000.0, stage=small))
            assert joined.run.stage_layers == SPLIT  # the node builds this split
            placed = await b.join(c.JoinRequest(throughput=10.0, memory=_report(only_small)))
            assert placed.stage == small  # the only stage its memory holds
            # asking for the stage that does not fit: refused, with the need
            asked = await _refusal(cc, c.JoinRequest(stage=big, memory=_report(only_small)))
            assert asked.code == "no_stage_fits", asked
            assert f"stage {big}, asked for," in asked.detail and "weights" in asked.detail
            # fits nowhere: refused, naming the smallest stage's need and the memory
            tiny = 256 << 20
            refused = await _refusal(d, c.JoinRequest(memory=_report(tiny)))
            assert refused.code == "no_stage_fits", refused
            detail = refused.detail
            assert "the smallest stage needs" in detail and "256.0 MiB free" in detail
            for part in ("weights", "gradients", "optimizer", "activations", "margin"):
                assert part in detail, detail
            # nothing reported (a CPU without --memory-limit): the rate rule, as before
            free_for_all = await e.join(c.JoinRequest(throughput=1.0, memory=_report(0)))
            assert free_for_all.stage == big
            status = await a.status()
            counts = [s.peers for s in status.stages]
            assert counts[small] == 2 and counts[big] == 1, counts

    trio.run(main)
    assert coord.stop() == 0


# --- pure: membership, persistence, config ------------------------------------------


def _peer(i: int, stage: int, thr: float, fits: tuple[int, ...] | None = None) -> Peer:
    return Peer(
        f"p{i}", b"k", stage, [], [], "cuda", thr, None, None, None, False, 0.0, 100.0,
        memory=_report(1 << 30) if fits is not None else None, fits=fits,
    )  # fmt: skip


def test_placement_and_rebalancing_keep_peers_on_stages_they_fit() -> None:
    m = Membership(n_stages=3, stage_costs=[1.0, 1.0, 1.0], ttl_s=10.0, journal=Journal())
    for i, thr in enumerate((100.0, 100.0, 100.0)):
        m.join(_peer(i, 0, thr, fits=(0,)))  # three on stage 0, none fits stage 1
    assert m.place() == 1 and m.place([0, 2]) == 2 and m.place([0]) == 0
    assert m.rebalance(0.5, lambda _pid: False) is None  # nobody may go to stage 1
    m.join(_peer(9, 0, 100.0, fits=(0, 1)))
    moved = m.rebalance(0.5, lambda _pid: False)
    assert moved is not None and moved.peer_id == "p9" and moved.stage == 1


def test_what_a_peer_reported_survives_a_restart() -> None:
    peer = _peer(1, 1, 5.0, fits=(1, 2))
    again = Peer.from_row(peer.row())
    assert again.fits == (1, 2) and again.memory == peer.memory
    plain = Peer.from_row(_peer(2, 0, 5.0).row())
    assert plain.fits is None and plain.memory is None


def test_memory_fit_is_any_stage_for_a_node_that_reports_nothing() -> None:
    fit = MemoryFit(MODEL, 2)
    assert fit.stages(None) is None and fit.stages(_report(0)) is None
    assert fit.stages(_report(1 << 40)) == (0, 1)
    assert fit.stages(_report(1 << 20)) == ()
    assert fit.refusal(_report(1 << 40), (0, 1), None) is None
    why = fit.refusal(_report(1 << 20), (), None)
    assert why is not None and "the smallest stage needs" in why
    # recompute keeps fewer activations: a stage that did not fit may fit now
    plain, rec = _needs(_report(1)), _needs(_report(1, recompute=True))
    assert all(r <= p for r, p in zip(rec, plain, strict=True))
    with pytest.raises(ValueError, match="3 stages, not 2"):
        MemoryFit(preset(PRESET).replace(stage_layers=(4, 4, 4)), 2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"model_preset": "llama-7b"}, "unknown model preset 'llama-7b'"),
        ({"model_preset": "tiny", "n_stages": 5}, "at most the 4 layers of preset 'tiny'"),
        ({"model_preset": "tiny", "n_stages": 1}, "one stage is `agora baseline`"),
        ({"model_preset": "tiny", "stage_layers": [1, 2]}, r"stage_layers=\[1, 2\] must give"),
        ({"model_preset": "tiny", "stage_layers": [1, "3"]}, "a list of layer counts"),
        ({"model_preset": "llama-125m"}, "'subspace_int4' needs a preset with a residual subspace"),
        ({"model_preset": "tiny", "codec": "zstd"}, "codec must be one of"),
    ],
)
def test_the_run_config_checks_the_preset_and_the_split(
    tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(write_config(tmp_path, **extra), {})
    ok = load_config(write_config(tmp_path, model_preset="tiny", stage_layers=[1, 3]), {})
    assert ok.stage_layers == [1, 3]
    assert load_config(write_config(tmp_path, model_preset="llama-125m", codec="fp16"), {})
