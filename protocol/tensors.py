"""Tensor frames: dtype, shape, codec id and payload, converted to and from numpy.

A `TensorFrame` is one raw array. Codecs that need side data (int8 scales, subspace
coefficients) send an `EncodedTensor`: the codec id, the logical shape and its parts.
Receivers check dtype, shape, payload size and finiteness here, before anything touches
a model.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from protocol.errors import ProtocolError
from protocol.message import Message, bounded, record

DTYPES: dict[str, Any] = {
    "float32": np.float32,
    "float16": np.float16,
    "int8": np.int8,
    "uint8": np.uint8,
    "uint16": np.uint16,  # token ids of a vocabulary of up to 65536
    "uint32": np.uint32,  # token ids of a larger vocabulary
    "int32": np.int32,
    "int64": np.int64,
}
MAX_DIMS = 8
MAX_DIM = 2**31  # elements along one axis
MAX_ELEMENTS = 2**31  # elements in a tensor (the product of its non-zero dimensions)
CODECS = ("raw", "fp16", "int8", "subspace", "subspace_int8", "subspace_int4")


@record
class TensorFrame(Message):
    dtype: str = bounded(choices=tuple(DTYPES))
    shape: list[int] = bounded(max_len=MAX_DIMS)
    data: bytes

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> TensorFrame:
        name = arr.dtype.name
        if name not in DTYPES:
            raise ProtocolError(f"dtype {name} cannot be sent")
        return cls(dtype=name, shape=list(arr.shape), data=np.ascontiguousarray(arr).tobytes())

    def to_numpy(
        self,
        *,
        expect_dtype: str | None = None,
        expect_shape: tuple[int | None, ...] | None = None,
        finite: bool = True,
    ) -> np.ndarray:
        """Validate and view the payload as an array (`None` in a shape is any size)."""
        if expect_dtype is not None and self.dtype != expect_dtype:
            raise ProtocolError(f"dtype {self.dtype}, expected {expect_dtype}")
        check_shape(self.shape, expect_shape)
        dtype = np.dtype(DTYPES[self.dtype])
        expected = math.prod(self.shape) * dtype.itemsize
        if len(self.data) != expected:
            raise ProtocolError(
                f"payload of {len(self.data)} bytes does not match {self.dtype}{self.shape}"
            )
        arr = np.frombuffer(self.data, dtype=dtype).reshape(self.shape)
        if finite and dtype.kind == "f" and not bool(np.isfinite(arr).all()):
            raise ProtocolError("tensor holds NaN or Inf")
        return arr


@record
class EncodedTensor(Message):
    codec: str = bounded(choices=CODECS)
    shape: list[int] = bounded(max_len=MAX_DIMS)  # logical shape after decoding
    parts: list[TensorFrame] = bounded(max_len=8)


def check_shape(shape: list[int], expect: tuple[int | None, ...] | None) -> None:
    if len(shape) > MAX_DIMS or any(type(d) is not int or not 0 <= d <= MAX_DIM for d in shape):
        raise ProtocolError(f"bad shape {shape[:MAX_DIMS]}")
    # An empty tensor's other dimensions still count: numpy refuses shapes whose non-zero
    # dimensions multiply past its index range, even with zero elements.
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise ProtocolError(f"shape {shape} has more than {MAX_ELEMENTS} elements")
    if expect is None:
        return
    if len(shape) != len(expect) or any(
        e is not None and e != d for d, e in zip(shape, expect, strict=True)
    ):
        raise ProtocolError(f"shape {shape}, expected {list(expect)}")
