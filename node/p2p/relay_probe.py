"""A relay's gate seen from the client side: one circuit-relay v2 RESERVE or CONNECT sent
as a client would send it, with any peer id in it, and the status the relay answered.

`node.p2p.relay` keeps reservations and dials circuits for a node; this module only asks
and reports, so that a prober (`agora chaos --hostile`'s relay attacker) can try what an
honest client never sends: a reservation in another peer's name, a circuit to a peer
that is not a member. The stream is closed after the answer (an accepted CONNECT's too).
"""

from __future__ import annotations

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

from node.p2p.host import Libp2pTransport
from node.p2p.relay import parse_relay_addr

ACCEPTED = StatusCode.OK.name  # the answer that grants a reservation or opens a circuit
RESET = "reset"  # the relay closed the stream without a status
TIMEOUT = "timeout"  # no answer within the deadline


async def hop_exchange(
    transport: Libp2pTransport,
    relay_addr: str,
    *,
    reserve: bool,
    peer_id: str,
    timeout_s: float = 10.0,
) -> str:
    """Send one RESERVE naming `peer_id` (`reserve=True`; an honest client names itself)
    or one CONNECT to `peer_id` to the relay at `relay_addr` (`.../p2p/<relay id>`), from
    `transport`'s identity; returns the name of the relay's status (`OK`,
    `PERMISSION_DENIED`, `NO_RESERVATION`, ...), `RESET` or `TIMEOUT`."""
    relay_ma, relay_id = parse_relay_addr(relay_addr)
    host = transport.host
    msg = HopMessage(
        type=HopMessage.RESERVE if reserve else HopMessage.CONNECT,
        peer=CircuitPeerId(id=ID.from_base58(peer_id).to_bytes()),
    )
    try:
        with trio.fail_after(timeout_s):
            if not host.get_network().connections.get(relay_id):
                await host.connect(PeerInfo(relay_id, [relay_ma]))
            stream = await host.new_stream(relay_id, [HOP_PROTOCOL])
            try:
                await write_delimited_msg(stream, msg)
                reply = await read_delimited_msg(stream, HopMessage)
            finally:
                with trio.move_on_after(2.0):
                    await stream.close()
    except trio.TooSlowError:
        return TIMEOUT
    except Exception:  # a stream reset or EOF before any status: py-libp2p's many kinds
        return RESET
    if not reply.HasField("status"):
        return RESET
    try:
        return StatusCode(reply.status).name
    except ValueError:
        return f"status {int(reply.status)}"
