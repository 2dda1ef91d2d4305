"""Memory-aware placement: the stages a joining node's device can hold. Pure.

A node that reports its device memory (`protocol.control.DeviceMemory`, free bytes > 0)
may only be placed on a stage whose estimate (`protocol.memory.stage_need`, at the
node's own micro-batch settings) fits its free memory; among those the membership's
rule picks (the weakest stage). The stages it fits are kept with the peer, so a
rebalance never moves it onto one that does not. A node that reports nothing (free 0:
a CPU without `--memory-limit`, or an older node) may go anywhere, as before.
"""

from __future__ import annotations

from collections import OrderedDict

from protocol.control import DeviceMemory
from protocol.memory import (
    NodeSettings,
    StageNeed,
    fitting_stages,
    refusal,
    settings_of,
    stage_needs,
)
from protocol.model_config import ModelConfig


class MemoryFit:
    CACHE = 256  # settings whose per-stage needs are kept (nodes mostly share a few)

    def __init__(self, model: ModelConfig, n_stages: int) -> None:
        model.layers_of(0, n_stages)  # the run's split must be one into n_stages stages
        self.model = model  # the config every node of the run builds
        self.n_stages = n_stages
        self._needs: OrderedDict[NodeSettings, list[StageNeed]] = OrderedDict()

    def needs(self, report: DeviceMemory) -> list[StageNeed]:
        """Every stage's need at the node's settings (O(stages), cached by settings)."""
        settings = settings_of(report)
        needs = self._needs.pop(settings, None)
        if needs is None:
            needs = stage_needs(self.model, self.n_stages, settings)
            if len(self._needs) >= self.CACHE:
                self._needs.popitem(last=False)
        self._needs[settings] = needs
        return needs

    def stages(self, report: DeviceMemory | None) -> tuple[int, ...] | None:
        """The stages whose need fits the reported free memory (None: any stage, since
        the node reported none)."""
        if report is None or report.free_bytes == 0:
            return None
        return tuple(fitting_stages(self.needs(report), report.free_bytes))

    def refusal(self, report: DeviceMemory, fits: tuple[int, ...], asked: int | None) -> str | None:
        """Why the join is refused (`no_stage_fits`), or None when the node has a stage:
        nothing fits, or the stage it asked for does not."""
        if fits and (asked is None or asked in fits):
            return None
        return refusal(self.needs(report), report, asked)
