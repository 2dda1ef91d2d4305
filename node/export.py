"""`agora export`: the command that assembles the full model and writes the export format.

`agora export --checkpoints DIR [DIR ...] --out OUT` assembles it from stage checkpoint
files (node.export_assembly: one run, every stage, the newest round of each) and writes
`OUT/model.safetensors` + `OUT/config.json` (node.model's export format).
`agora baseline --init OUT --eval-only` then evaluates it on the held-out set.

`agora export --coordinator HOST:PORT --out OUT` assembles the same from the live stage
replicas of a running swarm instead (node.export_live): it joins the run as an observer,
downloads each stage's newest global state over `/agora/state/1` and leaves.

`agora export --model DIR --out OUT` reads an export of node.model's format (what
`agora baseline --out B` writes to B/model), to convert it.

`--format hf` writes, from any of the three, a Hugging Face Llama directory instead
(node.export_hf: `LlamaForCausalLM.from_pretrained(OUT)` loads it) with the tokenizer:
`--tokenizer FILE`, else the tokenizer.json the source has, else the byte tokenizer.

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

from node.export_assembly import (
    Assembled,
    ExportError,
    assemble_checkpoints,
    assemble_model_dir,
    write_lineage,
)
from node.export_assembly import export_checkpoints as export_checkpoints  # re-exported
from node.model import save_export
from protocol.state import CHUNK_ELEMENTS

log = logging.getLogger(__name__)
FORMATS = ("agora", "hf")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora export",
        description="Assemble the full trained model and write OUT/model.safetensors +"
        " OUT/config.json, either from per-stage checkpoints (written by agora-node"
        " --checkpoint-dir), from the live replicas of a running swarm (--coordinator) or"
        " from an export directory (--model). Evaluate it with `agora baseline --init OUT"
        " --eval-only`. With --format hf, OUT is a Hugging Face Llama directory instead"
        " (model.safetensors, config.json, tokenizer.json, ...) that transformers'"
        " LlamaForCausalLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT) load.",
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
        "--coordinator", metavar="HOST:PORT[#sha256:HEX]",
        help="assemble from the live replicas of the run this coordinator serves;"
        " #sha256:HEX pins its TLS certificate (the fingerprint it printed at start), which"
        " --join-token needs",
    )  # fmt: skip
    p.add_argument(
        "--coordinator-fingerprint", metavar="sha256:HEX",
        help="the coordinator's certificate pin, when --coordinator carries none",
    )  # fmt: skip
    p.add_argument(
        "--model", type=Path, metavar="DIR",
        help="an export directory of the agora format (model.safetensors + config.json, as"
        " `agora baseline --out B` writes to B/model), e.g. to convert it with --format hf",
    )  # fmt: skip
    p.add_argument(
        "--format", choices=FORMATS, default="agora",
        help="agora (default): model.safetensors + config.json as `agora baseline --init`"
        " reads it; hf: a Hugging Face Llama directory (LlamaForCausalLM, with tokenizer"
        " files), the subspace's frozen embedding folded into the token embedding",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", type=Path, metavar="FILE",
        help="with --format hf: the run's tokenizer.json (default: tokenizer.json in the"
        " checkpoint or --model directory, else the byte tokenizer for a 256-token"
        " vocabulary); its vocabulary must be the model's",
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
        "--attest-wait", type=float, default=300.0, metavar="S",
        help="seconds to wait, per stage, for a replica that serves the stage's attested"
        " state (replicas step before a majority of them report the new round; default 300)",
    )  # fmt: skip
    live.add_argument(
        "--unattested", action="store_true",
        help="where a stage has no attested state yet (no majority of its replicas has"
        " reported one; waited for up to --attest-wait), take the newest round a replica"
        " serves, unchecked: any one replica then decides that stage (default: refuse)",
    )  # fmt: skip
    live.add_argument(
        "--chunk-elements", type=int, default=CHUNK_ELEMENTS, metavar="N",
        help=f"fp32 elements asked per state chunk (default {CHUNK_ELEMENTS}, 16 MiB)",
    )  # fmt: skip
    live.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--json", type=Path,
        help="also write a summary here: run id, rounds, sources and digests per stage"
        " (checkpoint files, or the peer ids of the replicas the live states came from and"
        " the attested digests they were checked against)",
    )  # fmt: skip
    return p


def _live_assembled(args: argparse.Namespace) -> Assembled:
    # imported on use: the checkpoint path then loads neither trio nor libp2p
    from node.export_live import LiveOptions, live_assembled

    opts = LiveOptions(
        identity=args.identity,
        join_token=args.join_token,
        fingerprint=args.coordinator_fingerprint,
        timeout_s=args.timeout,
        request_timeout_s=args.request_timeout,
        member_wait_s=args.member_wait,
        attest_wait_s=args.attest_wait,
        unattested=args.unattested,
        chunk_elements=args.chunk_elements,
        progress=not args.no_progress,
    )
    return live_assembled(args.coordinator, opts)


def _assembled(args: argparse.Namespace) -> tuple[Assembled, list[Path]]:
    """The whole model from the chosen source, and the directories it was read from."""
    if args.coordinator is not None:
        return _live_assembled(args), []
    if args.model is not None:
        return assemble_model_dir(args.model), [args.model]
    dirs = [p if p.is_dir() else p.parent for p in args.checkpoints]
    return assemble_checkpoints(args.checkpoints), dirs


def _write(args: argparse.Namespace, got: Assembled, source_dirs: list[Path]) -> str:
    """Write `got` to --out in --format; a note on the tokenizer for the report."""

    def lineage(directory: Path) -> None:
        if got.rounds:  # a run's states (not --model): the lineage `agora audit` reads
            write_lineage(got, directory)

    if args.format == "agora":
        save_export(got.model, got.config, args.out)
        lineage(args.out)
        return ""
    from node.export_hf import resolve_tokenizer, save_hf

    tokenizer, where = resolve_tokenizer(
        got.config.vocab_size,
        explicit=args.tokenizer,
        served=got.tokenizer_json,
        source_dirs=source_dirs,
        tokenizer_hash=got.tokenizer_hash,
    )
    save_hf(got.model, tokenizer, args.out, extra=lineage)
    return f" as a Hugging Face Llama directory (tokenizer: {where})"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sources = [args.coordinator is not None, bool(args.checkpoints), args.model is not None]
    if sum(sources) != 1:
        print(
            "agora export: give one of --checkpoints DIR [DIR ...], --coordinator HOST:PORT"
            " or --model DIR",
            file=sys.stderr,
        )
        return 2
    if args.tokenizer is not None and args.format != "hf":
        print("agora export: --tokenizer goes with --format hf", file=sys.stderr)
        return 2
    try:
        got, source_dirs = _assembled(args)
        note = _write(args, got, source_dirs)
    except (ExportError, ValueError, OSError) as exc:
        print(f"agora export: {exc}", file=sys.stderr)
        return 2
    summary = {
        "out": str(args.out),
        "format": args.format,
        "run_id": got.run_id,
        "rounds": got.rounds,
        "sources": got.sources,
        "digests": got.digests,
        "n_params": sum(p.numel() for p in got.model.parameters()),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    if got.rounds:
        rounds = ", ".join(f"stage {s} round {r}" for s, r in got.rounds.items())
        print(f"exported run {got.run_id} ({rounds}) to {args.out}{note}")
    else:
        print(f"exported {args.model} to {args.out}{note}")
    return 0
