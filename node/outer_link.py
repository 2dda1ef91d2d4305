"""The stage process's handle on its outer-loop process (`python -m node.outer`).

`OuterLink` starts the outer process as a fresh interpreter, shares three flat fp32
buffers with it (the snapshot, theta_g and the outer momentum m) as files in /dev/shm,
mapped by both with `torch.from_file(shared=True)`, and exchanges the typed commands and
replies of `node.outer.contract` with it over a Unix socketpair. It never imports hivemind,
which cannot share a process with py-libp2p. One operation is in flight at a time; every
wait has a deadline. Usage from the stage's torch thread:

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

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import torch

from node.diloco import merge_local_progress
from node.outer.contract import (
    COMPRESSIONS,
    MAX_CONTROL_FRAME,
    Begin,
    Command,
    Fatal,
    Fetch,
    Init,
    OuterConfig,
    Peek,
    Peeked,
    Ready,
    Reply,
    RoundFailed,
    RoundResult,
    SetState,
    StateFetched,
    StateSet,
    Stop,
    decode_reply,
    encode,
)
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder
from protocol.identity import libp2p_peer_id
from protocol.lineage import Link

__all__ = [
    "COMPRESSIONS",
    "MAX_CONTROL_FRAME",
    "SHM_DIR",
    "OuterConfig",
    "OuterLink",
    "OuterLinkError",
    "RoundResult",
]

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_R = TypeVar("_R", bound=Reply)


class OuterLinkError(RuntimeError):
    pass


def _create_private(path: Path, size: int) -> None:
    """A new file of `size` bytes that only this user can read: never an existing file
    or a link someone else planted under the name (/dev/shm is shared by every user)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


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
        self._inbox: list[Reply] = []
        self._paths = (snap, result, momentum)
        self._snap = torch.from_file(str(snap), shared=True, size=numel, dtype=torch.float32)
        self._result = torch.from_file(str(result), shared=True, size=numel, dtype=torch.float32)
        self._m = torch.from_file(str(momentum), shared=True, size=numel, dtype=torch.float32)
        self.numel = numel
        self._pending: str | None = None  # the reply awaited by the operation in flight
        self._ready = Ready(addrs=[], peer_id="")
        self.stall_s = 0.0  # seconds callers spent blocked in link calls
        self.round = 0
        self.state_timeout_s = OuterConfig().state_timeout_s  # s, set by start()
        self.transfer_s = OuterConfig().transfer_s(numel)  # s on top for a state's bytes
        self.digest = ""  # digest of the outer process's state after the last operation
        self.lineage: list[Link] = []  # that state's chain, ending with it (protocol.lineage)

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
        entry: Sequence[str] | None = None,
        identity: bytes = b"",
    ) -> OuterLink:
        """Start the outer process for `stage` of `run_id`, waiting (up to
        `config.startup_timeout_s`) until its DHT is up. `entry` is what follows the
        interpreter on its command line (default `config.program`; a rogue outer process
        in chaos tools and tests).
        `identity` (`NodeKey.libp2p_private_key`) is the key its DHT runs under, so its
        peer id is the node's; b"" gives it a fresh one."""
        cfg = config or OuterConfig()
        if numel <= 0:
            raise ValueError(f"numel must be > 0, got {numel}")
        tag = f"agora-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        snap, result = SHM_DIR / f"{tag}-snap", SHM_DIR / f"{tag}-result"
        momentum = SHM_DIR / f"{tag}-m"
        for p in (snap, result, momentum):
            _create_private(p, numel * 4)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [python, *(cfg.program if entry is None else entry), "--fd", str(theirs.fileno())]
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
                Init(
                    run_id=run_id,
                    stage=stage,
                    numel=numel,
                    initial_peers=list(initial_peers),
                    snap=str(snap),
                    result=str(result),
                    momentum=str(momentum),
                    config=cfg,
                    identity=identity,
                )
            )
            link._ready = link._expect(Ready, cfg.startup_timeout_s)
            if identity and link._ready.peer_id != libp2p_peer_id(identity):
                raise OuterLinkError(
                    f"the outer process runs as {link._ready.peer_id}, not as the node's key "
                    f"{libp2p_peer_id(identity)}"
                )
        except BaseException:
            link.close(timeout=5.0)
            raise
        link.state_timeout_s = cfg.state_timeout_s
        link.transfer_s = cfg.transfer_s(numel)
        return link

    # ---- public API ------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def peer_id(self) -> str:
        """The outer process's DHT peer id (base58)."""
        return self._ready.peer_id

    def dht_addrs(self) -> list[str]:
        """Multiaddrs other nodes can bootstrap their DHT from (advertise via the coordinator)."""
        return list(self._ready.addrs)

    def set_initial_state(
        self,
        params: Sequence[torch.Tensor],
        timeout: float = 30.0,
        *,
        momentum: torch.Tensor | None = None,
        round_: int = 0,
        lineage: Sequence[Link] = (),
        members: Sequence[str] | None = None,
    ) -> None:
        """Make `params` the global state (the first replica of a stage): at round 0 with
        zero momentum, or at `round_` with the flat `momentum` of a checkpoint. With
        `members` (peer ids: the stage's as the coordinator lists them) the stage's DHT
        records of anyone else are refused from now on, as after `fetch_state`."""
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
        self._send(
            SetState(
                round=round_, momentum=momentum is not None, lineage=list(lineage),
                members=None if members is None else list(members),
            )
        )  # fmt: skip
        got = self._expect(StateSet, timeout)
        self.digest, self.lineage = got.digest, got.lineage
        self.round = round_
        self.stall_s += time.monotonic() - t0

    def fetch_state(
        self,
        timeout: float | None = None,
        attested: tuple[int, str] | None = None,
        members: Sequence[str] | None = None,
    ) -> int | None:
        """Download (theta_g, m, round) from a live replica into the outer process; theta_g is
        then in `theta_g()`. With `attested` (the stage's attested (round, digest)) only
        that state is taken. With `members` (peer ids: the stage's as the coordinator lists
        them) only those serve it, and from then on the outer process's DHT believes the
        stage's records of those only, as after a round's `begin_round`. Returns the
        round, or None when no replica served one."""
        self._require_idle()
        t0 = time.monotonic()
        limit = self.state_timeout_s if timeout is None else timeout
        listed = None if members is None else list(members)
        self._send(Fetch(timeout_s=limit, attested=attested, members=listed))
        reply = self._expect(StateFetched, limit + self.transfer_s + 10.0)
        self.stall_s += time.monotonic() - t0
        if not reply.ok:
            return None
        self.round = reply.round
        self.digest = reply.digest
        self.lineage = reply.lineage
        return self.round

    def peers_waiting(self, timeout: float = 10.0) -> int:
        """Other replicas of the stage looking for a group right now (between rounds; a
        DHT read in the outer process, a few ms)."""
        self._require_idle()
        self._send(Peek())
        return self._expect(Peeked, timeout).waiting

    def begin_round(
        self,
        params: Sequence[torch.Tensor],
        tokens: int,
        target_tokens: int | None = None,
        attested: tuple[int, str] | None = None,
        members: Sequence[str] | None = None,
        credit: bytes = b"",
    ) -> None:
        """Hand the working copy (as it is now) and the tokens trained since the last
        theta_g to the outer process, which runs the round in the background.
        `target_tokens` (a full round's tokens over the stage's replicas) replaces
        `DilocoConfig.target_tokens` from this round on; None keeps it. `attested` is the
        stage's attested (round, digest): the round first rebases onto that state when it
        is newer than the one held (and onto no other). `members` (peer ids) are the
        stage's replicas as the coordinator lists them: the round admits no other peer
        to its group; None admits any. `credit` is this replica's signed credit from the
        coordinator (`protocol.credit`; b"": none), which it shows its groupmates."""
        self._require_idle()
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        t0 = time.monotonic()
        self._copy_in(params)
        if target_tokens is not None and target_tokens < 0:
            raise ValueError(f"target_tokens must be >= 0, got {target_tokens}")
        target = None if target_tokens is None else int(target_tokens)
        listed = None if members is None else list(members)
        self._send(
            Begin(
                tokens=int(tokens),
                target_tokens=target,
                attested=attested,
                members=listed,
                credit=bytes(credit),
            )  # fmt: skip
        )
        self._pending = RoundResult.OP
        self.stall_s += time.monotonic() - t0

    def poll_result(self) -> RoundResult | None:
        """The finished round, or None while it runs. Never blocks."""
        t0 = time.monotonic()
        try:
            if self._pending != RoundResult.OP:
                return None
            self._pump(0.0)
            reply = self._take((RoundResult, RoundFailed))
            return None if reply is None else self._result_of(reply)
        finally:
            self.stall_s += time.monotonic() - t0

    def wait_result(self, timeout: float) -> RoundResult:
        """Block until the round in flight finishes (tests, draining)."""
        if self._pending != RoundResult.OP:
            raise OuterLinkError("no round in flight")
        return self._result_of(self._wait((RoundResult, RoundFailed), timeout))

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
        """Ask the outer process to leave its group and exit; past `timeout`, kill its
        process group (it leads one: its hivemind DHT and averager processes and their
        p2p daemons would outlive a kill of the process alone)."""
        try:
            if self._proc.poll() is None:
                try:
                    self._send(Stop())
                except OSError:
                    pass
                try:
                    self._proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.warning(
                        "outer process %d did not stop in %.0fs; killing it", self.pid, timeout
                    )
                    try:
                        os.killpg(self.pid, signal.SIGKILL)
                    except ProcessLookupError:  # no group of that id (or gone): the process
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

    def _result_of(self, reply: Reply) -> RoundResult:
        self._pending = None
        if isinstance(reply, RoundFailed):
            raise OuterLinkError(f"outer round failed: {reply.error}")
        if not isinstance(reply, RoundResult):
            raise OuterLinkError(f"expected a round result, got {reply!r:.200}")
        self.round = reply.round
        self.digest = reply.digest
        self.lineage = reply.lineage
        return reply

    def _send(self, cmd: Command) -> None:
        try:
            frame = encode(cmd)
        except ProtocolError as exc:  # an argument outside what the contract carries
            raise ValueError(str(exc)) from exc
        self._sock.sendall(frame)

    def _pump(self, timeout: float) -> None:
        ready, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        if not ready:
            return
        data = self._sock.recv(1 << 16)
        if not data:
            raise OuterLinkError(
                f"outer process {self.pid} closed the link (exit code {self._proc.poll()})"
            )
        try:
            self._inbox.extend(decode_reply(p) for p in self._decoder.feed(data))
        except ProtocolError as exc:
            # The reply awaited was (most likely) the one that failed: the operation is
            # over, so the link takes the next command instead of waiting for it forever.
            self._pending = None
            raise OuterLinkError(f"malformed control frame from the outer process: {exc}") from exc

    def _take(self, kinds: tuple[type, ...]) -> Reply | None:
        for i, msg in enumerate(self._inbox):
            if isinstance(msg, kinds):
                return self._inbox.pop(i)
            if isinstance(msg, Fatal):
                raise OuterLinkError(f"outer process failed: {msg.error}")
        return None

    def _expect(self, kind: type[_R], timeout: float) -> _R:
        reply = self._wait((kind,), timeout)
        assert isinstance(reply, kind)
        return reply

    def _wait(self, kinds: tuple[type, ...], timeout: float) -> Reply:
        deadline = time.monotonic() + timeout
        while True:
            got = self._take(kinds)
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                names = " or ".join(k.__name__ for k in kinds)
                raise TimeoutError(f"no {names} reply from the outer process within {timeout:.1f}s")
            if self._proc.poll() is not None and not select.select([self._sock], [], [], 0)[0]:
                raise OuterLinkError(f"outer process exited with code {self._proc.returncode}")
            self._pump(min(left, 0.5))
