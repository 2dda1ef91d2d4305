"""Keys proven on a TLS connection, against a real coordinator process: a request signed
for the coordinator's certificate (`bound`) proves its key on that connection, and later
requests of the key there skip the signature check. Nothing else proves a key: not an
unbound request, not one bound to another certificate (what a party in the middle
relaying a client gets), not a replayed proof; and a proof on one connection is worth
nothing on another."""

from __future__ import annotations

import re
import secrets
import time
import urllib.request
from pathlib import Path

from coordinator_harness import write_config

from protocol import control as c
from protocol.codec import encode
from protocol.framing import frame_message
from protocol.identity import NodeKey
from protocol.pinning import fingerprint
from protocol.signing import NONCE_SIZE, SIGNATURE_SIZE, SignedRequest, sign_request
from swarmlab.chaos.control_wire import Control, code
from swarmlab.coordinator import start_coordinator


def _forged(key: NodeKey, body: c.Message) -> bytes:
    """`body` in the name of `key` with a signature of zeros, fresh nonce."""
    req = SignedRequest(
        key=key.public_key, ts=time.time(), nonce=secrets.token_bytes(NONCE_SIZE),
        body=encode(body), sig=bytes(SIGNATURE_SIZE), bound=True,
    )  # fmt: skip
    return frame_message(req)


def _signed(key: NodeKey, body: c.Message, run: str, cert: str | None) -> bytes:
    return frame_message(sign_request(key, body, now=time.time(), run=run, cert=cert))


def _ask(conn: Control, frame: bytes) -> str:
    conn.send(frame)
    return code(conn.read())


def _session_requests(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(r"^agora_coordinator_session_requests_total ([0-9.e+]+)$", text, re.M)
    assert m
    return float(m.group(1))


def test_only_a_fresh_request_bound_to_this_certificate_proves_a_key(tmp_path: Path) -> None:
    coord = start_coordinator(
        tmp_path, config=write_config(tmp_path), db=tmp_path / "c.sqlite", metrics=True
    )
    key = NodeKey.generate()
    hb = c.HeartbeatRequest()
    with Control("127.0.0.1", coord.port) as a:
        run = a.run_id()
        cert = fingerprint(a.sock.getpeercert(binary_form=True))
        # before a proof, a forged signature is refused
        assert _ask(a, _forged(key, hb)) == "bad_signature"
        proof = _signed(key, c.JoinRequest(), run, cert)
        assert _ask(a, proof) == c.JoinReply.TYPE
        before = _session_requests(coord.metrics_port)
        # proven on A: the key's requests there are not checked
        assert _ask(a, _forged(key, hb)) == c.HeartbeatReply.TYPE
        assert _session_requests(coord.metrics_port) == before + 1
        # the replay guard still applies to a proven key
        stale = _signed(key, hb, run, cert)
        assert _ask(a, stale) == c.HeartbeatReply.TYPE
        assert _ask(a, stale) == "replay"

        with Control("127.0.0.1", coord.port) as b:
            # another connection: the proof on A counts for nothing here
            assert _ask(b, _forged(key, hb)) == "bad_signature"
            # the proof itself, replayed here, proves nothing
            assert _ask(b, proof) == "replay"
            assert _ask(b, _forged(key, hb)) == "bad_signature"
            # signed for another certificate (a relay in the middle): refused outright
            elsewhere = "sha256:" + "0" * 64
            assert _ask(b, _signed(key, hb, run, elsewhere)) == "bad_signature"
            assert _ask(b, _forged(key, hb)) == "bad_signature"
            # a valid request that is not bound is answered but proves nothing
            assert _ask(b, _signed(key, hb, run, None)) == c.HeartbeatReply.TYPE
            assert _ask(b, _forged(key, hb)) == "bad_signature"
            # another key is not covered by the proof on A
            other = NodeKey.generate()
            assert _ask(a, _forged(other, hb)) == "bad_signature"
