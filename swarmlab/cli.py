"""`agora`: the umbrella command. It owns only the table of subcommands; each lives in its
own module and is imported only when run, so `agora audit` and `agora status` work on a
torch-free coordinator install.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module:function taking argv and returning an exit code, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "swarmlab.demo:main",
        "run a local swarm (2 stages x 2 replicas) on the embedded corpus",
    ),
    "baseline": ("node.baseline:main", "train the centralised baseline every swarm is compared to"),
    "node": ("node.main:main", "run a training peer (same as agora-node)"),
    "coordinator": ("coordinator.main:main", "run the coordinator (same as agora-coordinator)"),
    "status": ("swarmlab.status:main", "show a run's stages, peers, leases and progress"),
    "audit": (
        "coordinator.audit:main",
        "reconcile the lease audit log (and an export's lineage); exit 1 on any finding",
    ),
    "tokenizer": (
        "ingest.tokenizer_cli:main",
        "train the run's BPE tokenizer: agora tokenizer train --dataset D --vocab-size N",
    ),
    "export": ("node.export:main", "assemble the trained model from live stage replicas"),
    "memory": (
        "coordinator.memory_cli:main",
        "estimate each stage's GPU memory and which 8/12/24 GB cards hold it",
    ),
    "bench": ("bench.cli:main", "run a benchmark: agora bench NAME [--json FILE]"),
    "launch": ("node.launch.cli:main", "keep agora-node jobs queued on a Slurm/PBS cluster"),
    "plan": (
        "swarmlab.plan.main:main",
        "predict a swarm (tokens/s, efficiency, rounds) by simulation; --validate checks it",
    ),
    "chaos": (
        "swarmlab.chaos.main:main",
        "inject a seeded fault schedule into a local swarm; audit",
    ),
}

USAGE = "usage: agora [-h] COMMAND [ARGS...]\n"


def _help() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items())
    return (
        USAGE
        + "\nAgora: decentralized training of one model across many volunteer machines.\n"
        + f"\ncommands:\n{rows}\n\nRun `agora COMMAND --help` for a command's options.\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(_help())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"{USAGE}agora: unknown command {name!r}; see `agora --help`", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("torch", "libp2p", "trio", "hivemind"):
            print(
                f"agora {name}: needs the node dependencies ({exc.name} is missing);"
                " install with `pip install 'agora[node]'`",
                file=sys.stderr,
            )
            return 2
        raise
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
