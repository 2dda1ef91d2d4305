"""`agora export`: assemble the full model from stage checkpoints and write the export format.

`agora export --checkpoints DIR [DIR ...] --out OUT` reads every `stage{K}.safetensors`
(node.checkpoint) in the directories, checks they belong to one run (same run id,
preset, seed and stage count) and that every stage is present, takes the newest round of
each stage when several replicas wrote one, and writes `OUT/model.safetensors` +
`OUT/config.json` (node.model's export format). `agora baseline --init OUT --eval-only`
then evaluates it on the held-out set.

`agora export --coordinator HOST:PORT --out OUT` assembles the same from the live stage
replicas of a running swarm instead (node.export_live): it joins the run as an observer,
downloads each stage's newest global state over `/agora/state/1` and leaves.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from node.checkpoint import Checkpoint, CheckpointError, find_checkpoints, read_checkpoint
from node.model import ModelConfig, Stage, build_model, load_stage_weights, preset, save_export
from protocol.state import CHUNK_ELEMENTS

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """The stage states cannot be assembled into one model (the message says why)."""


@dataclass(frozen=True, slots=True)
class Assembled:
    config: ModelConfig
    model: Stage  # the whole model (node.model.build_model) holding the stages' weights
    run_id: str
    rounds: dict[int, int]  # stage -> outer round of the state used
    sources: dict[int, str]  # stage -> file it came from


def choose_stages(checkpoints: Sequence[Checkpoint]) -> dict[int, Checkpoint]:
    """One checkpoint per stage (the newest round), after checking they form one run."""
    if not checkpoints:
        raise ExportError("no stage checkpoints found")
    first = checkpoints[0].meta
    for ck in checkpoints[1:]:
        m = ck.meta
        for name in ("run_id", "preset", "seed", "n_stages"):
            if getattr(m, name) != getattr(first, name):
                raise ExportError(
                    f"{ck.path} is from another run: {name}={getattr(m, name)!r}, but"
                    f" {checkpoints[0].path} has {getattr(first, name)!r}"
                )
    best: dict[int, Checkpoint] = {}
    for ck in checkpoints:
        have = best.get(ck.meta.stage)
        if have is None or ck.meta.round > have.meta.round:
            best[ck.meta.stage] = ck
    missing = sorted(set(range(first.n_stages)) - set(best))
    if missing:
        raise ExportError(
            f"run {first.run_id!r} has {first.n_stages} stages; no checkpoint of stage(s)"
            f" {missing} among {len(checkpoints)} file(s)"
        )
    return best


def assemble(states: dict[int, dict[str, torch.Tensor]], config: ModelConfig) -> Stage:
    """The whole model from per-stage tensors (global names); shapes and coverage checked."""
    model = build_model(config)
    union: dict[str, torch.Tensor] = {}
    for stage, tensors in sorted(states.items()):
        overlap = set(union) & set(tensors)
        if overlap:
            raise ExportError(
                f"stage {stage} repeats tensors of another stage: {sorted(overlap)[:3]}"
            )
        union.update(tensors)
    extra = set(union) - set(model.state_dict())
    if extra:
        raise ExportError(f"tensors not in the {config} model: {sorted(extra)[:3]}")
    try:
        load_stage_weights(model, union)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    return model


def assemble_checkpoints(paths: Sequence[Path]) -> Assembled:
    """Read the checkpoints in `paths` (directories or files) and build the whole model."""
    try:
        checkpoints = [read_checkpoint(p) for p in find_checkpoints(paths)]
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    chosen = choose_stages(checkpoints)
    meta = chosen[0].meta
    try:
        config = preset(meta.preset).replace(seed=meta.seed)
    except ValueError as exc:
        raise ExportError(f"{chosen[0].path}: {exc}") from exc
    model = assemble({s: ck.tensors for s, ck in chosen.items()}, config)
    return Assembled(
        config=config,
        model=model,
        run_id=meta.run_id,
        rounds={s: ck.meta.round for s, ck in sorted(chosen.items())},
        sources={s: str(ck.path) for s, ck in sorted(chosen.items())},
    )


def export_checkpoints(paths: Sequence[Path], out: Path) -> Assembled:
    """`assemble_checkpoints` and write the export format to `out`."""
    got = assemble_checkpoints(paths)
    save_export(got.model, got.config, out)
    return got


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
