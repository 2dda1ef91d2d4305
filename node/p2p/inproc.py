"""An in-process `Transport`: peers inside one trio run, wire bytes but no sockets.

Every request and reply is encoded, checked against the frame limit and decoded again
(`protocol.codec`), so a handler sees exactly what it would see over py-libp2p, and a
handler's `ProtocolError` (a reset stream: `PeerUnreachable`) or failure comes back as
the same `TransportError` subclasses.
Only members (`set_membership`) are served. A `FaultPlan` fails chosen requests
deterministically by (peer, step), where step counts the requests sent to that peer on
one network from 0, so unit tests of the pipeline hop and stage 0's driver can cut a
route exactly where they want:
- "drop": the stream resets before a reply (`PeerUnreachable`, as a dead peer's does);
- "timeout": nothing comes back within the request's timeout (`RequestTimeout`);
- "refuse": the peer answers `Refused` (`RequestRefused`);
- "garbage": the reply's bytes do not decode (`TransportError`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import trio

from node.p2p.limits import MembershipFilter, allow_everyone
from node.p2p.transport import (
    Handler,
    PeerUnreachable,
    RequestRefused,
    RequestTimeout,
    TransportError,
)
from protocol.codec import DEFAULT_MAX_FRAME, decode, encode
from protocol.dataplane import Refused
from protocol.errors import ProtocolError
from protocol.message import Message

Fault = Literal["drop", "timeout", "refuse", "garbage"]


@dataclass(slots=True)
class FaultPlan:
    """Faults by (peer id, step): the step-th request sent to that peer fails."""

    faults: dict[tuple[str, int], Fault] = field(default_factory=dict)

    def add(self, peer_id: str, step: int, fault: Fault) -> FaultPlan:
        self.faults[(peer_id, step)] = fault
        return self


class InProcessNetwork:
    """The peers of one test; requests to an unknown peer fail like an unreachable one."""

    def __init__(self, faults: FaultPlan | None = None, *, max_frame: int = DEFAULT_MAX_FRAME):
        self.faults = faults or FaultPlan()
        self.max_frame = max_frame  # bytes
        self.peers: dict[str, InProcessTransport] = {}
        self.sent: Counter[str] = Counter()  # requests sent to each peer so far

    def transport(self, peer_id: str) -> InProcessTransport:
        t = InProcessTransport(self, peer_id)
        self.peers[peer_id] = t
        return t

    def remove(self, peer_id: str) -> None:
        """The peer is gone: requests to it fail from now on."""
        self.peers.pop(peer_id, None)


class InProcessTransport:
    def __init__(self, network: InProcessNetwork, peer_id: str) -> None:
        self.network = network
        self._peer_id = peer_id
        self._handlers: dict[str, Handler] = {}
        self._allow: MembershipFilter = allow_everyone
        self.served = 0  # requests this peer's handlers answered

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addrs(self) -> list[str]:
        return [f"/memory/{self._peer_id}/p2p/{self._peer_id}"]

    @property
    def max_frame(self) -> int:
        return self.network.max_frame

    def add_peer_addrs(self, peer_id: str, addrs: Sequence[str]) -> None:
        pass  # every peer of the network is reachable by its id

    def set_handler(self, protocol_id: str, handler: Handler) -> None:
        self._handlers[protocol_id] = handler

    def set_membership(self, allow: MembershipFilter) -> None:
        self._allow = allow

    def _wire(self, msg: Message) -> Message:
        data = encode(msg)
        if len(data) > self.network.max_frame:
            raise ProtocolError(f"frame of {len(data)} bytes over {self.network.max_frame}")
        return decode(data, max_size=self.network.max_frame)

    async def request(
        self,
        peer_id: str,
        addrs: Sequence[str],
        protocol_id: str,
        msg: Message,
        *,
        timeout: float,
    ) -> Message:
        step = self.network.sent[peer_id]
        self.network.sent[peer_id] += 1
        fault = self.network.faults.faults.get((peer_id, step))
        if fault == "timeout":
            await trio.sleep(timeout)
            raise RequestTimeout(peer_id=peer_id, protocol_id=protocol_id, timeout=timeout)
        if fault == "drop":
            raise PeerUnreachable(f"peer {peer_id} reset the stream (step {step})", peer_id=peer_id)
        if fault == "refuse":
            raise RequestRefused(peer_id=peer_id, reason="internal", retry_after=0.0, detail="")
        target = self.network.peers.get(peer_id)
        if target is None:
            raise PeerUnreachable(f"peer {peer_id} is unreachable", peer_id=peer_id)
        request = self._wire(msg)
        try:
            with trio.fail_after(timeout):
                reply = await target._serve(self._peer_id, protocol_id, request)
        except trio.TooSlowError:
            raise RequestTimeout(
                peer_id=peer_id, protocol_id=protocol_id, timeout=timeout
            ) from None
        if fault == "garbage":
            raise TransportError(
                f"peer {peer_id} sent a bad reply on {protocol_id}", peer_id=peer_id
            )
        try:
            reply = self._wire(reply)
        except ProtocolError as exc:
            raise TransportError(
                f"peer {peer_id} sent a bad reply: {exc}", peer_id=peer_id
            ) from exc
        if isinstance(reply, Refused):
            raise RequestRefused(
                peer_id=peer_id, reason=reply.reason, retry_after=reply.retry_after,
                detail=reply.detail,
            )  # fmt: skip
        return reply

    async def _serve(self, remote: str, protocol_id: str, request: Message) -> Message:
        handler = self._handlers.get(protocol_id)
        if not self._allow(remote):
            return Refused(reason="not_member", detail="")
        if handler is None:
            raise TransportError(
                f"peer {self._peer_id} does not serve {protocol_id}", peer_id=self._peer_id
            )
        try:
            reply = await handler(remote, request)
        except ProtocolError as exc:  # the requester broke the protocol: the stream resets
            raise PeerUnreachable(
                f"peer {self._peer_id} reset the stream: {exc}", peer_id=self._peer_id
            ) from exc
        except Exception as exc:
            return Refused(reason="internal", detail=type(exc).__name__)
        self.served += 1
        return reply
