"""The pseudo-gradient wire codecs of the outer loop, by name (`contract.COMPRESSIONS`).

The outer-loop process compresses each replica's pseudo-gradient with one of hivemind's
codecs before the all-gather, and every member of a group decodes the same bytes with
`decode_tensor`, its own contribution included, so that all members average identical
inputs. `round_trip` is that path in one call, for code that simulates a group (the
outer-sweep bench) without running the outer process. Imports hivemind: never import it
from the stage process.
"""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
    deserialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

from node.outer.contract import COMPRESSIONS

_CODECS: dict[str, type[CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "uint8": Uniform8BitQuantization,
}
assert tuple(_CODECS) == COMPRESSIONS


def compression(name: str) -> CompressionBase:
    """A fresh hivemind codec for the compression `name` (one of `COMPRESSIONS`)."""
    if name not in _CODECS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {name!r}")
    return _CODECS[name]()


def decode_tensor(msg: runtime_pb2.Tensor) -> torch.Tensor:
    """`deserialize_torch_tensor`, except for hivemind 1.1.12's 8-bit codecs, whose `extract`
    fails with numpy 2 (`int()` of a 1-element array); same byte layout: int64 codebook
    size, fp32 codebook, uint8 indices."""
    if msg.compression not in (runtime_pb2.UNIFORM_8BIT, runtime_pb2.QUANTILE_8BIT):
        out: torch.Tensor = deserialize_torch_tensor(msg).detach()
        return out
    buf = msg.buffer
    size = int(np.frombuffer(buf, count=1, dtype=np.int64)[0])
    if not 0 < size <= 256 or len(buf) < 8 + 4 * size:
        raise ValueError(f"bad 8-bit codebook size {size}")
    codebook = torch.from_numpy(np.frombuffer(buf, offset=8, count=size, dtype=np.float32).copy())
    idx = torch.from_numpy(np.frombuffer(buf, offset=8 + 4 * size, dtype=np.uint8).copy()).long()
    if bool((idx >= size).any()):
        raise ValueError("8-bit index outside the codebook")
    return codebook[idx].reshape(tuple(msg.size)).to(getattr(torch, msg.dtype))


def round_trip(delta: torch.Tensor, name: str) -> torch.Tensor:
    """`delta` (flat fp32) after the wire codec `name` and its decoder: what every member of
    a group averages."""
    codec = compression(name)
    msg = codec.compress(delta, CompressionInfo.from_tensor(delta, key=0), allow_inplace=False)
    return decode_tensor(msg).to(torch.float32).flatten()
