"""The node's `/agora/state/1` handler: chunks of its stage's global state for members.

The node registers `StateServer.handle` on its transport next to `/agora/fwd/1`, so the
same admission applies: only members of the run (observers included, e.g. `agora
export`) are served, under the same per-peer stream, rate and bytes limits
(node.p2p.limits). The server answers only for its own stage.

What is served:
- With an outer loop: `theta_g` as of the last applied round. The node calls
  `hold(state)` with the `GlobalState` the outer loop hands out when its state is loaded
  and after every applied round: a private copy, so it is one round's state, never half
  of one. Its outer momentum `m` is served too (`StateRequest.momentum`), so a client can
  check the state's digest against the stage's attested one.
- Without an outer loop (`outer_every_steps = 0`): the stage's current parameters at
  round 0, copied on the worker when a client asks for offset 0 and the held copy is
  older than `refresh_s` (a new copy gets a new `version`, which tells a client that is
  mid-download to start again).

Chunks are cut from the held copy (never from live tensors) and sized to fit the frame
limit.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from node.checkpoint import GlobalState, flat_copy
from node.worker import TorchWorker
from protocol.codec import DEFAULT_MAX_FRAME
from protocol.dataplane import Refused
from protocol.errors import ProtocolError
from protocol.message import Message
from protocol.state import MAX_CHUNK_ELEMENTS, StateChunk, StateRequest
from protocol.tensors import TensorFrame

log = logging.getLogger(__name__)

FRAME_OVERHEAD = 4096  # bytes of a chunk's frame that are not payload (generous)
REFRESH_S = 30.0  # seconds a copy of live parameters is served (no outer loop)
NOT_READY_RETRY_S = 2.0  # seconds a client is told to wait when there is no state yet


@dataclass(frozen=True, slots=True)
class HeldState:
    flat: torch.Tensor  # fp32, 1-D, a private copy
    momentum: torch.Tensor | None  # fp32, 1-D, a private copy (None: no outer loop)
    round: int
    version: int
    taken_at: float  # monotonic seconds


class StateServer:
    """Serves one node's stage state over `/agora/state/1` (see the module docstring)."""

    def __init__(
        self,
        worker: TorchWorker,
        *,
        run_id: str,
        stage: Callable[[], int],
        params: Callable[[], Sequence[torch.Tensor]],
        outer: bool,
        max_frame: int = DEFAULT_MAX_FRAME,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.worker = worker
        self.run_id = run_id
        self._stage = stage  # the node's stage now
        self._params = params  # the stage's parameters (no outer loop)
        self.outer = outer  # serve theta_g captured by `capture`, never live parameters
        self.max_elements = max(1, min(MAX_CHUNK_ELEMENTS, (max_frame - FRAME_OVERHEAD) // 4))
        self.refresh_s = refresh_s
        self.held: HeldState | None = None
        self.served_chunks = 0

    def _hold(self, flat: torch.Tensor, momentum: torch.Tensor | None, round_: int) -> None:
        self.held = HeldState(
            flat=flat, momentum=momentum, round=round_, version=secrets.randbits(62),
            taken_at=time.monotonic(),
        )  # fmt: skip

    def hold(self, state: GlobalState) -> None:
        """Serve `state` (a private copy, never written again) from now on."""
        self._hold(state.theta_g, state.momentum, state.round)

    async def _refresh_params(self) -> None:
        flat = await self.worker.run(flat_copy, list(self._params()))
        self._hold(flat, None, 0)

    async def handle(self, peer_id: str, msg: Message) -> Message:
        if not isinstance(msg, StateRequest):
            raise ProtocolError(f"expected a state request, got {type(msg).__name__}")
        stage = self._stage()
        if msg.stage != stage:
            return Refused(reason="internal", detail=f"wrong stage: this peer serves stage {stage}")
        if not self.outer:
            held = self.held
            if msg.offset == 0 and (
                held is None or time.monotonic() - held.taken_at > self.refresh_s
            ):
                await self._refresh_params()
        held = self.held
        if held is None:
            return Refused(
                reason="internal",
                retry_after=NOT_READY_RETRY_S,
                detail="no global state yet: the outer loop is starting",
            )
        flat = held.momentum if msg.momentum else held.flat
        if flat is None:
            return Refused(reason="internal", detail="no outer momentum: no outer loop here")
        numel = int(flat.numel())
        if msg.offset >= numel:
            raise ProtocolError(f"offset {msg.offset} is past the state's {numel} elements")
        end = min(numel, msg.offset + min(msg.count, self.max_elements))
        data = TensorFrame.from_numpy(flat[msg.offset : end].numpy())
        self.served_chunks += 1
        if msg.offset == 0:
            log.info(
                "state: serving stage %d round %d (%d elements) to %s",
                stage, held.round, numel, peer_id,
            )  # fmt: skip
        return StateChunk(
            run_id=self.run_id,
            stage=stage,
            round=held.round,
            version=held.version,
            numel=numel,
            offset=msg.offset,
            data=data,
        )
