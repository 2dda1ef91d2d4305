"""`agora bench NAME [--json FILE]`: dispatch to one benchmark module.

Every benchmark prints a human table and, with `--json FILE`, writes its results as JSON.
Report ratios measured side by side in one run; absolute times are context only.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, tuple[str, str]] = {
    "compression": ("bench.compression", "raw vs wire bytes per token, and loss cost"),
    "coordinator": ("bench.coordinator", "heartbeats/s, lease ops/s, latency, restart time"),
    "transport": ("bench.transport", "py-libp2p throughput vs raw TCP on loopback"),
    "efficiency": ("bench.efficiency", "swarm tokens/s over centralised tokens/s"),
    "convergence": ("bench.convergence", "centralised vs swarm eval loss at equal tokens"),
    "failover": ("bench.failover", "time to re-route traffic and re-issue leases"),
    "outer": ("bench.outer", "outer averaging bytes per replica and round time by group size"),
    "outer-sweep": ("bench.outer_sweep", "simulated outer-step settings and gap sources"),
    "gpu": ("bench.gpu", "one GPU: a 2-stage swarm's tokens/s, MFU and memory vs one process"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        rows = "\n".join(f"  {n:<12} {text}" for n, (_, text) in BENCHMARKS.items())
        print(f"usage: agora bench NAME [--json FILE] [options]\n\nbenchmarks:\n{rows}")
        return 0 if argv else 2
    name = argv[0]
    if name not in BENCHMARKS:
        print(
            f"agora bench: unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    try:
        module = importlib.import_module(BENCHMARKS[name][0])
    except ModuleNotFoundError as exc:
        if exc.name == BENCHMARKS[name][0]:
            print(f"agora bench {name}: not implemented yet", file=sys.stderr)
            return 2
        raise
    return int(module.main(argv[1:]) or 0)
