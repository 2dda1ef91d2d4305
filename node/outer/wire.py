"""The pseudo-gradient wire codecs of the outer loop, by name (`contract.COMPRESSIONS`).

The outer-loop process compresses each replica's pseudo-gradient with one of hivemind's
codecs before the all-gather, and every member of a group decodes the same bytes with
`decode_tensor`, its own contribution included, so that all members average identical
inputs. `round_trip` is that path in one call, for code that simulates a group (the
outer-sweep bench) without running the outer process. The sparse codecs (`topk1`,
`topk3`) carry a vector's nonzeros (`node.outer.sparse`): the outer process selects what
to send with error feedback before the averager sees it. Imports hivemind: never import
it from the stage process.
"""

from __future__ import annotations

import math

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
from node.outer.sparse import SPARSE, decode_nonzeros, encode_nonzeros, max_encoded_bytes

# the `dtype` that marks a tensor message as `encode_nonzeros` bytes (hivemind's own codecs
# name a torch dtype there)
NONZEROS_DTYPE = "agora-nonzeros-f16"


class NonzerosCompression(CompressionBase):  # type: ignore[misc]  # hivemind is untyped
    """A mostly-zero tensor as its nonzeros at fp16 (`node.outer.sparse.encode_nonzeros`)."""

    compression_type = runtime_pb2.CompressionType.NONE

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=encode_nonzeros(tensor),
            size=list(tensor.shape),
            dtype=NONZEROS_DTYPE,
            requires_grad=False,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        """hivemind's interface (the outer loop decodes with `decode_tensor`, which is told
        how many values to expect)."""
        return decode_tensor(serialized_tensor, math.prod(serialized_tensor.size))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0  # data-dependent: 4 bytes a nonzero


_CODECS: dict[str, type[CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "uint8": Uniform8BitQuantization,
    **dict.fromkeys(SPARSE, NonzerosCompression),
}
assert tuple(_CODECS) == COMPRESSIONS


def max_wire_bytes(numel: int) -> int:
    """The most bytes any codec's message of `numel` values may take."""
    return max(4 * numel + 4096, max_encoded_bytes(numel))


def compression(name: str) -> CompressionBase:
    """A fresh hivemind codec for the compression `name` (one of `COMPRESSIONS`)."""
    if name not in _CODECS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {name!r}")
    return _CODECS[name]()


def decode_tensor(msg: runtime_pb2.Tensor, numel: int) -> torch.Tensor:
    """The tensor of `numel` values that `msg` carries: ValueError for another count,
    checked before anything is allocated (a sender's `size` is as hostile as its bytes).
    `deserialize_torch_tensor`, except for `NonzerosCompression`'s messages and for
    hivemind 1.1.12's 8-bit codecs, whose `extract` fails with numpy 2 (`int()` of a
    1-element array; same byte layout: int64 codebook size, fp32 codebook, uint8
    indices)."""
    if math.prod(msg.size) != numel:
        raise ValueError(f"a message of shape {list(msg.size)[:4]}, expected {numel} values")
    if msg.dtype == NONZEROS_DTYPE:
        return decode_nonzeros(msg.buffer, numel).reshape(tuple(msg.size))
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
    return decode_tensor(msg, delta.numel()).to(torch.float32).flatten()
