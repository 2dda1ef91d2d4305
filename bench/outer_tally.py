"""Every byte the outer-loop processes of a local swarm send, counted on the wire.

Each node's outer loop (its hivemind DHT and p2p daemon) listens on a fixed port and
announces the port of a counting proxy in front of it (`bench.shaping_proxy` at an
unlimited rate with no delay; node settings `outer_port` and `outer_announce`). Outer
processes learn each other's addresses only from what they announce, so every
connection between them, and every byte on it, crosses the proxy once: pseudo-gradients,
state downloads, matchmaking, DHT records, and libp2p's own framing and encryption (the
TCP payload; not the TCP/IP headers). `bypassing` lists connections that reached a real
port without the proxy; any there make the count a lower bound.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import shaping_proxy
from swarmlab.procs import free_port

UNLIMITED_MBIT = 1e6  # the proxy's rate: counting only, no shaping (Mbit/s)


@dataclass
class OuterTally:
    workdir: Path
    ports: dict[str, tuple[int, int]]  # node name -> (outer_port, announced port)
    proxy: subprocess.Popen[bytes] | None = None
    bypassed: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, workdir: Path, names: list[str]) -> OuterTally:
        """A counting proxy with a route for each node in `names` (every node the run
        will start, joiners included)."""
        tally = cls(workdir, {n: (free_port(), free_port()) for n in names})
        tally.proxy = shaping_proxy.spawn(
            workdir, "outer-tally",
            ["--rate-mbit", str(UNLIMITED_MBIT), "--delay-ms", "0",
             "--stats", str(workdir / "outer-tally.json"),
             *[f"--route={n}:{ann}={real}" for n, (real, ann) in tally.ports.items()]],
        )  # fmt: skip
        return tally

    def node_settings(self, name: str) -> dict[str, Any]:
        """Node settings that put `name`'s outer loop behind the proxy."""
        real, ann = self.ports[name]
        return {"outer_port": real, "outer_announce": [f"/ip4/127.0.0.1/tcp/{ann}"]}

    def check(self) -> None:
        """Record connections that bypass the proxy (call while the swarm runs)."""
        real = {p for p, _ in self.ports.values()}
        self.bypassed += shaping_proxy.bypassing(real, self.proxy.pid if self.proxy else None)

    def stop(self) -> dict[str, Any]:
        """Stop the proxy; the bytes it carried, both ways, over every route."""
        if self.proxy is None:
            return {"outer_wire_bytes": None, "outer_bypassing": self.bypassed}
        shaping_proxy.stop(self.proxy)
        self.proxy = None
        stats = self.workdir / "outer-tally.json"
        if not stats.exists():
            return {"outer_wire_bytes": None, "outer_bypassing": self.bypassed}
        routes = json.loads(stats.read_text())["routes"].values()
        return {
            "outer_wire_bytes": float(sum(r["bytes_in"] + r["bytes_out"] for r in routes)),
            "outer_bypassing": self.bypassed,
        }
