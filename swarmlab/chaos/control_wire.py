"""A blocking control-plane connection for the hostile attacks and the heartbeat probe of
`agora chaos --hostile`: signed requests written as frames, replies read back in order.

No trio, torch or libp2p: the raw attackers start in well under a second, and the probe
runs on a thread of the chaos process. `Control.call` times each round trip.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from node.control_tls import connect
from protocol import control as c
from protocol.codec import decode
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, frame_message
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.signing import sign_request

MAX_REPLY = 32 << 20  # bytes of one reply frame the attackers accept (a membership view)


def signed_frame(
    key: NodeKey, body: Message, *, run: str | None, now: float | None = None
) -> bytes:
    """`body` signed by `key` for `run` (at `now`, default the current time), framed for
    the wire. Only a status request may be signed for no run (`run=None`)."""
    return frame_message(sign_request(key, body, now=time.time() if now is None else now, run=run))


def learn_run(host: str, port: int, *, timeout_s: float = 5.0) -> str:
    """The run id the coordinator at `host:port` signs for (from its status)."""
    with Control(host, port, timeout_s=timeout_s) as conn:
        return conn.run_id()


def code(msg: Message) -> str:
    """The error code of an `ErrorReply`, else the reply's type tag."""
    return msg.code if isinstance(msg, c.ErrorReply) else msg.TYPE


class Control:
    """One TLS connection to the coordinator (`node.control_tls.connect`, checked against
    `pin` when given); every read and write has `timeout_s`."""

    def __init__(
        self, host: str, port: int, *, timeout_s: float = 5.0, pin: str | None = None
    ) -> None:
        self.sock = connect(host, port, pin, timeout_s=timeout_s)
        self.decoder = FrameDecoder(max_frame=MAX_REPLY)
        self._ready: list[bytes] = []
        self._run: str | None = None  # learnt from the first status reply

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> Message:
        """The next reply; `ConnectionError` if the coordinator closed the connection."""
        while not self._ready:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the coordinator closed the connection")
            self._ready += self.decoder.feed(chunk)
        try:
            return decode(self._ready.pop(0), max_size=MAX_REPLY)
        except ProtocolError as exc:
            raise ConnectionError(f"undecodable reply: {exc}") from exc

    def read_codes(self, n: int) -> list[str]:
        """Codes of up to `n` replies, stopping early when the connection ends or stalls."""
        out: list[str] = []
        try:
            while len(out) < n:
                out.append(code(self.read()))
        except (OSError, ConnectionError):
            pass
        return out

    def run_id(self) -> str:
        """The coordinator's run id, asked once with a status request signed for no run."""
        if self._run is None:
            self.send(signed_frame(NodeKey.generate(), c.StatusRequest(), run=None))
            reply = self.read()
            if not isinstance(reply, c.StatusReply):
                raise ConnectionError(f"expected a status reply, got {code(reply)!r}")
            self._run = reply.run_id
        return self._run

    def call(self, key: NodeKey, body: Message) -> tuple[Message, float]:
        """Send one signed request for this coordinator's run; its reply and the round
        trip in seconds."""
        run = self.run_id()
        t = time.monotonic()
        self.send(signed_frame(key, body, run=run))
        reply = self.read()
        return reply, time.monotonic() - t


def write_outcome(
    path: str, play: Callable[[], dict[str, Any]], expected: tuple[type[BaseException], ...]
) -> int:
    """Play one attack and write its outcome to `path` as JSON. An `expected` error (the
    target refused or dropped the attacker itself) is an outcome too, judged by nobody:
    `defended` is None. Returns the attacker's exit status, 0."""
    try:
        result = play()
    except expected as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"[:300], "defended": None}
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2)
    return 0
