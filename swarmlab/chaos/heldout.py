"""The model `agora chaos` measures: stage states kept from the nodes' checkpoints, the
whole model they form at each moment, its committed tokens, and its held-out loss.

Every node of a chaos swarm writes `stage{K}.safetensors` into its own checkpoint
directory after each applied outer round and at its drain (`agora-node
--checkpoint-dir`, node.checkpoint). Each file is replaced by an atomic rename, so
`Snapshots.poll` can keep a state by hard-linking the current file: the link holds that
state's bytes after the node replaces the file. A state is kept once per (stage, round,
digest), whichever replica wrote it.

`model_points` turns the kept states into the whole models the swarm held over time: at
each new state, per stage, the newest round among every node's latest state. A model's
committed tokens come from the coordinator's audit log (`commits_of`): `committed_when`
is what the coordinator had committed when the ranges that rode in its stage-0 state
were committed (the commit rule commits a range after the round whose state holds it),
and `tokens_on_chain` the tokens of the commits whose (round, digest) is on that
state's lineage, i.e. whose training reached the model. `bracket` picks the models
around a token count; `evaluate_points` exports and evaluates them in this process
(node.export_assembly, node.baseline) on one fixed held-out set.

Everything above `evaluate_points` is pure (no torch), so the selection is unit-tested.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("agora.chaos")

HELDOUT_BATCHES = 32  # held-out batches evaluated (node.data.eval_batches)
HELDOUT_BATCH_SIZE = 16  # sequences per held-out batch
HELDOUT_SEQ_LEN = 128  # tokens per sequence (the nodes' seq_len)
TOKENS_TOLERANCE = 0.05  # |fault-free - chaos| / chaos committed tokens called "equal"
MAX_HEADER_BYTES = 1 << 24  # a safetensors header larger than this is not a checkpoint

Link = tuple[int, str]  # (outer round, state digest), protocol.lineage


@dataclass(frozen=True, slots=True)
class StageState:
    """One kept stage state: who wrote it, what it is, where its bytes are."""

    node: str
    stage: int
    n_stages: int
    round: int
    digest: str
    lineage: tuple[Link, ...]
    path: Path  # a stage{K}.safetensors file (a kept link, or the node's own file)
    seen_at: float  # unix seconds when it was first seen


@dataclass(frozen=True, slots=True)
class Commit:
    """A stage-0 commit from the audit log: when, how many tokens, the state it rode in."""

    ts: float
    tokens: int
    link: Link  # (round, digest); (-1, "") when not known


@dataclass(frozen=True, slots=True)
class ModelPoint:
    """The whole model a swarm held at `t`: per stage the newest kept state."""

    t: float
    states: dict[int, StageState]
    committed: int = 0  # `committed_when` of its stage-0 state
    on_chain: int = 0  # `tokens_on_chain` of its stage-0 state

    @property
    def rounds(self) -> dict[int, int]:
        return {s: st.round for s, st in sorted(self.states.items())}

    @property
    def files(self) -> list[Path]:
        return [st.path for _, st in sorted(self.states.items())]


def read_state_header(path: Path, node: str = "", seen_at: float = 0.0) -> StageState | None:
    """The description of a `stage{K}.safetensors` checkpoint from its safetensors header
    (8-byte little-endian length, JSON; node.checkpoint keeps it under `agora`); None when
    the file is missing or is not a stage checkpoint."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if not 0 < n <= MAX_HEADER_BYTES:
                return None
            header = json.loads(fh.read(n))
        meta = json.loads(header["__metadata__"]["agora"])
        lineage = tuple((int(r), str(d)) for r, d in meta.get("lineage", []))
        return StageState(
            node=node, stage=int(meta["stage"]), n_stages=int(meta["n_stages"]),
            round=int(meta["round"]), digest=str(meta.get("digest", "")), lineage=lineage,
            path=Path(path), seen_at=seen_at,
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def node_checkpoints(root: Path, nodes: Iterable[str] | None = None) -> dict[str, list[Path]]:
    """node name -> its `stage{K}.safetensors` files under `root/NAME/` (all nodes, or
    only `nodes`)."""
    out: dict[str, list[Path]] = {}
    if not root.is_dir():
        return out
    wanted = None if nodes is None else set(nodes)
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        if wanted is None or d.name in wanted:
            files = sorted(d.glob("stage*.safetensors"))
            if files:
                out[d.name] = files
    return out


def current_states(root: Path, nodes: Iterable[str] | None = None) -> list[StageState]:
    """The states the nodes' checkpoint files hold now (not kept: read them before the
    nodes write again)."""
    now = time.time()
    return [
        st
        for node, files in node_checkpoints(root, nodes).items()
        for f in files
        if (st := read_state_header(f, node, now)) is not None
    ]


class Snapshots:
    """Keeps every new stage state the nodes under `root` write, as hard links under
    `into` (one directory per state, holding `stage{K}.safetensors`)."""

    def __init__(self, root: Path, into: Path) -> None:
        self.root = Path(root)
        self.into = Path(into)
        self.states: list[StageState] = []  # in the order first seen
        self._seen: dict[Path, tuple[int, int]] = {}  # file -> (inode, mtime_ns) last looked at
        self._kept: dict[tuple[int, int, str], StageState] = {}
        self._lock = threading.Lock()

    def poll(self) -> int:
        """Look at every node's checkpoint files; keep the new states. Returns how many."""
        with self._lock:
            new = 0
            for node, files in node_checkpoints(self.root).items():
                for f in files:
                    new += self._look(node, f)
            return new

    def _look(self, node: str, f: Path) -> int:
        try:
            st = f.stat()
        except OSError:
            return 0
        stamp = (st.st_ino, st.st_mtime_ns)
        if self._seen.get(f) == stamp:
            return 0
        self._seen[f] = stamp
        self.into.mkdir(parents=True, exist_ok=True)
        tmp = self.into / f".{node}.{f.name}.{stamp[0]}"
        try:
            os.link(f, tmp)  # the inode the name points to now, whatever replaces it later
        except OSError:
            return 0
        state = read_state_header(tmp, node, time.time())
        key = None if state is None else (state.stage, state.round, state.digest or node)
        if state is None or key is None or key in self._kept:
            tmp.unlink(missing_ok=True)
            if state is not None and key is not None:
                # Another replica's copy of a kept state: it is this node's latest too.
                self.states.append(_with(self._kept[key], node=node, seen_at=state.seen_at))
            return 0
        home = self.into / f"s{state.stage}-r{state.round}-{(state.digest or node)[:16]}"
        home.mkdir(parents=True, exist_ok=True)
        path = home / f.name
        os.replace(tmp, path)
        kept = _with(state, path=path)
        self._kept[key] = kept
        self.states.append(kept)
        return 1


def _with(st: StageState, **changes: Any) -> StageState:
    values = {f: getattr(st, f) for f in StageState.__dataclass_fields__}
    return StageState(**(values | changes))


def model_points(states: Sequence[StageState]) -> list[ModelPoint]:
    """The whole models over time: after each state (in `seen_at` order), per stage the
    newest round among each node's latest state; only moments when every stage has one."""
    latest: dict[str, dict[int, StageState]] = {}
    points: list[ModelPoint] = []
    for st in sorted(states, key=lambda s: s.seen_at):
        latest.setdefault(st.node, {})[st.stage] = st
        best: dict[int, StageState] = {}
        for per_node in latest.values():
            for stage, s in per_node.items():
                if stage not in best or s.round > best[stage].round:
                    best[stage] = s
        if set(best) == set(range(st.n_stages)):
            point = ModelPoint(st.seen_at, best)
            if points and points[-1].states == best:
                continue  # nothing changed
            points.append(point)
    return points


def commits_of(events: Iterable[Any]) -> list[Commit]:
    """The commits among audit records (coordinator.journal.AuditEvent), in log order."""
    return [
        Commit(float(e.ts), int(e.end - e.start), (int(e.round), str(e.digest)))
        for e in events
        if e.kind == "commit"
    ]


def tokens_on_chain(chain: Sequence[Link], commits: Sequence[Commit]) -> int:
    """Tokens of the commits that rode in a state on `chain`: their training reached it."""
    links = set(chain)
    return sum(c.tokens for c in commits if c.link in links)


def committed_when(chain: Sequence[Link], commits: Sequence[Commit]) -> int:
    """What the coordinator had committed when the newest state on `chain` that a commit
    names got its commits: the committed-token count that goes with that state. 0 when
    no commit names a state on the chain."""
    for link in reversed(chain):
        times = [c.ts for c in commits if c.link == link]
        if times:
            last = max(times)
            return sum(c.tokens for c in commits if c.ts <= last)
    return 0


def with_tokens(points: Sequence[ModelPoint], commits: Sequence[Commit]) -> list[ModelPoint]:
    """`points` with `committed` and `on_chain` from their stage-0 state's lineage."""
    out = []
    for p in points:
        chain = p.states[0].lineage if 0 in p.states else ()
        out.append(
            ModelPoint(
                p.t, p.states, committed_when(chain, commits), tokens_on_chain(chain, commits)
            )
        )
    return out


def bracket(points: Sequence[ModelPoint], tokens: int) -> list[ModelPoint]:
    """The models whose committed tokens lie either side of `tokens`, nearest first (one
    when a point matches exactly or all lie on one side; none without points)."""
    if not points:
        return []
    below = [p for p in points if p.committed <= tokens]
    above = [p for p in points if p.committed > tokens]
    near = []
    if below:
        near.append(max(below, key=lambda p: (p.committed, p.t)))
    if above and not (below and near[0].committed == tokens):
        near.append(min(above, key=lambda p: (p.committed, p.t)))
    return sorted(near, key=lambda p: (abs(p.committed - tokens), p.t))


def interpolate(a: tuple[int, float], b: tuple[int, float], tokens: int) -> float:
    """The loss at `tokens` on the line through (tokens, loss) points `a` and `b`."""
    (ta, la), (tb, lb) = a, b
    if ta == tb:
        return la
    return la + (lb - la) * (tokens - ta) / (tb - ta)


def relative_gap(tokens: int, reference: int) -> float | None:
    """(tokens - reference) / reference; None when the reference is 0."""
    return None if reference <= 0 else (tokens - reference) / reference


# --- evaluation (torch) --------------------------------------------------------------


@dataclass
class HeldOut:
    """The fixed held-out set every model of a chaos report is evaluated on."""

    dataset: Any = None  # node.data.Dataset, loaded on first use
    losses: dict[tuple[Path, ...], float] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset.manifest.name if self.dataset is not None else None,
            "batches": HELDOUT_BATCHES,
            "batch_size": HELDOUT_BATCH_SIZE,
            "seq_len": HELDOUT_SEQ_LEN,
            "tokens": HELDOUT_BATCHES * HELDOUT_BATCH_SIZE * HELDOUT_SEQ_LEN,
        }

    def evaluate(self, point: ModelPoint, out: Path) -> float:
        """Export `point` to `out` (model.safetensors, config.json, lineage.json) and
        return its held-out loss (nats per byte)."""
        key = tuple(point.files)
        if key in self.losses:
            return self.losses[key]
        from node.baseline import evaluate_weights
        from node.data import load_dataset
        from node.export_assembly import export_checkpoints

        if self.dataset is None:
            self.dataset = load_dataset()  # the swarm's dataset: the embedded corpus
        got = export_checkpoints(point.files, out)
        tensors = dict(got.model.state_dict())
        loss = float(
            evaluate_weights(
                got.config, tensors, self.dataset, batch_size=HELDOUT_BATCH_SIZE,
                seq_len=HELDOUT_SEQ_LEN, n_batches=HELDOUT_BATCHES,
            )
        )  # fmt: skip
        self.losses[key] = loss
        return loss
