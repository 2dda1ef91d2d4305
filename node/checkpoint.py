"""Stage checkpoints: a replica's global state (theta_g, round) on disk, as safetensors.

A checkpoint of stage K is two files in the checkpoint directory:
- `stage{K}.safetensors`: the stage's parameters at the last applied outer step, one
  tensor per parameter under its global state-dict name (`blocks.2.qkv.weight`, ...), so
  the full model is the union of every stage's tensors. When the outer momentum is
  known it is stored too, under `outer_m.<name>`. The safetensors header metadata holds
  the JSON description below (key `agora`), so the file is self-describing and one
  rename publishes weights and description together.
- `stage{K}.json`: the same description for people and tools (`format`, `version`,
  `run_id`, `preset`, `seed`, `vocab_size`, `stage_layers`, `tokenizer_hash`, `stage`,
  `n_stages`, `round`, `numel`, `momentum`, `created_at`, `digest` and `lineage`: the state's digest and the chain of (round,
  digest) it descends from, `protocol.lineage`; `sha256` of the safetensors file).

Both are written to a temporary file in the same directory, fsynced and renamed over
the old one, so a reader never sees a half-written checkpoint. `StageCheckpointer` is
the node's side: it decides when a round is due a checkpoint and writes off the event
loop. `read_checkpoint` / `find_checkpoints` are the export's side.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ingest.tokenizer import TOKENIZER_FILE
from protocol.control import digest_problem
from protocol.errors import ProtocolError
from protocol.lineage import Link, check_lineage

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "agora-stage-checkpoint"
CHECKPOINT_VERSION = 1
MOMENTUM_PREFIX = "outer_m."
_NAME = re.compile(r"^stage(\d+)\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable or inconsistent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointMeta:
    """What a stage checkpoint describes (the JSON sidecar and the safetensors header)."""

    run_id: str  # the run the state belongs to
    preset: str  # model preset name (node.model.PRESETS)
    seed: int  # run seed (subspace, E0 and init derive from it)
    stage: int  # pipeline stage of these parameters
    n_stages: int  # stages of the run
    round: int  # outer steps in this global state
    numel: int  # parameters of the stage (elements)
    momentum: bool = False  # whether outer_m.* tensors are stored
    created_at: float = 0.0  # unix seconds
    digest: str = ""  # the outer process's digest of this state (hex; "" = not known)
    lineage: tuple[Link, ...] = ()  # the state's chain, ending with it (protocol.lineage)
    vocab_size: int = 0  # the run's vocabulary (tokens; 0 = the preset's)
    stage_layers: tuple[int, ...] = ()  # the run's layers per stage (() = even split)
    tokenizer_hash: str = ""  # sha256 of the run's tokenizer.json ("" = bytes)
    format: str = CHECKPOINT_FORMAT
    version: int = CHECKPOINT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CheckpointMeta:
        if not isinstance(data, dict) or data.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{where}: not an {CHECKPOINT_FORMAT} description")
        if data.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(f"{where}: unsupported version {data.get('version')!r}")
        names = set(cls.__dataclass_fields__)
        try:
            meta = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise CheckpointError(f"{where}: {exc}") from exc
        try:
            lineage = tuple(check_lineage(list(meta.lineage), f"{where}: lineage"))
        except (ProtocolError, TypeError) as exc:
            raise CheckpointError(str(exc)) from exc
        if not isinstance(meta.digest, str) or digest_problem(meta.digest) is not None:
            raise CheckpointError(f"{where}: bad digest {meta.digest!r:.80}")
        if not isinstance(meta.stage_layers, list | tuple) or not isinstance(
            meta.tokenizer_hash, str
        ):
            raise CheckpointError(f"{where}: bad stage_layers/tokenizer_hash in {data!r:.300}")
        meta = replace(meta, lineage=lineage, stage_layers=tuple(meta.stage_layers))
        ints: tuple[int, ...] = (meta.seed, meta.stage, meta.n_stages, meta.round, meta.numel)
        ints += (meta.vocab_size, *meta.stage_layers)
        if not all(isinstance(v, int) and v >= 0 for v in ints) or meta.stage >= meta.n_stages:
            raise CheckpointError(f"{where}: bad stage/round fields in {data!r:.300}")
        return meta


def write_tokenizer(directory: Path, data: bytes) -> Path:
    """Write the run's tokenizer.json into the checkpoint directory (atomically)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / TOKENIZER_FILE
    _atomic_write(path, lambda tmp: tmp.write_bytes(data))
    return path


def checkpoint_paths(directory: Path, stage: int) -> tuple[Path, Path]:
    """(`stage{K}.safetensors`, `stage{K}.json`) in `directory`."""
    return directory / f"stage{stage}.safetensors", directory / f"stage{stage}.json"


def split_flat(
    flat: torch.Tensor, names: Sequence[str], shapes: Sequence[torch.Size]
) -> dict[str, torch.Tensor]:
    """Cut a flat fp32 vector (the outer loop's layout) into named tensors (copies)."""
    total = sum(int(torch.Size(s).numel()) for s in shapes)
    if flat.numel() != total or len(names) != len(shapes):
        raise ValueError(f"flat state has {flat.numel()} elements, the parameters {total}")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in zip(names, shapes, strict=True):
        n = int(torch.Size(shape).numel())
        out[name] = flat[offset : offset + n].detach().to(torch.float32).reshape(shape).clone()
        offset += n
    return out


def _atomic_write(path: Path, write: Any) -> None:
    """Call `write(tmp_path)`, fsync, then rename over `path` (same directory)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checkpoint(
    directory: Path,
    meta: CheckpointMeta,
    tensors: dict[str, torch.Tensor],
    momentum: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write stage `meta.stage`'s checkpoint atomically; returns the safetensors path."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    numel = sum(t.numel() for t in tensors.values())
    if numel != meta.numel:
        raise ValueError(f"tensors hold {numel} elements, meta says {meta.numel}")
    if meta.momentum != (momentum is not None):
        raise ValueError("meta.momentum must say whether momentum tensors are given")
    payload = {k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()}
    for k, v in (momentum or {}).items():
        payload[MOMENTUM_PREFIX + k] = v.detach().to(torch.float32).contiguous()
    weights, sidecar = checkpoint_paths(directory, meta.stage)
    header = {"agora": json.dumps(meta.to_dict(), sort_keys=True)}
    _atomic_write(weights, lambda tmp: save_file(payload, str(tmp), metadata=header))
    doc = {**meta.to_dict(), "sha256": _sha256(weights)}
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    _atomic_write(sidecar, lambda tmp: tmp.write_text(text))
    return weights


@dataclass(frozen=True, slots=True)
class Checkpoint:
    meta: CheckpointMeta
    tensors: dict[str, torch.Tensor]  # parameters by global name
    momentum: dict[str, torch.Tensor] | None  # outer momentum by name, when stored
    path: Path


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a `stage{K}.safetensors` file (its description comes from its own header)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            raw = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
    try:
        meta = CheckpointMeta.from_dict(json.loads(header.get("agora", "")), str(path))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: no agora description in the header ({exc})") from exc
    tensors = {k: v for k, v in raw.items() if not k.startswith(MOMENTUM_PREFIX)}
    mom = {k[len(MOMENTUM_PREFIX) :]: v for k, v in raw.items() if k.startswith(MOMENTUM_PREFIX)}
    numel = sum(t.numel() for t in tensors.values())
    if numel != meta.numel:
        raise CheckpointError(f"{path}: holds {numel} parameters, its header says {meta.numel}")
    for k, v in tensors.items():
        if v.dtype != torch.float32 or not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{path}: tensor {k} is not finite fp32")
    return Checkpoint(meta, tensors, mom if meta.momentum else None, path)


def find_checkpoints(directories: Sequence[Path]) -> list[Path]:
    """Every `stage{K}.safetensors` directly inside `directories` (or the files given)."""
    found: list[Path] = []
    for d in map(Path, directories):
        if d.is_file() and _NAME.match(d.name):
            found.append(d)
        elif d.is_dir():
            found.extend(sorted(p for p in d.iterdir() if _NAME.match(p.name)))
        else:
            raise CheckpointError(f"{d}: not a checkpoint directory or stage file")
    return found


class StageCheckpointer:
    """The node's checkpoint policy: after every `every_rounds`-th applied outer round,
    and once more at drain, write the stage's theta_g to `directory`."""

    def __init__(
        self,
        directory: Path,
        *,
        every_rounds: int,
        run_id: str,
        preset: str,
        seed: int,
        stage: int,
        n_stages: int,
        names: Sequence[str],
        vocab_size: int = 0,
        stage_layers: Sequence[int] = (),
        tokenizer_hash: str = "",
        shapes: Sequence[torch.Size],
    ) -> None:
        if every_rounds < 1:
            raise ValueError(f"every_rounds must be >= 1, got {every_rounds}")
        self.directory = Path(directory)
        self.every_rounds = every_rounds  # applied rounds between checkpoints
        self.run_id, self.preset, self.seed = run_id, preset, seed
        self.stage, self.n_stages = stage, n_stages
        self.vocab_size, self.stage_layers = vocab_size, tuple(stage_layers)
        self.tokenizer_hash = tokenizer_hash
        self.names, self.shapes = list(names), [torch.Size(s) for s in shapes]
        self.numel = sum(s.numel() for s in self.shapes)
        self.last_round = -1  # round of the newest checkpoint written
        self.last_digest = ""  # its digest (hex; "" = not known)
        self._applied = 0  # rounds applied since the last checkpoint

    def on_disk(self, round_: int, digest: str) -> bool:
        """Whether the newest checkpoint written is this state. A rebase onto another
        replica's state of the same round is another state (another digest): the file
        must follow it, or an export would take the lineage the stage abandoned."""
        return (round_, digest) == (self.last_round, self.last_digest)

    def due(self, *, final: bool = False) -> bool:
        """Count one applied round (unless `final`) and say whether to write now."""
        if not final:
            self._applied += 1
        return final or self._applied >= self.every_rounds

    def capture(
        self,
        theta_g: torch.Tensor,
        momentum: torch.Tensor | None,
        round_: int,
        digest: str = "",
        lineage: Sequence[Link] = (),
    ) -> tuple[CheckpointMeta, dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """The state (theta_g and, when there is one, the outer momentum, flat) as named
        tensors ready to write, with its digest and chain (call on the torch worker)."""
        meta = CheckpointMeta(
            run_id=self.run_id, preset=self.preset, seed=self.seed, stage=self.stage, n_stages=self.n_stages, round=round_,
            numel=self.numel, momentum=momentum is not None, created_at=time.time(), digest=digest,
            lineage=tuple(lineage), vocab_size=self.vocab_size, stage_layers=self.stage_layers,
            tokenizer_hash=self.tokenizer_hash,
        )  # fmt: skip
        return (
            meta,
            split_flat(theta_g, self.names, self.shapes),
            None if momentum is None else split_flat(momentum, self.names, self.shapes),
        )

    def write(
        self,
        meta: CheckpointMeta,
        tensors: dict[str, torch.Tensor],
        momentum: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write a captured state (any thread; disk I/O)."""
        path = write_checkpoint(self.directory, meta, tensors, momentum)
        self.last_round, self.last_digest = meta.round, meta.digest
        self._applied = 0
        log.info("checkpoint: stage %d round %d -> %s", meta.stage, meta.round, path)
        return path


class CheckpointHook:
    """The node's side: after an applied round (or at drain, `final`), write the state
    when a checkpoint is due, one write at a time (the round hook and the drain may both
    call). The split runs on the torch worker, the write in a thread. A failed write is
    logged, never fatal. A node without an outer loop writes its trained weights once,
    at drain, as round 0 with no momentum."""

    def __init__(self, ck: StageCheckpointer, worker: Any) -> None:
        import trio

        self.ck = ck
        self.worker = worker
        self._lock = trio.Lock()

    async def __call__(self, state: GlobalState, *, final: bool = False) -> Path | None:
        import trio

        ck = self.ck
        async with self._lock:
            if not ck.due(final=final) or ck.on_disk(state.round, state.digest):
                return None  # not due, or this state is on disk already
            meta, tensors, momentum = await self.worker.run(
                ck.capture, state.theta_g, state.momentum, state.round, state.digest, state.lineage
            )
            try:
                path: Path = await trio.to_thread.run_sync(ck.write, meta, tensors, momentum)
            except OSError as exc:
                log.warning(
                    "checkpoint: could not write stage %d round %d: %s", ck.stage, meta.round, exc
                )
                return None
            return path


def stage_checkpointer(
    directory: Path, every_rounds: int, run: Any, stage: int, model: torch.nn.Module
) -> StageCheckpointer:
    """A checkpointer for `model` (a `node.model.Stage`) of the run described by `run`
    (a `protocol.control.RunInfo`); the flat layout is `model.parameters()` order."""
    named = list(model.named_parameters())
    return StageCheckpointer(
        directory, every_rounds=every_rounds, run_id=run.run_id, preset=run.model_preset,
        seed=run.seed, stage=stage, n_stages=run.n_stages,
        names=[n for n, _ in named], shapes=[p.shape for _, p in named],
        vocab_size=run.vocab_size, stage_layers=run.stage_layers,
        tokenizer_hash=run.tokenizer_hash,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class GlobalState:
    """A stage's global state as one value: private flat fp32 CPU copies in parameter
    order, never the outer process's live buffers. The outer loop hands one to the state
    server and the checkpointer after every applied round; a checkpoint read back, or the
    state of an outer loop being replaced, seeds a new outer loop."""

    theta_g: torch.Tensor  # flat fp32
    momentum: torch.Tensor | None  # flat fp32, when known
    round: int  # outer steps in the state
    path: Path | None = None  # the checkpoint file it was read from, if any
    digest: str = ""  # the outer process's digest of the state (hex; "" = not known)
    lineage: tuple[Link, ...] = ()  # its chain, ending with it (protocol.lineage)


def flat_copy(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous fp32 CPU copy of `tensors` (call on the torch worker)."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def resume_state(
    directory: Path, run: Any, stage: int, model: torch.nn.Module
) -> GlobalState | None:
    """The state in `directory/stage{K}.safetensors` if it is a checkpoint of this run's
    stage (same run id, preset, seed, stage count and parameter layout), else None (with
    the reason logged): a node that finds no live replica of its stage resumes from it."""
    path = checkpoint_paths(Path(directory), stage)[0]
    if not path.is_file():
        return None
    try:
        ck = read_checkpoint(path)
    except CheckpointError as exc:
        log.warning("checkpoint: not resuming: %s", exc)
        return None
    want = {"run_id": run.run_id, "preset": run.model_preset, "seed": run.seed}
    want |= {"n_stages": run.n_stages, "stage": stage, "vocab_size": run.vocab_size}
    want |= {"stage_layers": tuple(run.stage_layers), "tokenizer_hash": run.tokenizer_hash}
    for name, value in want.items():
        if getattr(ck.meta, name) != value:
            log.warning(
                "checkpoint: not resuming from %s: its %s is %r, this run's %r",
                path, name, getattr(ck.meta, name), value,
            )  # fmt: skip
            return None
    named = list(model.named_parameters())
    if sorted(ck.tensors) != sorted(n for n, _ in named) or any(
        ck.tensors[n].shape != p.shape for n, p in named
    ):
        log.warning(
            "checkpoint: not resuming from %s: its parameters differ from the stage's", path
        )
        return None
    flat = torch.cat([ck.tensors[n].flatten() for n, _ in named])
    mom = None
    if ck.momentum is not None and sorted(ck.momentum) == sorted(ck.tensors):
        mom = torch.cat([ck.momentum[n].flatten() for n, _ in named])
    return GlobalState(
        theta_g=flat, momentum=mom, round=ck.meta.round, path=path, digest=ck.meta.digest,
        lineage=ck.meta.lineage,
    )  # fmt: skip
