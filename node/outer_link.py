"""The stage process's handle on its outer-loop process (`python -m node.outer`).

`OuterLink` starts the outer process as a fresh interpreter, shares three flat fp32
buffers with it (the snapshot, theta_g and the outer momentum m) as files in /dev/shm (mapped by both with `torch.from_file(shared=True)`)
and speaks msgpack frames (`protocol.framing`) over a Unix socketpair. It never imports
hivemind (DESIGN.md section 2). One operation is in flight at a time; every wait has a
deadline. Usage from the stage's torch thread:

    link = OuterLink.start(run_id="r1", stage=0, numel=n, initial_peers=addrs)
    link.set_initial_state(params)           # first node of a run (or from a checkpoint), or
    link.fetch_state(timeout=30)             # a joiner: theta_g now in link.theta_g()
    link.begin_round(params, tokens)         # non-blocking: snapshot goes to the outer process
    ...inner steps...
    res = link.poll_result()                 # None while the round runs
    if res: link.merge_into(params)          # params = theta_g + progress since the snapshot
    link.close()

`stall_s` accumulates the seconds the caller spent inside link calls.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from node.diloco import DilocoConfig, merge_local_progress
from protocol.codec import packb, unpackb
from protocol.framing import FrameDecoder, frame

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
MAX_CONTROL_FRAME = 1 << 20  # bytes; control frames are small, tensors go through shared memory
COMPRESSIONS = ("none", "fp16", "uint8")


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """Settings of the outer-loop process."""

    compression: str = "fp16"  # pseudo-gradient wire codec: "none", "fp16" or "uint8"
    matchmaking_s: float = 3.0  # time to gather a group before a round (s)
    round_timeout_s: float = 10.0  # max time for the exchange once a group formed (s)
    request_timeout_s: float = 1.0  # matchmaking request timeout, < matchmaking_s (s)
    target_group_size: int = 8  # largest group of replicas averaged at once (peers)
    host: str = "127.0.0.1"  # DHT listen address (IP)
    port: int = 0  # DHT listen port; 0 = chosen by the OS
    startup_timeout_s: float = 90.0  # max time for the outer process to start its DHT (s)
    state_timeout_s: float = 20.0  # max time to download state from a live replica (s)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if not 0.0 < self.request_timeout_s < self.matchmaking_s:
            raise ValueError(
                f"request_timeout_s ({self.request_timeout_s}) must be in (0, matchmaking_s = "
                f"{self.matchmaking_s})"
            )
        for name in ("round_timeout_s", "startup_timeout_s", "state_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.target_group_size < 1 or not 0 <= self.port < 65536:
            raise ValueError(f"bad target_group_size {self.target_group_size} or port {self.port}")

    def to_wire(self) -> dict[str, Any]:
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "diloco"
        }
        out["diloco"] = {
            f.name: getattr(self.diloco, f.name) for f in dataclasses.fields(self.diloco)
        }
        return out

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> OuterConfig:
        """From a plain dict (a TOML table or a control frame); unknown keys are an error."""
        d = dict(d)
        diloco = DilocoConfig(**d.pop("diloco", {}))
        return cls(diloco=diloco, **d)


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What an outer round produced; the new theta_g is in `OuterLink.theta_g()`."""

    round: int  # outer steps in the global state after this round
    applied: bool  # whether this replica's global state changed
    rebased: bool  # whether the state was downloaded from a more advanced replica
    group_size: int  # replicas whose contributions were averaged (1 when alone)
    tokens: int  # tokens behind the averaged pseudo-gradient
    eta_r: float  # outer learning rate used
    bytes_out: int  # pseudo-gradient bytes this replica sent (wire)
    bytes_in: int  # pseudo-gradient bytes it received (wire)
    raw_bytes: int  # fp32 size of one pseudo-gradient
    seconds: float  # wall time of the round in the outer process
    rejected: dict[str, str]  # peer -> reason for contributions left out
    digest: str  # blake2b of (round, theta_g, m): equal digests mean bitwise-equal states


class OuterLinkError(RuntimeError):
    pass


class OuterLink:
    """See the module docstring. Build with `OuterLink.start(...)`."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        snap: Path,
        result: Path,
        momentum: Path,
        numel: int,
    ) -> None:
        self._proc = proc
        self._sock = sock
        self._decoder = FrameDecoder(max_frame=MAX_CONTROL_FRAME)
        self._inbox: list[dict[str, Any]] = []
        self._paths = (snap, result, momentum)
        self._snap = torch.from_file(str(snap), shared=True, size=numel, dtype=torch.float32)
        self._result = torch.from_file(str(result), shared=True, size=numel, dtype=torch.float32)
        self._m = torch.from_file(str(momentum), shared=True, size=numel, dtype=torch.float32)
        self.numel = numel
        self._pending: str | None = None  # op in flight
        self._ready: dict[str, Any] = {}
        self.stall_s = 0.0  # seconds callers spent blocked in link calls
        self.round = 0
        self._state_timeout = OuterConfig().state_timeout_s  # s, replaced by start()
        self.digest = ""  # digest of the outer process's state after the last operation

    @classmethod
    def start(
        cls,
        *,
        run_id: str,
        stage: int,
        numel: int,
        initial_peers: Sequence[str] = (),
        config: OuterConfig | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> OuterLink:
        """Start the outer process for `stage` of `run_id`, waiting (up to
        `config.startup_timeout_s`) until its DHT is up."""
        cfg = config or OuterConfig()
        if numel <= 0:
            raise ValueError(f"numel must be > 0, got {numel}")
        tag = f"agora-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        snap, result = SHM_DIR / f"{tag}-snap", SHM_DIR / f"{tag}-result"
        momentum = SHM_DIR / f"{tag}-m"
        for p in (snap, result, momentum):
            with open(p, "wb") as fh:
                fh.truncate(numel * 4)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [python, "-m", "node.outer", "--fd", str(theirs.fileno())]
        try:
            proc = subprocess.Popen(  # own process group: hivemind's helpers follow its signals
                cmd,
                pass_fds=[theirs.fileno()],
                env=child_env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            ours.close()
            for p in (snap, result, momentum):
                p.unlink(missing_ok=True)
            raise
        finally:
            theirs.close()
        link = cls(proc, ours, snap, result, momentum, numel)
        try:
            link._send(
                {
                    "op": "init",
                    "run_id": run_id,
                    "stage": stage,
                    "numel": numel,
                    "initial_peers": list(initial_peers),
                    "snap": str(snap),
                    "result": str(result),
                    "momentum": str(momentum),
                    "config": cfg.to_wire(),
                }
            )
            link._ready = link._wait("ready", cfg.startup_timeout_s)
        except BaseException:
            link.close(timeout=5.0)
            raise
        link._state_timeout = cfg.state_timeout_s
        return link

    # ---- public API ------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._proc.pid

    def dht_addrs(self) -> list[str]:
        """Multiaddrs other nodes can bootstrap their DHT from (advertise via the coordinator)."""
        return list(self._ready.get("addrs", []))

    def set_initial_state(
        self,
        params: Sequence[torch.Tensor],
        timeout: float = 30.0,
        *,
        momentum: torch.Tensor | None = None,
        round_: int = 0,
    ) -> None:
        """Make `params` the global state (the first replica of a stage): at round 0 with
        zero momentum, or at `round_` with the flat `momentum` of a checkpoint."""
        self._require_idle()
        if round_ < 0:
            raise ValueError(f"round_ must be >= 0, got {round_}")
        t0 = time.monotonic()
        self._copy_in(params)
        if momentum is not None:
            if momentum.numel() != self.numel:
                raise ValueError(
                    f"momentum holds {momentum.numel()} elements, the link {self.numel}"
                )
            self._m.copy_(momentum.detach().flatten())
        self._send({"op": "set_state", "round": round_, "momentum": momentum is not None})
        self.digest = str(self._wait("state_set", timeout)["digest"])
        self.round = round_
        self.stall_s += time.monotonic() - t0

    def fetch_state(self, timeout: float | None = None) -> int | None:
        """Download (theta_g, m, round) from a live replica into the outer process; theta_g is
        then in `theta_g()`. Returns the round, or None when no replica answered."""
        self._require_idle()
        t0 = time.monotonic()
        limit = self._state_timeout if timeout is None else timeout
        self._send({"op": "fetch", "timeout": limit})
        reply = self._wait("state", limit + 10.0)
        self.stall_s += time.monotonic() - t0
        if not reply["ok"]:
            return None
        self.round = int(reply["round"])
        self.digest = str(reply["digest"])
        return self.round

    def begin_round(
        self, params: Sequence[torch.Tensor], tokens: int, target_tokens: int | None = None
    ) -> None:
        """Hand the working copy (as it is now) and the tokens trained since the last
        theta_g to the outer process, which runs the round in the background.
        `target_tokens` (a full round's tokens over the stage's replicas) replaces
        `DilocoConfig.target_tokens` from this round on; None keeps it."""
        self._require_idle()
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        t0 = time.monotonic()
        self._copy_in(params)
        cmd: dict[str, Any] = {"op": "begin", "tokens": int(tokens)}
        if target_tokens is not None:
            if target_tokens < 0:
                raise ValueError(f"target_tokens must be >= 0, got {target_tokens}")
            cmd["target_tokens"] = int(target_tokens)
        self._send(cmd)
        self._pending = "result"
        self.stall_s += time.monotonic() - t0

    def poll_result(self) -> RoundResult | None:
        """The finished round, or None while it runs. Never blocks."""
        t0 = time.monotonic()
        try:
            if self._pending != "result":
                return None
            self._pump(0.0)
            reply = self._take("result")
            return None if reply is None else self._result_of(reply)
        finally:
            self.stall_s += time.monotonic() - t0

    def wait_result(self, timeout: float) -> RoundResult:
        """Block until the round in flight finishes (tests, draining)."""
        if self._pending != "result":
            raise OuterLinkError("no round in flight")
        return self._result_of(self._wait("result", timeout))

    def theta_g(self) -> torch.Tensor:
        """The newest theta_g (flat fp32 view, valid until the next operation)."""
        return self._result

    def momentum(self) -> torch.Tensor:
        """The outer momentum m of the newest state (flat fp32 view, valid until the next
        operation)."""
        return self._m

    def merge_into(self, params: Sequence[torch.Tensor]) -> None:
        """Overlap merge after a round: params = theta_g + (params - snapshot)."""
        t0 = time.monotonic()
        merge_local_progress(params, self._snap, self._result)
        self.stall_s += time.monotonic() - t0

    def load_into(self, params: Sequence[torch.Tensor]) -> None:
        """Overwrite params with theta_g (after `fetch_state`)."""
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p.copy_(self._result[offset : offset + n].view_as(p))
                offset += n
        if offset != self.numel:
            raise ValueError(f"params hold {offset} elements, the link {self.numel}")

    def close(self, timeout: float = 10.0) -> None:
        """Ask the outer process to leave its group and exit; kill it past `timeout`."""
        try:
            if self._proc.poll() is None:
                try:
                    self._send({"op": "stop"})
                except OSError:
                    pass
                try:
                    self._proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "outer process %d did not stop in %.0fs; killing it", self.pid, timeout
                    )
                    self._proc.kill()
                    self._proc.wait(timeout=timeout)
        finally:
            self._sock.close()
            for path in self._paths:
                path.unlink(missing_ok=True)

    # ---- internals -------------------------------------------------------------------

    def _require_idle(self) -> None:
        if self._pending is not None:
            raise OuterLinkError(f"an operation is in flight (waiting for {self._pending!r})")

    def _copy_in(self, params: Sequence[torch.Tensor]) -> None:
        offset = 0
        for p in params:
            n = p.numel()
            if offset + n > self.numel:
                raise ValueError(f"params hold more than the link's {self.numel} elements")
            self._snap[offset : offset + n].copy_(p.detach().flatten())
            offset += n
        if offset != self.numel:
            raise ValueError(f"params hold {offset} elements, the link {self.numel}")

    def _result_of(self, reply: dict[str, Any]) -> RoundResult:
        self._pending = None
        if reply.get("error"):
            raise OuterLinkError(f"outer round failed: {reply['error']}")
        self.round = int(reply["round"])
        self.digest = str(reply["digest"])
        fields = {f.name for f in dataclasses.fields(RoundResult)}
        return RoundResult(**{k: v for k, v in reply.items() if k in fields})

    def _send(self, obj: dict[str, Any]) -> None:
        self._sock.sendall(frame(packb(obj), max_frame=MAX_CONTROL_FRAME))

    def _pump(self, timeout: float) -> None:
        ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        if not ready:
            return
        data = self._sock.recv(1 << 16)
        if not data:
            raise OuterLinkError(
                f"outer process {self.pid} closed the link (exit code {self._proc.poll()})"
            )
        for payload in self._decoder.feed(data):
            msg = unpackb(payload, max_size=MAX_CONTROL_FRAME)
            if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
                raise OuterLinkError(
                    f"malformed control frame from the outer process: {msg!r:.200}"
                )
            self._inbox.append(msg)

    def _take(self, op: str) -> dict[str, Any] | None:
        for i, msg in enumerate(self._inbox):
            if msg["op"] == op:
                return self._inbox.pop(i)
            if msg["op"] == "fatal":
                raise OuterLinkError(f"outer process failed: {msg.get('error')}")
        return None

    def _wait(self, op: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            got = self._take(op)
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {op!r} reply from the outer process within {timeout:.1f}s")
            if self._proc.poll() is not None and not select.select([self._sock], [], [], 0)[0]:
                raise OuterLinkError(f"outer process exited with code {self._proc.returncode}")
            self._pump(min(left, 0.5))
