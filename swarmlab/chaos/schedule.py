"""The fault schedule of `agora chaos`: its configuration, the fault kinds and `plan`, a
pure function of the seed (the same seed gives the same schedule)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

KINDS = ("kill_node", "zombie", "kill_coordinator", "cut_stream", "rogue", "join_mid_round")
LEASE_TTL_S = 10.0  # the chaos swarm's lease TTL (its run.toml), seconds
# the attacks of `agora chaos --byzantine` (swarmlab.chaos.byzantine)
FORGED_ROUND = 2**62  # the round the forging attackers (state_takeover, forged_export) claim
BYZANTINE = ("state_takeover", "inflated_claims", "scaled_delta", "sign_flip", "noise",
             "nan_inf", "bootstrap_grab", "forged_export", "dht_forgery")  # fmt: skip
MIN_SLOT_S = 60.0  # the shortest Byzantine slot: an attacker starts, trains and averages


@dataclasses.dataclass(kw_only=True, slots=True)
class ChaosConfig:
    minutes: float  # length of the fault window (training time measured), minutes
    seed: int = 0  # schedule seed
    preset: str = "tiny"  # model preset
    outer_every_steps: int = 10  # inner steps between DiLoCo rounds (0 = no outer loop)
    fault_every_s: float = 45.0  # mean seconds between faults
    zombie_extra_s: float = 5.0  # seconds a zombie stays stopped past the lease TTL
    coordinator_down_s: float = 3.0  # seconds the coordinator stays dead
    start_timeout_s: float = 300.0  # seconds for the first four nodes to train
    stop_timeout_s: float = 120.0  # seconds for the final drain
    baseline: str = "sequential"  # fault-free comparison: sequential | concurrent | none
    hostile: bool = False  # play hostile attacks (swarmlab.chaos.hostile) instead of faults
    # play Byzantine replicas (swarmlab.chaos.byzantine) instead of faults
    byzantine: bool = False
    attacks: tuple[str, ...] = ()  # the Byzantine attacks to play (names; empty = all)
    workdir: Path = Path("chaos-out")  # logs, DBs and per-run files

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        if self.fault_every_s <= 0:
            raise ValueError(f"fault_every_s must be positive, got {self.fault_every_s}")
        if self.baseline not in ("sequential", "concurrent", "none"):
            raise ValueError(
                f"baseline must be sequential, concurrent or none, not {self.baseline}"
            )
        if self.outer_every_steps < 0:
            raise ValueError("outer_every_steps must be >= 0")
        if self.hostile and self.byzantine:
            raise ValueError("hostile and byzantine are two different runs: choose one")
        if self.attacks and not self.byzantine:
            raise ValueError("attacks name Byzantine attacks: they need byzantine")
        if self.byzantine:
            unknown = sorted(set(self.attacks) - set(BYZANTINE))
            if unknown:
                raise ValueError(f"unknown Byzantine attacks {unknown}; known: {list(BYZANTINE)}")
            if self.outer_every_steps == 0:
                raise ValueError("byzantine attacks the outer loop: outer_every_steps must be > 0")
            slot = self.minutes * 60 / len(self.attacks or BYZANTINE)
            if slot < MIN_SLOT_S:
                raise ValueError(
                    f"byzantine: {slot:.0f} s per attack is too short for an attacker to start,"
                    f" train and average (at least {MIN_SLOT_S:.0f} s: raise minutes)"
                )

    @property
    def measures_model(self) -> bool:
        """Whether the run exports its model and evaluates its held-out loss: crash runs
        with outer rounds (nodes checkpoint theta_g after each applied round)."""
        return not self.hostile and self.outer_every_steps > 0


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds into the fault window
    kind: str  # one of KINDS
    pick: float  # uniform [0, 1): which eligible victim / stage
    hold_s: float  # seconds of SIGSTOP (zombie) or of coordinator downtime


def plan(
    seed: int, window_s: float, cfg: ChaosConfig, kinds_played: tuple[str, ...] = KINDS
) -> list[Fault]:
    """The fault schedule of a seed: pure, so the same seed gives the same schedule.
    Every one of `kinds_played` comes once per shuffled cycle."""
    rng = random.Random(seed)
    n = max(len(kinds_played), round(window_s * 0.85 / cfg.fault_every_s))
    kinds: list[str] = []
    while len(kinds) < n:
        cycle = list(kinds_played)
        rng.shuffle(cycle)
        kinds += cycle
    kinds = kinds[:n]
    span = window_s * 0.85
    step = span / n
    faults = []
    for i, kind in enumerate(kinds):
        at = step * i + rng.uniform(0.1, 0.9) * step
        hold = (
            LEASE_TTL_S + cfg.zombie_extra_s + rng.uniform(0, 3)
            if kind == "zombie"
            else cfg.coordinator_down_s * rng.uniform(0.5, 1.5)
        )
        faults.append(Fault(round(at, 2), kind, rng.random(), round(hold, 2)))
    return faults
