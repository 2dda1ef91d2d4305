"""Assemble the whole model from per-stage states, and from stage checkpoint files.

Shared by both ways `agora export` gets its states (node.export is the command):
- `assemble` joins per-stage tensors (global names) into the whole model
  (node.model.build_model), checking that no tensor repeats, none is foreign and every
  shape fits; the live path (node.export_live) feeds it states downloaded from replicas.
- `assemble_checkpoints` reads every `stage{K}.safetensors` (node.checkpoint) in the
  given directories, checks they belong to one run (same run id, preset, seed and stage
  count) and that every stage is present, and takes the newest round of each stage when
  several replicas wrote one, the state more of them hold on a tie (`choose_stages`).
- `assemble_model_dir` reads an export directory of node.model's format instead (what
  `agora baseline --out OUT` writes to OUT/model), for `agora export --model DIR`.
- `export_checkpoints` also writes `OUT/model.safetensors` + `OUT/config.json`
  (node.model's export format); `agora export --format hf` writes the same `Assembled`
  model as a Hugging Face directory instead (node.export_hf).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from node.checkpoint import Checkpoint, CheckpointError, find_checkpoints, read_checkpoint
from node.model import (
    ModelConfig,
    Stage,
    build_model,
    load_export,
    load_stage_weights,
    run_model_config,
    save_export,
)
from protocol.lineage import LINEAGE_FILE, LINEAGE_FORMAT, Link, to_plain


class ExportError(ValueError):
    """The stage states cannot be assembled into one model (the message says why)."""


@dataclass(frozen=True, slots=True)
class Assembled:
    config: ModelConfig
    model: Stage  # the whole model (node.model.build_model) holding the stages' weights
    run_id: str
    rounds: dict[int, int]  # stage -> outer round of the state used
    sources: dict[int, str]  # stage -> file it came from
    digests: dict[int, str] = field(default_factory=dict)  # stage -> state digest (hex)
    # stage -> the chain of (round, digest) the state descends from, ending with it
    lineages: dict[int, tuple[Link, ...]] = field(default_factory=dict)
    tokenizer_hash: str = ""  # sha256 of the run's tokenizer.json ("" = the byte tokenizer)
    # the run's tokenizer.json when the source served it (the live path's hook for the
    # coordinator's tokenizer service); None = look for it elsewhere (node.export_hf)
    tokenizer_json: bytes | None = None


def choose_stages(checkpoints: Sequence[Checkpoint]) -> dict[int, Checkpoint]:
    """One checkpoint per stage, after checking they form one run: the newest round; of
    two states of one round (a replica that stepped alone while its group stepped), the
    one more replicas wrote, then the one written last (a replica that rebased onto its
    group's state writes that state after its own)."""
    if not checkpoints:
        raise ExportError("no stage checkpoints found")
    first = checkpoints[0].meta
    for ck in checkpoints[1:]:
        m = ck.meta
        for name in (
            "run_id", "preset", "seed", "n_stages", "vocab_size", "stage_layers",
            "tokenizer_hash",
        ):  # fmt: skip
            if getattr(m, name) != getattr(first, name):
                raise ExportError(
                    f"{ck.path} is from another run: {name}={getattr(m, name)!r}, but"
                    f" {checkpoints[0].path} has {getattr(first, name)!r}"
                )
    holders = Counter((ck.meta.stage, ck.meta.round, ck.meta.digest) for ck in checkpoints)

    def rank(ck: Checkpoint) -> tuple[int, int, float]:
        m = ck.meta
        return m.round, holders[m.stage, m.round, m.digest] if m.digest else 1, m.created_at

    best: dict[int, Checkpoint] = {}
    for ck in checkpoints:
        have = best.get(ck.meta.stage)
        if have is None or rank(ck) > rank(have):
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
        config = run_model_config(
            meta.preset, seed=meta.seed, vocab_size=meta.vocab_size, split=meta.stage_layers
        )
    except ValueError as exc:
        raise ExportError(f"{chosen[0].path}: {exc}") from exc
    model = assemble({s: ck.tensors for s, ck in chosen.items()}, config)
    return Assembled(
        config=config,
        model=model,
        run_id=meta.run_id,
        rounds={s: ck.meta.round for s, ck in sorted(chosen.items())},
        sources={s: str(ck.path) for s, ck in sorted(chosen.items())},
        digests={s: ck.meta.digest for s, ck in sorted(chosen.items())},
        lineages={s: ck.meta.lineage for s, ck in sorted(chosen.items())},
        tokenizer_hash=meta.tokenizer_hash,
    )


def assemble_model_dir(directory: Path) -> Assembled:
    """The whole model of an export directory in node.model's format (no run: no rounds)."""
    directory = Path(directory)
    inner = directory / "model"  # `agora baseline --out B` writes its export to B/model
    if not (directory / "config.json").is_file() and (inner / "config.json").is_file():
        raise ExportError(f"{directory} holds no export; did you mean {inner}?")
    try:
        config, tensors = load_export(directory)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    return Assembled(
        config=config,
        model=assemble({0: tensors}, config),
        run_id="",
        rounds={},
        sources={0: str(directory)},
    )


def export_checkpoints(paths: Sequence[Path], out: Path) -> Assembled:
    """`assemble_checkpoints` and write the export format to `out`."""
    got = assemble_checkpoints(paths)
    save_export(got.model, got.config, out)
    write_lineage(got, out)
    return got


def write_lineage(got: Assembled, out: Path) -> Path:
    """`OUT/lineage.json`: per stage the round and digest of the state exported and the
    chain of (round, digest) in its history (`protocol.lineage`; empty when the source
    did not record it). `agora audit --export OUT` checks stage 0's commits against it."""
    doc = {
        "format": LINEAGE_FORMAT,
        "version": 1,
        "run_id": got.run_id,
        "stages": {
            str(s): {
                "round": r,
                "digest": got.digests.get(s, ""),
                "lineage": to_plain(list(got.lineages.get(s, ()))),
            }
            for s, r in sorted(got.rounds.items())
        },
    }
    path = Path(out) / LINEAGE_FILE
    path.write_text(json.dumps(doc, indent=1))
    return path
