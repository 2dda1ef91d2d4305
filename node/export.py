"""`agora export`: the command that assembles the full model and writes the export format.

`agora export --checkpoints DIR [DIR ...] --out OUT` assembles it from stage checkpoint
files (node.export_assembly: one run, every stage, the newest round of each) and writes
`OUT/model.safetensors` + `OUT/config.json` (node.model's export format).
`agora baseline --init OUT --eval-only` then evaluates it on the held-out set.

`agora export --coordinator HOST:PORT --out OUT` assembles the same from the live stage
replicas of a running swarm instead (node.export_live): it joins the run as an observer,
downloads each stage's newest global state over `/agora/state/1` and leaves.

This module only parses, dispatches and reports; `export_checkpoints` stays importable
from here for callers of the checkpoint path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from node.export_assembly import Assembled, ExportError
from node.export_assembly import export_checkpoints as export_checkpoints  # re-exported
from protocol.state import CHUNK_ELEMENTS

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora export",
        description="Assemble the full trained model and write OUT/model.safetensors +"
        " OUT/config.json, either from per-stage checkpoints (written by agora-node"
        " --checkpoint-dir) or from the live replicas of a running swarm (--coordinator)."
        " Evaluate it with `agora baseline --init OUT --eval-only`.",
        epilog="Live export: the exporter joins the run as an observer (a member nodes"
        " serve, on no stage, never routed to or given a lease), asks every replica of"
        " each stage for its global state (theta_g of the last applied outer round; the"
        " current weights on nodes without an outer loop), downloads the newest round of"
        " each stage in chunks over /agora/state/1, and leaves. Exit code 2 on any error.",
    )
    p.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    p.add_argument(
        "--checkpoints", type=Path, nargs="+", metavar="DIR",
        help="directories holding stage{K}.safetensors (all stages of one run; the newest"
        " round of each stage is used)",
    )  # fmt: skip
    p.add_argument(
        "--coordinator", metavar="HOST:PORT",
        help="assemble from the live replicas of the run this coordinator serves",
    )  # fmt: skip
    live = p.add_argument_group("live export (--coordinator)")
    live.add_argument(
        "--identity", type=Path, metavar="PATH",
        help="key file to join with (created if missing; default: a throwaway identity);"
        " needed for runs with auth mode allowlist; not the key of a running node",
    )  # fmt: skip
    live.add_argument(
        "--join-token", default=os.environ.get("AGORA_JOIN_TOKEN", ""), metavar="TOKEN",
        help="the run's join token, for auth mode token (default: $AGORA_JOIN_TOKEN)",
    )  # fmt: skip
    live.add_argument(
        "--timeout", type=float, default=600.0, metavar="S",
        help="seconds the whole live export may take (default 600)",
    )  # fmt: skip
    live.add_argument(
        "--request-timeout", type=float, default=30.0, metavar="S",
        help="seconds one state request to a replica may take (default 30)",
    )  # fmt: skip
    live.add_argument(
        "--member-wait", type=float, default=30.0, metavar="S",
        help="seconds replicas may take to admit the new observer (they learn of it at"
        " their next membership refresh; default 30)",
    )  # fmt: skip
    live.add_argument(
        "--chunk-elements", type=int, default=CHUNK_ELEMENTS, metavar="N",
        help=f"fp32 elements asked per state chunk (default {CHUNK_ELEMENTS}, 16 MiB)",
    )  # fmt: skip
    live.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--json", type=Path,
        help="also write a summary here: run id, rounds and sources per stage (checkpoint"
        " files, or the peer ids of the replicas the live states came from)",
    )  # fmt: skip
    return p


def _export_live(args: argparse.Namespace) -> Assembled:
    # imported on use: the checkpoint path then loads neither trio nor libp2p
    from node.export_live import LiveOptions, export_live

    opts = LiveOptions(
        identity=args.identity,
        join_token=args.join_token,
        timeout_s=args.timeout,
        request_timeout_s=args.request_timeout,
        member_wait_s=args.member_wait,
        chunk_elements=args.chunk_elements,
        progress=not args.no_progress,
    )
    return export_live(args.coordinator, args.out, opts)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if (args.coordinator is None) == (not args.checkpoints):
        print(
            "agora export: give either --checkpoints DIR [DIR ...] or --coordinator HOST:PORT",
            file=sys.stderr,
        )
        return 2
    try:
        if args.coordinator is not None:
            got = _export_live(args)
        else:
            got = export_checkpoints(args.checkpoints, args.out)
    except (ExportError, ValueError, OSError) as exc:
        print(f"agora export: {exc}", file=sys.stderr)
        return 2
    summary = {
        "out": str(args.out),
        "run_id": got.run_id,
        "rounds": got.rounds,
        "sources": got.sources,
        "n_params": sum(p.numel() for p in got.model.parameters()),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    rounds = ", ".join(f"stage {s} round {r}" for s, r in got.rounds.items())
    print(f"exported run {got.run_id} ({rounds}) to {args.out}")
    return 0
