"""Agora's sans-I/O wire protocol: messages, msgpack codec with limits, framing,
tensor frames and signed requests. No torch, no sockets, no event loop.

Public contract: `encode(msg) -> bytes`, `decode(data) -> Message`; anything malformed
raises `ProtocolError` and nothing else.
"""

from protocol import control, dataplane, launch, pipeline, state
from protocol.codec import DEFAULT_MAX_FRAME, decode, encode, packb, unpackb
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame, frame_message
from protocol.identity import NodeKey, peer_id_from_public_key, verify_signature
from protocol.message import Message, bounded, message, record, registered_tags
from protocol.signing import ReplayGuard, SignedRequest, sign_request, verify_request
from protocol.tensors import EncodedTensor, TensorFrame

__all__ = [
    "DEFAULT_MAX_FRAME",
    "EncodedTensor",
    "FrameDecoder",
    "Message",
    "NodeKey",
    "ProtocolError",
    "ReplayGuard",
    "SignedRequest",
    "TensorFrame",
    "bounded",
    "control",
    "dataplane",
    "decode",
    "encode",
    "frame",
    "frame_message",
    "launch",
    "message",
    "packb",
    "pipeline",
    "peer_id_from_public_key",
    "record",
    "registered_tags",
    "sign_request",
    "state",
    "unpackb",
    "verify_request",
    "verify_signature",
]
