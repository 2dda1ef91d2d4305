"""Pipeline messages on the data plane (`/agora/fwd/1`).

A stage sends `Forward` to a peer of the next stage and the reply is `Backward`: the
compressed gradient with respect to the boundary it sent, plus the loss computed by the
last stage. Micro-batch ids derive from (lease, offset), so a retried micro-batch keeps
its id and is counted once by stage 0.
"""

from __future__ import annotations

from protocol.message import Message, bounded, message
from protocol.tensors import EncodedTensor, TensorFrame

FORWARD_PROTOCOL = "/agora/fwd/1"
MAX_ROUTE = 64  # hops
MAX_PEER_ID = 128  # characters of a peer id in a route (base58 ed25519 ids have 52)


@message("fwd", version=1)
class Forward(Message):
    mb_id: str = bounded(max_len=128)
    tokens: TensorFrame  # uint8 [B, T + 1]: inputs and next-byte targets
    hidden: EncodedTensor  # the previous stage's boundary output, encoded by the run codec
    route: list[str] = bounded(max_len=MAX_ROUTE, item_max_len=MAX_PEER_ID)  # peer ids so far
    deadline: float = bounded(ge=0)  # unix seconds after which stage 0 has given up
    # an earlier attempt of this micro-batch failed: the receiver serves it before fresh
    # ones (it is the oldest work, re-routed around a failed peer)
    retry: bool = False


@message("bwd", version=1)
class Backward(Message):
    mb_id: str = bounded(max_len=128)
    grad: EncodedTensor  # d loss / d (the hidden that was sent), encoded by the run codec
    loss: float = bounded(ge=0)  # mean cross-entropy of the micro-batch, nats per token
    tokens: int = bounded(ge=0)  # target tokens the loss was computed over
