"""`agora-coordinator --relay`: a circuit-relay v2 hop as a child process.

The coordinator never imports libp2p, torch or `node`, so the relay runs as
`python -m node.p2p.relay_main` beside it. This module starts it, reads the multiaddr it
prints, forwards its output to the log, and stops it with the coordinator.

Naming a `node` module here is the one deliberate exception to "coordinator and node
never depend on each other": the coordinator runs it as a separate interpreter and only
reads its stdout. `--relay` therefore needs the node extra installed (`agora[node]`, for
libp2p and trio); the coordinator's own closure stays free of it.

The relay serves the run's live members only: `follow` writes their peer ids to the
child's stdin (`members ID ID ...`, one line per membership change, at most one line per
interval), and the child drops everyone else's reservations.
tests/test_layering.py lists this module string as the single allowed crossing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

READY_PREFIX = "agora-relay at "
WRITE_TIMEOUT_S = 30.0  # seconds a membership line may take to reach the child


class RelayStartError(RuntimeError):
    """The relay child exited or stayed silent instead of serving."""


class RelayChild:
    """A running `python -m node.p2p.relay_main`; `addrs` are the multiaddrs it printed."""

    def __init__(self, proc: asyncio.subprocess.Process, addrs: list[str]) -> None:
        self.proc = proc
        self.addrs = addrs
        self._drain: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        *,
        host: str,
        port: int,
        identity: Path,
        announce: str | None = None,
        limits: dict[str, float] | None = None,
        timeout_s: float = 60.0,
    ) -> RelayChild:
        """Start the relay listening on host:port; `RelayStartError` if it does not serve.
        `limits`: relay_main flags without the dashes (circuit-bytes, circuit-duration,
        reservation-ttl) and their values."""
        try:
            version = ipaddress.ip_address(host).version
        except ValueError:
            raise ValueError(f"--relay needs an IP listen address, got host {host!r}") from None
        args = [
            "-m", "node.p2p.relay_main",
            "--listen", f"/ip{version}/{host}/tcp/{port}",
            "--identity", str(identity),
            *(["--announce", announce] if announce else []),
            *[f"--{k}={v}" for k, v in (limits or {}).items()],
            "--members-on-stdin",  # and it goes when we go, even after a SIGKILL of ours
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches us; we stop it in order
        )
        assert proc.stdout is not None
        addrs: list[str] = []
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = (await proc.stdout.readline()).decode(errors="replace")
                    if not line:
                        code = await proc.wait()
                        raise RelayStartError(f"the relay child exited with {code} before serving")
                    if line.startswith(READY_PREFIX):
                        addrs.append(line[len(READY_PREFIX) :].strip())
                        # the relay prints all its addresses back to back; take what is there
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(0.2):
                                while (more := await proc.stdout.readline()).startswith(
                                    READY_PREFIX.encode()
                                ):
                                    addrs.append(more.decode()[len(READY_PREFIX) :].strip())
                        break
        except BaseException as exc:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if isinstance(exc, TimeoutError):
                raise RelayStartError(
                    f"the relay child did not serve within {timeout_s:g} s"
                ) from None
            raise
        child = cls(proc, addrs)
        child._drain = asyncio.create_task(child._forward_output())
        log.info("relay: circuit-relay v2 hop (pid %d) at %s", proc.pid, " ".join(addrs))
        return child

    async def follow(self, members: Callable[[], tuple[int, list[str]]], interval_s: float) -> None:
        """Write the live members to the child whenever `members()` (version, peer ids)
        has a new version; runs until cancelled or the child's stdin breaks."""
        stdin = self.proc.stdin
        assert stdin is not None
        sent = None
        while True:
            version, ids = members()
            if version != sent:
                stdin.write(("members " + " ".join(ids) + "\n").encode())
                try:
                    async with asyncio.timeout(WRITE_TIMEOUT_S):
                        await stdin.drain()
                except (ConnectionError, TimeoutError) as exc:
                    log.error("relay: cannot send the membership to the child: %r", exc)
                    return
                sent = version
            await asyncio.sleep(interval_s)

    async def _forward_output(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            log.info("relay: %s", line.decode(errors="replace").rstrip())

    async def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL past `timeout_s`; returns the exit code."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(timeout_s):
                    await self.proc.wait()
            except TimeoutError:
                log.warning("relay: no exit %g s after SIGTERM; killing it", timeout_s)
                self.proc.kill()
                await self.proc.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
        code = self.proc.returncode
        log.info("relay: stopped (exit %s)", code)
        return code if code is not None else -1
