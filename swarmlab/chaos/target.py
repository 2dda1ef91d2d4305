"""The swarm that `agora chaos` attacks: the local swarm, its bookkeeping (what was
killed, stopped, injected or skipped, as events), and how a victim is chosen. The fault
injectors (`swarmlab.chaos.faults`) act on a `Target`; `swarmlab.chaos.run.Run` is one."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from swarmlab.chaos.schedule import KINDS, LEASE_TTL_S, ChaosConfig
from swarmlab.procs import Proc
from swarmlab.swarm import LocalSwarm

log = logging.getLogger("agora.chaos")


class Target:
    """The swarm under attack, and what the injectors record on it."""

    def __init__(self, cfg: ChaosConfig, name: str) -> None:
        self.cfg = cfg
        self.name = name
        self.workdir = cfg.workdir / name
        self.swarm = LocalSwarm(
            workdir=self.workdir,
            preset=cfg.preset,
            stages=2,
            run_config={"lease_ttl_s": LEASE_TTL_S},  # zombies are held past it
            node_args=["--outer-every-steps", str(cfg.outer_every_steps)],
            # the model is measured from its checkpoints (swarmlab.chaos.heldout); only
            # outer rounds write them
            checkpoints=cfg.measures_model,
        )
        self.lock = threading.RLock()
        self.coordinator_busy = threading.Lock()  # held during a coordinator kill+restart
        self.killed: set[str] = set()  # processes we SIGKILLed (not crashes)
        self.stopped: set[str] = set()  # nodes currently SIGSTOPped
        self.coordinator_generation = 0
        self.counts: dict[str, int] = {k: 0 for k in KINDS}
        self.skipped: dict[str, int] = {k: 0 for k in KINDS}
        self.events: list[dict[str, Any]] = []
        self.rogue_procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.t0 = 0.0
        self.serial = 0

    # --- helpers ------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note(self, kind: str, **detail: Any) -> None:
        with self.lock:
            self.events.append({"t_s": round(self.now(), 1), "kind": kind, **detail})
        log.info("[%s] %6.1fs %s %s", self.name, self.now(), kind, detail)

    def new_node(self, stage: int, prefix: str) -> Proc:
        with self.lock:
            self.serial += 1
            name = f"{prefix}{self.serial}s{stage}"
            return self.swarm.add_node(name, stage)

    def trained(self, name: str) -> bool:
        scraped = self.swarm.scrape(name)
        return (
            scraped.get("agora_node_tokens_total", 0.0) > 0
            or scraped.get("agora_p2p_served_total", 0.0) > 0
        )

    def healthy(self) -> dict[str, int]:
        """Live, running (not stopped) nodes that have trained: name -> stage."""
        with self.lock:
            cands = [
                (n, p)
                for n, p in self.swarm.nodes.items()
                if p.alive() and n not in self.stopped and n not in self.killed
            ]
        return {n: int(p.stage or 0) for n, p in cands if self.trained(n)}

    def skip(self, kind: str, **why: Any) -> None:
        """A fault that found nothing to act on: counted and noted, not injected."""
        self.skipped[kind] += 1
        self.note("skip", fault=kind, **why)

    def victim(self, pick: float) -> str | None:
        healthy = self.healthy()
        per_stage: dict[int, int] = {}
        for s in healthy.values():
            per_stage[s] = per_stage.get(s, 0) + 1
        eligible = sorted(n for n, s in healthy.items() if per_stage[s] >= 2)
        if not eligible:
            return None
        return eligible[int(pick * len(eligible))]
