"""The raw-socket attackers of `agora chaos --hostile`: control-plane attacks on the
coordinator, each played by a fresh process, each reporting what came back.

Run as `python -m swarmlab.chaos.raw_attacks --coordinator HOST:PORT --attack NAME
--hold SECONDS --json OUT`. Every attack returns a dict with `defended` (whether the
coordinator's answer is the one a defended coordinator gives; what honest processes
experienced meanwhile is judged by the caller, `swarmlab.chaos.hostile`) and `expect`
(that answer, in words). Attacks:

- `bad_addrs`: joins and a heartbeat whose addresses do not parse, too long, too many;
- `amplify`: pre-auth frames of msgpack that unpacks into far more than it weighs
  (deep nesting, a million empty arrays, map and bin headers claiming 4 G), and signed
  bodies of a million empty arrays within the per-array limit;
- `conn_flood`: hundreds of idle connections from one address, held;
- `slow_drip`: frames sent one byte a second;
- `stranger_lease`: commit / complete / release of lease ids the key never held, from a
  non-member and from a member;
- `forged_facility`: facility reports of 4,096 running jobs from keys with no launcher
  credential;
- `key_flood`: signed requests from thousands of fresh keys, and a captured request
  replayed;
- `fat_member`: members whose address lists are as long as allowed, to bloat the
  membership replies every node fetches.
"""

from __future__ import annotations

import argparse
import socket
import ssl
import struct
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

from node.control_tls import connect
from protocol import control as c
from protocol.addrs import multiaddr_problem
from protocol.codec import encode
from protocol.framing import HEADER, frame_message
from protocol.identity import NodeKey
from protocol.launch import MAX_JOBS, FacilityJob, FacilityReport
from protocol.pinning import parse_address
from protocol.signing import NONCE_SIZE, SignedRequest, signed_bytes
from swarmlab.chaos.control_wire import Control, code, learn_run, signed_frame, write_outcome

FLOOD_CONNECTIONS = 400  # idle connections `conn_flood` opens from one address
DRIPS = 4  # connections `slow_drip` feeds one byte a second
DRIP_S = 15.0  # seconds `slow_drip` lasts at least: past the default `frame_deadline_s` (10)
FLOOD_KEYS = 2000  # fresh keys of `key_flood`
FAT_MEMBERS = 20  # members of `fat_member`, each with MAX_ADDRS maximal addresses
MEMBERSHIP_BOUND = 64 << 10  # bytes of a full membership reply a defended coordinator sends
FACILITIES = 8  # forged facility reports, one key each
ANSWER_S = 5.0  # seconds a refusal may take
FENCED_METRIC = "agora_coordinator_fence_records_total"


def _pack_str(s: str) -> bytes:
    raw = s.encode()
    return bytes([0xA0 | len(raw)]) + raw  # fixstr: < 32 bytes here


def _tagged_map(tag: str, extra: dict[str, bytes]) -> bytes:
    """A msgpack map {"t": tag, "v": 1, **extra} with `extra`'s values already packed."""
    out = bytes([0x80 | (2 + len(extra))]) + _pack_str("t") + _pack_str(tag)
    out += _pack_str("v") + b"\x01"
    for k, v in extra.items():
        out += _pack_str(k) + v
    return out


def _arrays(n: int, each: int) -> bytes:
    """An array of `n` arrays of `each` empty arrays (array16/32 headers)."""
    inner = b"\xdd" + struct.pack(">I", each) + b"\x90" * each
    return b"\xdd" + struct.pack(">I", n) + inner * n


def _one_shot(host: str, port: int, data: bytes) -> dict[str, Any]:
    """Send `data` on a fresh connection; reply codes and seconds until it was closed."""
    t = time.monotonic()
    try:
        with Control(host, port, timeout_s=ANSWER_S) as conn:
            conn.send(data)
            codes = conn.read_codes(1)
    except OSError as exc:
        return {"codes": [], "error": type(exc).__name__, "s": round(time.monotonic() - t, 3)}
    return {"codes": codes, "s": round(time.monotonic() - t, 3)}


def bad_addrs(host: str, port: int, hold_s: float) -> dict[str, Any]:
    key = NodeKey.generate()
    good = f"/ip4/127.0.0.1/tcp/4001/p2p/{key.peer_id}"
    joins = {
        "garbage": c.JoinRequest(addrs=["garbage"], stage=0),
        "bad_dht": c.JoinRequest(addrs=[good], dht_addrs=["/ip4/1.2.3.4/tcp/99999"], stage=0),
        "too_long": c.JoinRequest(addrs=["/ip4/1.2.3.4/tcp/1" + "/ws" * 200], stage=0),
        "too_many": c.JoinRequest(addrs=[good] * (c.MAX_ADDRS + 1), stage=0),
    }
    out: dict[str, Any] = {}
    with Control(host, port) as conn:
        for label, req in joins.items():
            out[label] = code(conn.call(key, req)[0])
        out["join_good"] = code(conn.call(key, c.JoinRequest(addrs=[good], stage=0))[0])
        hb = c.HeartbeatRequest(dht_addrs=["garbage"])
        out["heartbeat_garbage_dht"] = code(conn.call(key, hb)[0])
        view, _ = conn.call(key, c.MembershipRequest())
        bad = []
        if isinstance(view, c.MembershipReply):
            for p in view.peers:
                bad += [a for a in [*p.addrs, *p.dht_addrs] if multiaddr_problem(a)]
        out["view_bad_addrs"] = len(bad)
        out["leave"] = code(conn.call(key, c.LeaveRequest())[0])
    refused = [out[k] for k in (*joins, "heartbeat_garbage_dht")]
    out["defended"] = all(r == "bad_request" for r in refused) and not bad
    out["expect"] = "every bad address refused with bad_request; the view holds none"
    return out


def amplify(host: str, port: int, hold_s: float) -> dict[str, Any]:
    room = (1 << 20) - 64  # just under the 1 MiB request cap
    pre_auth = {
        "deep_nesting": b"\x91" * room + b"\x90",
        "empty_arrays": _tagged_map("signed", {"junk": b"\xdd" + struct.pack(">I", room - 32)})
        + b"\x90" * (room - 32),
        "map32_4g": b"\xdf\xff\xff\xff\xff" + b"\xc0" * 64,
        "bin32_4g": _tagged_map("signed", {"body": b"\xc6\xff\xff\xff\xff"}) + b"\0" * 64,
    }
    out: dict[str, Any] = {
        k: _one_shot(host, port, HEADER.pack(len(v)) + v) for k, v in pre_auth.items()
    }
    # Signed by a throw-away key: 1M empty arrays in 250 arrays of 4096 (within the limit)
    body = _tagged_map("status", {"junk": _arrays(250, 4096)})
    frames, run = b"", learn_run(host, port)
    for _ in range(8):
        key, now = NodeKey.generate(), time.time()
        nonce = NONCE_SIZE * b"\1"
        sig = key.sign(signed_bytes(key.public_key, now, nonce, body, run=run))
        req = SignedRequest(key=key.public_key, ts=now, nonce=nonce, body=body, sig=sig)
        frames += frame_message(req, max_frame=2 << 20)
    t = time.monotonic()
    try:
        with Control(host, port, timeout_s=30.0) as conn:
            conn.send(frames)
            out["signed_million_arrays"] = {"codes": conn.read_codes(8)}
    except OSError as exc:
        out["signed_million_arrays"] = {"codes": [], "error": type(exc).__name__}
    out["signed_million_arrays"]["s"] = round(time.monotonic() - t, 3)
    pre = all(out[k]["codes"] == ["bad_frame"] and out[k]["s"] < ANSWER_S for k in pre_auth)
    signed = out["signed_million_arrays"]["codes"]
    out["defended"] = (
        pre and bool(signed) and all(x in ("bad_request", "bad_frame") for x in signed)
    )
    out["expect"] = "bad_frame at once before auth; a signed body of 1M objects refused"
    return out


def _closed(s: socket.socket) -> bool:
    """Whether the coordinator closed (or answered and closed) a connection we left idle."""
    try:
        s.setblocking(False)
        s.recv(4096)  # no bytes: closed; any bytes: a refusal (too_busy) before closing
        return True
    except (BlockingIOError, ssl.SSLWantReadError):  # nothing to read: still open
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def conn_flood(host: str, port: int, hold_s: float) -> dict[str, Any]:
    socks: list[socket.socket] = []
    failed = 0
    for _ in range(FLOOD_CONNECTIONS):
        try:
            socks.append(connect(host, port, None, timeout_s=ANSWER_S))
        except OSError:
            failed += 1
    time.sleep(min(hold_s, 20.0))
    closed = sum(_closed(s) for s in socks)
    for s in socks:
        s.close()
    held = len(socks) - closed
    return {
        "tried": FLOOD_CONNECTIONS, "connect_failed": failed, "closed_by_coordinator": closed,
        "held": held, "defended": held < FLOOD_CONNECTIONS,
        "expect": "connections from one address beyond a cap refused or closed",
    }  # fmt: skip


def slow_drip(host: str, port: int, hold_s: float) -> dict[str, Any]:
    socks = [connect(host, port, None, timeout_s=ANSWER_S) for _ in range(DRIPS)]
    for s in socks:
        s.sendall(HEADER.pack(256))  # promises 256 bytes, then sends one a second
    closed_at: dict[int, float] = {}
    t0, drip_s = time.monotonic(), max(hold_s, DRIP_S)
    while time.monotonic() - t0 < drip_s and len(closed_at) < len(socks):
        time.sleep(1.0)
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                s.sendall(b"\x00")
            except OSError:
                closed_at[i] = time.monotonic() - t0
                continue
            if _closed(s):
                closed_at[i] = time.monotonic() - t0
    for s in socks:
        s.close()
    return {
        "drips": DRIPS, "dripped_s": round(time.monotonic() - t0, 1),
        "closed_after_s": sorted(round(v, 1) for v in closed_at.values()),
        "defended": len(closed_at) == DRIPS,
        "expect": "a frame that is not complete within a deadline is dropped with its connection",
    }  # fmt: skip


def _lease_calls(conn: Control, key: NodeKey) -> Counter[str]:
    n, run = 0, conn.run_id()
    frames = b""
    for lease_id in range(1, 41):
        for epoch in range(3):
            for body in (
                c.LeaseCommit(lease_id=lease_id, epoch=epoch, start=0, end=1),
                c.LeaseComplete(lease_id=lease_id, epoch=epoch),
                c.LeaseRelease(lease_id=lease_id, epoch=epoch),
            ):
                frames += signed_frame(key, body, run=run)
                n += 1
    conn.send(frames)
    return Counter(conn.read_codes(n))


def _fence_writes(metrics: str) -> float:
    """The coordinator's count of audited fence records; -1 without metrics."""
    if not metrics:
        return -1.0
    try:
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=ANSWER_S) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    for line in text.splitlines():
        if line.startswith(FENCED_METRIC + " "):
            return float(line.split()[1])
    return -1.0


def stranger_lease(host: str, port: int, hold_s: float, metrics: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Control(host, port, timeout_s=15.0) as conn:
        f0 = _fence_writes(metrics)
        out["stranger"] = dict(_lease_calls(conn, NodeKey.generate()))
        f1 = _fence_writes(metrics)
        member = NodeKey.generate()
        conn.call(member, c.JoinRequest(stage=1))
        out["member"] = dict(_lease_calls(conn, member))
        f2 = _fence_writes(metrics)
        conn.call(member, c.LeaveRequest())
    # each refused call the lease book sees is an audited, durable `fence` write
    out["fence_writes"] = {"stranger": f1 - f0, "member": f2 - f1} if f0 >= 0 else None
    granted = sum(out[part].get("lease.reply", 0) for part in ("stranger", "member"))
    writes = sum(out["fence_writes"].values()) if out["fence_writes"] else 0
    out["defended"] = granted == 0 and bool(out["stranger"]) and writes == 0
    out["expect"] = "no call on another key's lease succeeds, and none is an audited write"
    return out


def forged_facility(host: str, port: int, hold_s: float) -> dict[str, Any]:
    now = time.time()
    jobs = [
        FacilityJob(job_id=f"j{i}", state="running", start=now, end=now + 86_400)
        for i in range(MAX_JOBS)
    ]
    codes = []
    with Control(host, port, timeout_s=15.0) as conn:
        for i in range(FACILITIES):
            report = FacilityReport(
                facility=f"forged-{i}", scheduler="slurm", max_jobs=MAX_JOBS, walltime_s=86_400,
                jobs=jobs,
            )  # fmt: skip
            codes.append(code(conn.call(NodeKey.generate(), report)[0]))
    return {
        "codes": dict(Counter(codes)), "jobs_per_report": MAX_JOBS,
        "defended": all(x in ("unauthorized", "forbidden") for x in codes),
        "expect": "a facility report without a launcher credential is refused",
    }  # fmt: skip


def key_flood(host: str, port: int, hold_s: float) -> dict[str, Any]:
    run = learn_run(host, port)
    t = time.monotonic()
    frames = [
        signed_frame(NodeKey.generate(), c.HeartbeatRequest(), run=run) for _ in range(FLOOD_KEYS)
    ]
    made_s = time.monotonic() - t
    codes: Counter[str] = Counter()
    t = time.monotonic()
    per = len(frames) // 4
    with Control(host, port, timeout_s=30.0) as conn:
        for i in range(4):
            conn.send(b"".join(frames[i * per : (i + 1) * per]))
            codes.update(conn.read_codes(per))
    flood_s = time.monotonic() - t
    captured = signed_frame(NodeKey.generate(), c.StatusRequest(), run=run)
    with Control(host, port) as conn:
        conn.send(captured + captured)
        replay = conn.read_codes(2)
    return {
        "keys": FLOOD_KEYS, "codes": dict(codes), "signing_s": round(made_s, 2),
        "flood_s": round(flood_s, 2), "replay": replay,
        "defended": replay[-1:] == ["replay"] and sum(codes.values()) == FLOOD_KEYS,
        "expect": "every flood request answered (not_member or rate_limited); the replay refused",
    }  # fmt: skip


def _long_addr(peer_id: str, i: int) -> str:
    labels = ".".join(ch * 60 for ch in "abcd")  # a 243-character DNS name
    return f"/dns4/{labels}/tcp/{4000 + i}/p2p/{peer_id}"


def fat_member(host: str, port: int, hold_s: float) -> dict[str, Any]:
    keys = [NodeKey.generate() for _ in range(FAT_MEMBERS)]
    observer = NodeKey.generate()
    out: dict[str, Any] = {}
    with Control(host, port, timeout_s=15.0) as conn:
        conn.call(observer, c.JoinRequest(observer=True))
        before = len(encode(conn.call(observer, c.MembershipRequest())[0]))
        joins = []
        for k in keys:
            addrs = [_long_addr(k.peer_id, i) for i in range(c.MAX_ADDRS)]
            joins.append(code(conn.call(k, c.JoinRequest(addrs=addrs, stage=0))[0]))
        view, _ = conn.call(observer, c.MembershipRequest())
        after = len(encode(view))
        t0 = time.monotonic()
        while time.monotonic() - t0 < hold_s:  # stay members for the hold
            for k in [*keys, observer]:
                conn.call(k, c.HeartbeatRequest())
            time.sleep(1.0)
        for k in [*keys, observer]:
            conn.call(k, c.LeaveRequest())
    out.update(
        joins=dict(Counter(joins)), addr_chars=len(_long_addr(keys[0].peer_id, 0)),
        view_bytes_before=before, view_bytes_after=after,
        defended=after <= MEMBERSHIP_BOUND,
        expect=f"a full membership reply stays within {MEMBERSHIP_BOUND} bytes (paged or capped)",
    )  # fmt: skip
    return out


ATTACKS: dict[str, Callable[..., dict[str, Any]]] = {
    "bad_addrs": bad_addrs,
    "amplify": amplify,
    "conn_flood": conn_flood,
    "slow_drip": slow_drip,
    "stranger_lease": stranger_lease,
    "forged_facility": forged_facility,
    "key_flood": key_flood,
    "fat_member": fat_member,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m swarmlab.chaos.raw_attacks",
        description="Play one raw-socket attack on a coordinator (for agora chaos --hostile).",
    )
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--attack", required=True, choices=sorted(ATTACKS))
    p.add_argument("--hold", type=float, default=10.0, help="seconds a held attack lasts")
    p.add_argument("--json", required=True, help="write the outcome here")
    p.add_argument(
        "--coordinator-metrics", default="", metavar="HOST:PORT",
        help="the coordinator's Prometheus endpoint (stranger_lease counts fence writes)",
    )  # fmt: skip
    args = p.parse_args(argv)
    address = parse_address(args.coordinator)
    host, port = address.host, address.port
    extra = {"metrics": args.coordinator_metrics} if args.attack == "stranger_lease" else {}
    return write_outcome(
        args.json, lambda: ATTACKS[args.attack](host, int(port), args.hold, **extra), (OSError,)
    )


if __name__ == "__main__":
    sys.exit(main())
