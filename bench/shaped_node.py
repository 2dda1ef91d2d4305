"""`agora-node` behind a shaping proxy, for `agora bench efficiency`.

The node listens on the port given by `--listen` as usual, but announces to the run
(its join addresses, hence every peer's membership view) the port of a shaping proxy
in front of it, so every peer reaches it through the emulated link. The mapping comes
from `AGORA_ANNOUNCE_PORTS="REAL=ANNOUNCED[,REAL=ANNOUNCED...]"`. Everything else is
`node.main` unchanged: `python -m bench.shaped_node --coordinator ... --listen ...`.
"""

from __future__ import annotations

import os
import re
import sys

from node.p2p import host


def _announce_map() -> dict[str, str]:
    spec = os.environ.get("AGORA_ANNOUNCE_PORTS", "")
    pairs = [p.split("=", 1) for p in spec.split(",") if p]
    return {real: announced for real, announced in pairs}


def _patch(mapping: dict[str, str]) -> None:
    real_addrs = host.Libp2pTransport.listen_addrs.fget  # type: ignore[attr-defined]

    def announced(self: host.Libp2pTransport) -> list[str]:
        return [
            re.sub(r"/tcp/(\d+)", lambda m: f"/tcp/{mapping.get(m.group(1), m.group(1))}", a)
            for a in real_addrs(self)
        ]

    host.Libp2pTransport.listen_addrs = property(announced)  # type: ignore[assignment,method-assign]


def main() -> int:
    _patch(_announce_map())
    from node.main import main as node_main

    return node_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
