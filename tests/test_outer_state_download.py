"""State downloads of the outer process from hostile replicas: a real hivemind replica of
the stage, in its own interpreter, shares a wrong-shaped or oversized state at a higher
priority than the honest one; the joiner refuses it, adopts the honest state and lives.

The pytest process never imports hivemind: the rogue replica and the stream-reader check
run in fresh interpreters, the joiner is an `OuterLink`.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
import torch

from node.diloco import DilocoConfig
from node.outer_link import OuterConfig, OuterLink
from swarmlab.procs import wait_for

N = 4096  # parameters of the stage
ROGUE_ROUND = 99  # the rogue's sharing priority: above the honest replica's round 0
CFG = OuterConfig(
    matchmaking_s=2.0, request_timeout_s=0.5, round_timeout_s=4.0, state_timeout_s=10.0,
    diloco=DilocoConfig(eta=0.7, mu=0.9, target_tokens=400),
)  # fmt: skip

# A replica of stage 0 of the run, sharing a hostile state at priority ROGUE_ROUND:
# "momentum": theta of the right size, m of N + 7; "oversized": a theta header of the
# right size followed by 8 MiB of parts. Prints "ready" once the DHT lists it.
ROGUE = """
import sys, time, torch
from typing import AsyncIterator
from hivemind import DHT
from hivemind.p2p import P2PContext
from hivemind.compression import CompressionInfo, NoCompression
from hivemind.proto import averaging_pb2
from hivemind.utils.streaming import split_for_streaming
from node.diloco import DilocoConfig
from node.outer.averager import StageAverager as Honest
from node.outer.dht_records import MemberRecords
from node.outer.lifecycle import identity_file
from node.outer.wire import compression
from protocol.identity import NodeKey

run, mode, n, rnd = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
peers = sys.argv[5:]
prefix = f"agora-{run}-stage0"

def state():
    m = torch.zeros(n + 7 if mode == "momentum" else n)
    return {"round": rnd, "digest": "rogue"}, [torch.full((n,), 5.0), m]

class StageAverager(Honest):  # the class name is part of hivemind's rpc protocol ids
    _rpc_handlers = None
    _stub_type = None

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if mode != "oversized":
            async for msg in super().rpc_download_state(request, context):
                yield msg
            return
        meta, tensors = state()
        t = tensors[0]
        [head, *_] = split_for_streaming(
            NoCompression().compress(t, CompressionInfo.from_tensor(t), allow_inplace=False))
        yield averaging_pb2.DownloadData(tensor_part=head, metadata=self.serializer.dumps(meta))
        for _ in range(128):  # 8 MiB more under the same header
            yield averaging_pb2.DownloadData(
                tensor_part=type(head)(buffer=bytes(64 * 1024)))

key = NodeKey.generate()  # signs its DHT records (the joiner, with no member list yet,
records = MemberRecords(key)  # takes any correctly signed record: node.outer.dht_records)
with identity_file(key.libp2p_private_key()) as path:
    dht = DHT(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=path,
              check_if_identity_free=False, record_validators=[records], start=True,
              await_ready=True)
av = StageAverager(torch.zeros(n), dht, prefix=prefix, wire_compression=compression("none"),
           diloco=DilocoConfig(), exchange_timeout=4.0, state_provider=state,
           target_group_size=4, min_group_size=2, allow_state_sharing=True,
           declare_state_period=1.0, shutdown_timeout=3.0)
av.state_sharing_priority = float(rnd)
av.run_in_background(await_ready=True, timeout=60)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    found = dht.get(prefix + ".all_averagers", latest=True)
    if found is not None and any(v.value == rnd for v in found.value.values()):
        break
    time.sleep(0.2)
else:
    sys.exit("rogue never saw its own declaration")
print("ready", flush=True)
sys.stdin.read()
av.shutdown()
dht.shutdown()
"""


@pytest.fixture
def procs() -> Iterator[tuple[list[OuterLink], list[subprocess.Popen[str]]]]:
    links: list[OuterLink] = []
    rogues: list[subprocess.Popen[str]] = []
    yield links, rogues
    for link in links:
        link.close(timeout=10.0)
    for p in rogues:
        if p.stdin is not None:
            p.stdin.close()
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["momentum", "oversized"])
def test_a_hostile_state_is_refused_and_the_honest_one_adopted(
    procs: tuple[list[OuterLink], list[subprocess.Popen[str]]],
    child_env: dict[str, str],
    mode: str,
) -> None:
    links, rogues = procs
    run = uuid.uuid4().hex[:8]
    honest = OuterLink.start(run_id=run, stage=0, numel=N, initial_peers=[], config=CFG,
                             env=child_env)  # fmt: skip
    links.append(honest)
    theta = [torch.randn(N // 2), torch.randn(N // 2)]
    honest.set_initial_state(theta)
    rogue = subprocess.Popen(
        [sys.executable, "-c", ROGUE, run, mode, str(N), str(ROGUE_ROUND), *honest.dht_addrs()],
        env=child_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    rogues.append(rogue)
    assert rogue.stdout is not None
    line = wait_for(lambda: rogue.stdout.readline() or rogue.poll() is not None, "rogue", 120)
    assert line == "ready\n", f"rogue exited with {rogue.poll()}"

    joiner = OuterLink.start(run_id=run, stage=0, numel=N, initial_peers=honest.dht_addrs(),
                             config=CFG, env=child_env)  # fmt: skip
    links.append(joiner)
    # the rogue is asked first (priority 99 against 0), refused, and the honest one adopted
    assert joiner.fetch_state(timeout=20) == 0
    assert joiner.digest == honest.digest
    got = [torch.empty(N // 2), torch.empty(N // 2)]
    joiner.load_into(got)
    assert all(torch.equal(x, y) for x, y in zip(got, theta, strict=True))
    assert joiner.fetch_state(timeout=10) == 0  # the outer process is alive and answers


def test_the_reader_stops_at_the_byte_cap_and_checks_headers(child_env: dict[str, str]) -> None:
    """StateDownload on hand-made streams (in a fresh interpreter: it imports hivemind)."""
    code = """
import torch
from hivemind.compression import CompressionInfo, Float16Compression, NoCompression
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.streaming import split_for_streaming
from node.outer.state_download import StateDownload, expected_bytes

n = 1000
def stream(tensors, codec=NoCompression(), meta={"round": 3}):
    out = []
    for t in tensors:
        out += split_for_streaming(codec.compress(t, CompressionInfo.from_tensor(t), False), 512)
    msgs = [averaging_pb2.DownloadData(tensor_part=p) for p in out]
    msgs[0].metadata = MSGPackSerializer.dumps(meta)
    return msgs

def read(msgs):
    r = StateDownload(n)
    try:
        for m in msgs:
            r.feed(m)
        return r.result()
    except ValueError as exc:
        return f"refused after {r.received} bytes: {exc}"

meta, (theta, m) = read(stream([torch.ones(n), torch.zeros(n)]))
assert meta["round"] == 3 and theta.shape == (n,) and m.shape == (n,)
for bad, why in [
    (stream([torch.ones(n), torch.zeros(n + 1)]), "expected float32"),
    (stream([torch.ones(n)]), "1 tensors"),
    (stream([torch.ones(n)] * 3), "more than 2 tensors"),
    (stream([torch.ones(n), torch.zeros(n)], Float16Compression()), "compressed"),
    (stream([torch.ones(n), torch.full((n,), float("nan"))]), "NaN"),
    (stream([torch.ones(n), torch.zeros(n)], meta={"round": "x"}), "without a round"),
]:
    got = read(bad)
    assert isinstance(got, str) and why in got, (why, got)
# the right header, then far more bytes than it declares: stops within one part of the cap
head = stream([torch.ones(n)])[0]
filler = averaging_pb2.DownloadData(tensor_part=type(head.tensor_part)(buffer=bytes(4096)))
got = read([head] + [filler] * 10_000)
cap = expected_bytes(n)
assert got.startswith("refused after") and int(got.split()[2]) <= cap + 4200, got
# the rate floor: after the grace, fewer bytes than the floor's average are refused
r = StateDownload(n)
r.feed(head)
r.check_rate(elapsed_s=10.0, min_bytes_per_s=1e6, grace_s=10.0)  # within the grace
try:
    r.check_rate(elapsed_s=12.0, min_bytes_per_s=1e6, grace_s=10.0)  # 2 MB owed
    raise AssertionError("a drip-feeding source was not refused")
except ValueError as exc:
    assert "slower than 1 MB/s" in str(exc), exc
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
