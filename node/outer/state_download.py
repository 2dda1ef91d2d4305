"""`StateDownload`: reads one replica's state stream (hivemind's `rpc_download_state`) with
every byte treated as hostile.

A stage's state is two flat fp32 tensors of the stage's `numel` (theta_g, then the outer
momentum m) and a small metadata map with the `round`. The reader counts the bytes of
every message and stops past `expected_bytes(numel)` (the tensors' own bytes plus
`STATE_SLACK_BYTES`), checks each tensor's header (dtype, codec, size) before its bytes
are decoded, and checks the whole (two tensors, a round, finite values) at the end.
Anything else raises `ValueError`: the caller refuses that source and tries the next.
`state_digest` names a state as replicas and the coordinator do. Imports hivemind: never
import it from the stage process.
"""

from __future__ import annotations

from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import combine_from_streaming

from protocol.lineage import state_digest as lineage_digest

STATE_TENSORS = 2  # theta_g and m
STATE_SLACK_BYTES = 1024 * 1024  # bytes beyond the tensors: metadata, protobuf framing
MAX_METADATA_BYTES = 64 * 1024  # bytes of the serialized metadata map


def state_digest(rnd: int, theta_g: torch.Tensor, m: torch.Tensor) -> str:
    """`protocol.lineage.state_digest` of the state (round, theta_g, m)."""
    return lineage_digest(rnd, theta_g.contiguous().numpy().data, m.contiguous().numpy().data)


def expected_bytes(numel: int) -> int:
    """The most bytes a source may send for a stage of `numel` parameters."""
    return STATE_TENSORS * 4 * numel + STATE_SLACK_BYTES


class StateDownload:
    """Feed it a source's `DownloadData` messages in order, then take `result()`."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.max_bytes = expected_bytes(numel)
        self.received = 0  # bytes of the messages fed so far
        self.metadata: dict[str, Any] | None = None
        self.tensors: list[torch.Tensor] = []
        self._parts: list[runtime_pb2.Tensor] = []

    def feed(self, msg: averaging_pb2.DownloadData) -> None:
        self.received += msg.ByteSize()
        if self.received > self.max_bytes:
            raise ValueError(f"state of more than {self.max_bytes} bytes (numel {self.numel})")
        if msg.metadata:
            if self.metadata is not None or len(msg.metadata) > MAX_METADATA_BYTES:
                raise ValueError("metadata sent twice or over its size")
            meta = MSGPackSerializer.loads(msg.metadata)
            if not isinstance(meta, dict):
                raise ValueError(f"metadata is a {type(meta).__name__}, not a map")
            self.metadata = meta
        part = msg.tensor_part
        if part.dtype:  # the first part of a tensor carries its header
            self._finish_tensor()
            if len(self.tensors) >= STATE_TENSORS:
                raise ValueError(f"more than {STATE_TENSORS} tensors")
            if part.dtype != "float32" or list(part.size) != [self.numel]:
                raise ValueError(
                    f"tensor {part.dtype}{list(part.size)[:8]}, expected float32[{self.numel}]"
                )
            if part.compression != runtime_pb2.CompressionType.NONE:
                raise ValueError("a state tensor must not be compressed")
        elif not self._parts and part.ByteSize():
            raise ValueError("tensor bytes before any tensor header")
        if part.ByteSize():
            self._parts.append(part)

    def check_rate(self, elapsed_s: float, min_bytes_per_s: float, grace_s: float) -> None:
        """Refuse a source that, `grace_s` into the download, has sent less than
        `min_bytes_per_s` on average since: one that drips bytes would otherwise hold the
        reader for the whole allowance a large state gets."""
        floor = min_bytes_per_s * (elapsed_s - grace_s)
        if self.received < floor:
            raise ValueError(
                f"{self.received} bytes in {elapsed_s:.1f}s: slower than"
                f" {min_bytes_per_s / 1e6:g} MB/s after {grace_s:g}s"
            )

    def _finish_tensor(self) -> None:
        if not self._parts:
            return
        tensor = deserialize_torch_tensor(combine_from_streaming(self._parts))
        self._parts = []
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != (self.numel,):
            raise ValueError(f"tensor decoded to {tensor.dtype}{tuple(tensor.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError("tensor holds NaN or Inf")
        self.tensors.append(tensor)

    def result(self) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """(metadata, [theta_g, m]); None for a source that shares no state."""
        self._finish_tensor()
        meta = self.metadata
        if meta is None and not self.tensors:
            return None
        rnd = None if meta is None else meta.get("round")
        if meta is None or type(rnd) is not int or rnd < 0:
            raise ValueError(f"state without a round: {rnd!r:.40}")
        if len(self.tensors) != STATE_TENSORS:
            raise ValueError(f"{len(self.tensors)} tensors, expected {STATE_TENSORS}")
        return meta, self.tensors
