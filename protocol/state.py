"""Stage-state messages on the data plane (`/agora/state/1`).

A member of the run (an `agora export` observer, for one) asks a replica of a stage for
its global state `theta_g`: the flat fp32 vector of the stage's parameters in
`model.parameters()` order (the outer loop's layout, node.checkpoint `split_flat`), and
the outer momentum `m` in the same layout when it checks the state's digest.

    StateRequest(stage, offset, count) -> StateChunk(run_id, stage, round, version,
                                                     numel, offset, data)

The state is sent in chunks of at most `count` elements (the server may send fewer, never
more than its own `MAX_CHUNK_ELEMENTS`), so a stage of any size never needs a frame above
the frame limit: 4M fp32 elements are 16 MiB, well under `DEFAULT_MAX_FRAME` (64 MiB).
Every chunk of one served copy carries the same `round` and `version`; a server replaces
its copy when a new outer round applies (`version` changes), and a client that sees
`round` or `version` change between chunks starts again at offset 0.

Errors come back as the data plane's `protocol.dataplane.Refused`: `not_member` for a
peer outside the run (the transport's admission check), `internal` with a `detail` for a
request the server cannot answer now or at all (wrong stage, no state yet), with
`retry_after` when asking again later may help.
"""

from __future__ import annotations

import numpy as np

from protocol.errors import ProtocolError
from protocol.message import Message, bounded, message
from protocol.tensors import TensorFrame

STATE_PROTOCOL = "/agora/state/1"
CHUNK_ELEMENTS = 4 * 1024 * 1024  # fp32 elements a client asks per chunk (16 MiB)
MAX_CHUNK_ELEMENTS = 8 * 1024 * 1024  # fp32 elements in one chunk at most (32 MiB)
MAX_NUMEL = 2**40  # elements in one stage's state, a sanity bound


@message("state.get", version=1)
class StateRequest(Message):
    """Elements `[offset, offset + count)` of the stage's global state: of `theta_g`, or
    with `momentum` of the outer momentum `m` of the same served copy (so a client can
    check the state's digest, `protocol.lineage.state_digest`, against an attested one)."""

    stage: int = bounded(ge=0, le=1023)
    offset: int = bounded(ge=0, le=MAX_NUMEL)
    count: int = bounded(ge=1, le=MAX_CHUNK_ELEMENTS)
    momentum: bool = False


@message("state.chunk", version=1)
class StateChunk(Message):
    """One chunk of a served copy of a stage's global state.

    `round` is the outer round of the state (0 for a node without an outer loop, which
    serves its current parameters); `version` identifies the served copy, so a client can
    tell two copies of one round apart. `data` is float32, one-dimensional.
    """

    run_id: str = bounded(max_len=128)
    stage: int = bounded(ge=0, le=1023)
    round: int = bounded(ge=0)
    version: int = bounded(ge=0)
    numel: int = bounded(ge=1, le=MAX_NUMEL)  # elements in the whole state
    offset: int = bounded(ge=0, le=MAX_NUMEL)  # first element of this chunk
    data: TensorFrame

    def __post_init__(self) -> None:
        shape = self.data.shape
        if self.data.dtype != "float32" or len(shape) != 1:
            raise ValueError(f"data must be 1-D float32, got {self.data.dtype}{list(shape)}")
        n = shape[0]
        if not 1 <= n <= MAX_CHUNK_ELEMENTS:
            raise ValueError(f"chunk of {n} elements outside [1, {MAX_CHUNK_ELEMENTS}]")
        if self.offset + n > self.numel:
            raise ValueError(
                f"chunk [{self.offset}, {self.offset + n}) exceeds the state's {self.numel}"
            )

    def values(self) -> np.ndarray:
        """The chunk's elements (read-only view), checked for size and finiteness."""
        arr = self.data.to_numpy(expect_dtype="float32", expect_shape=(None,))
        if arr.shape[0] != self.data.shape[0]:  # pragma: no cover - to_numpy checks it
            raise ProtocolError("chunk payload does not match its shape")
        return arr

    @property
    def end(self) -> int:
        """One past the chunk's last element."""
        return self.offset + self.data.shape[0]
