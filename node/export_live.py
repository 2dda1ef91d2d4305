"""`agora export --coordinator HOST:PORT`: assemble the model from live stage replicas.

The exporter is a short-lived member of the run:
1. it joins as an observer (`JoinRequest(observer=True)`, with the run's join token if
   it needs one) with a throwaway identity (or `--identity`), so nodes admit its
   data-plane streams, while the coordinator never places, routes to or leases it;
2. for each stage it asks every replica in the membership view for the first chunk of
   its global state over `/agora/state/1` (protocol.state), each with a deadline. The
   source is a replica serving the stage's attested state (`StatusReply.stages[...]
   .attested`, which a majority of the stage's replicas reported): the exporter downloads
   its theta_g and momentum and checks the digest, asking again while none serves it
   (`--attest-wait`). A stage with nothing attested yet is waited for as long, then
   refused, unless `--unattested` takes the newest round a replica serves, unchecked;
3. it downloads the stage's flat state chunk by chunk (starting again when the served
   round or copy changes between chunks), leaves the run, and reuses the checkpoint
   path's assembly (node.export_assembly): the flat vector is cut per parameter in
   `model.parameters()` order of `build_stage(config, stage, n_stages)` (node.checkpoint
   `split_flat`), the stages are joined into the whole model and written as
   `model.safetensors` + `config.json` (or, with `--format hf`, node.export_hf's
   Hugging Face directory).

Every wait has a deadline, and a timeout names the setting that bounds it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
import trio

from node.checkpoint import split_flat
from node.control_tls import UnpinnedSecret
from node.coordinator_client import (
    ClientConfig,
    CoordinatorClient,
    CoordinatorError,
    CoordinatorUnavailable,
)
from node.export_assembly import Assembled, ExportError, assemble
from node.export_progress import ProgressFn, download_bar
from node.model import ModelConfig, build_stage, run_model_config
from node.p2p.host import Libp2pTransport
from node.p2p.transport import P2PConfig, RequestRefused, TransportError
from protocol.control import JoinReply, JoinRequest, PeerInfo, RunInfo, StateRef
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.lineage import state_digest
from protocol.pinning import CoordinatorAddress, PinMismatch, parse_address
from protocol.state import CHUNK_ELEMENTS, STATE_PROTOCOL, StateChunk, StateRequest

log = logging.getLogger(__name__)

MAX_RESTARTS = 5  # times a stage's download starts again because the served state changed
ATTEST_POLL_S = 2.0  # seconds between asks while no replica serves the attested state
RETRY_REFUSALS = ("not_member", "rate", "streams", "bytes")  # worth asking again shortly


class LiveExportError(ExportError):
    """The live replicas could not be exported (the message says which stage and why)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LiveOptions:
    """Settings of a live export (the `agora export --coordinator` flags)."""

    identity: Path | None = None  # key file; None = a throwaway identity
    join_token: str = ""  # for runs with auth mode "token" (sent only to a pinned coordinator)
    fingerprint: str | None = None  # sha256:HEX pin of the coordinator, if the address has none
    timeout_s: float = 600.0  # seconds the whole export may take (--timeout)
    request_timeout_s: float = 30.0  # seconds one chunk request may take (--request-timeout)
    # seconds replicas may take to admit the observer: they learn of it from the coordinator
    # at their next membership refresh (about one heartbeat interval) (--member-wait)
    member_wait_s: float = 30.0
    # seconds to wait for a replica that serves the stage's attested state: replicas step
    # before a majority of them report the new round (--attest-wait)
    attest_wait_s: float = 300.0
    # a stage with no attested state: take the newest round a replica serves, unchecked
    # (any one replica decides it), instead of refusing (--unattested)
    unattested: bool = False
    chunk_elements: int = CHUNK_ELEMENTS  # fp32 elements asked per chunk
    progress: bool = True  # show a progress bar on stderr

    def __post_init__(self) -> None:
        for name in ("timeout_s", "request_timeout_s", "member_wait_s", "attest_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.chunk_elements <= CHUNK_ELEMENTS * 2:
            raise ValueError(f"chunk_elements must be in [1, {CHUNK_ELEMENTS * 2}]")


@dataclasses.dataclass(frozen=True, slots=True)
class StageLayout:
    names: list[str]  # global parameter names, in model.parameters() order
    shapes: list[torch.Size]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclasses.dataclass(frozen=True, slots=True)
class StageState:
    stage: int
    round: int
    peer_id: str  # the replica it came from
    flat: torch.Tensor  # fp32, the stage's global state in the outer loop's layout
    digest: str = ""  # the attested digest it was checked against ("" = unchecked)


def stage_layout(config: ModelConfig, stage: int, n_stages: int) -> StageLayout:
    """Names and shapes of the stage's parameters, the flat state's layout."""
    named = list(build_stage(config, stage, n_stages).named_parameters())
    return StageLayout(names=[n for n, _ in named], shapes=[p.shape for _, p in named])


def model_config(run: RunInfo) -> ModelConfig:
    try:
        return run_model_config(
            run.model_preset, seed=run.seed, vocab_size=run.vocab_size, split=run.stage_layers
        )
    except ValueError as exc:
        raise LiveExportError(f"run {run.run_id!r}: {exc}") from exc


# --- downloading ----------------------------------------------------------------------------


class _Fetcher:
    def __init__(
        self, transport: Libp2pTransport, run: RunInfo, opts: LiveOptions, progress: ProgressFn
    ) -> None:
        self.transport = transport
        self.run = run
        self.opts = opts
        self.progress = progress

    async def ask(
        self,
        peer: PeerInfo,
        stage: int,
        offset: int,
        count: int | None = None,
        momentum: bool = False,
    ) -> StateChunk:
        """One chunk from `peer` (of theta_g, or of m with `momentum`); refusals that may
        pass (not yet a member there, rate) are retried until `member_wait_s`."""
        give_up = trio.current_time() + self.opts.member_wait_s
        count = count or self.opts.chunk_elements
        req = StateRequest(stage=stage, offset=offset, count=count, momentum=momentum)
        while True:
            try:
                reply = await self.transport.request(
                    peer.peer_id,
                    peer.addrs,
                    STATE_PROTOCOL,
                    req,
                    timeout=self.opts.request_timeout_s,
                )
            except RequestRefused as exc:
                wait = max(0.5, min(exc.retry_after, 5.0))
                retry = exc.reason in RETRY_REFUSALS or exc.retry_after > 0
                if not retry or trio.current_time() + wait > give_up:
                    if exc.reason == "not_member":
                        raise TransportError(
                            f"{exc} (still not admitted after --member-wait"
                            f" {self.opts.member_wait_s:g} s)",
                            peer_id=peer.peer_id,
                        ) from exc
                    raise
                await trio.sleep(wait)
                continue
            if not isinstance(reply, StateChunk):
                raise TransportError(
                    f"peer {peer.peer_id} answered {type(reply).__name__}, not a state chunk",
                    peer_id=peer.peer_id,
                )
            if reply.stage != stage or reply.offset != offset or reply.run_id != self.run.run_id:
                raise TransportError(
                    f"peer {peer.peer_id} sent stage {reply.stage} offset {reply.offset} of run"
                    f" {reply.run_id!r}; asked stage {stage} offset {offset} of {self.run.run_id!r}",
                    peer_id=peer.peer_id,
                )
            return reply

    async def probe(
        self, stage: int, replicas: list[PeerInfo]
    ) -> tuple[list[tuple[StateChunk, PeerInfo]], dict[str, str]]:
        """Every replica's first element (its round, version and size), newest round
        first, and the failures by peer id."""
        got: list[tuple[StateChunk, PeerInfo]] = []
        errors: dict[str, str] = {}

        async def one(peer: PeerInfo) -> None:
            try:
                got.append((await self.ask(peer, stage, 0, count=1), peer))
            except (TransportError, ProtocolError) as exc:
                errors[peer.peer_id] = str(exc)
                log.warning("export: replica %s of stage %d: %s", peer.peer_id, stage, exc)

        async with trio.open_nursery() as nursery:
            for peer in replicas:
                nursery.start_soon(one, peer)
        return sorted(got, key=lambda cp: (-cp[0].round, cp[1].peer_id)), errors

    async def download(
        self,
        stage: int,
        layout: StageLayout,
        replicas: list[PeerInfo],
        want: StateRef | None = None,
    ) -> StageState:
        """The stage's state from the replica with the newest round; with `want` (the
        stage's attested state), from a replica serving that round whose state's digest
        (theta_g and m downloaded) is the attested one."""
        candidates, errors = await self.probe(stage, replicas)
        if want is not None:
            rounds = sorted({first.round for first, _ in candidates})
            candidates = [(first, peer) for first, peer in candidates if first.round == want.round]
            if not candidates:
                raise LiveExportError(
                    f"no replica of stage {stage} serves its attested round {want.round} now"
                    f" (they serve rounds {rounds}; {len(errors)} did not answer)"
                )
        for first, peer in candidates:
            try:
                if first.numel != layout.numel:
                    raise TransportError(
                        f"peer {peer.peer_id} serves {first.numel} elements; stage {stage} of"
                        f" the {self.run.model_preset} model has {layout.numel}",
                        peer_id=peer.peer_id,
                    )
                got, version = await self._download_from(stage, peer, first)
                if want is not None:
                    await self._check(stage, peer, got, version, want)
                return got
            except (TransportError, ProtocolError) as exc:
                errors[peer.peer_id] = str(exc)
                log.warning("export: stage %d from %s failed: %s", stage, peer.peer_id, exc)
        detail = "; ".join(f"{pid}: {err}" for pid, err in errors.items()) or "no replica"
        raise LiveExportError(
            f"no replica of stage {stage} delivered its state ({len(replicas)} tried): {detail}"
        )

    async def _check(
        self, stage: int, peer: PeerInfo, got: StageState, version: int, want: StateRef
    ) -> None:
        """Download the momentum of the copy `got` came from and check that the state's
        digest (`protocol.lineage.state_digest`) is the attested one."""
        first = await self.ask(peer, stage, 0, momentum=True)
        m, m_version = await self._download_from(stage, peer, first, momentum=True)
        if (m.round, m_version) != (got.round, version):
            raise TransportError(
                f"peer {peer.peer_id} moved on from round {got.round} during the download",
                peer_id=peer.peer_id,
            )
        digest = state_digest(got.round, got.flat.numpy().data, m.flat.numpy().data)
        if (got.round, digest) != (want.round, want.digest):
            raise TransportError(
                f"peer {peer.peer_id} served round {got.round} with digest {digest}, not the"
                f" stage's attested state (round {want.round}, digest {want.digest})",
                peer_id=peer.peer_id,
            )

    async def _download_from(
        self, stage: int, peer: PeerInfo, first: StateChunk, momentum: bool = False
    ) -> tuple[StageState, int]:
        """The served copy's theta_g (or m, with `momentum`) and the copy's version."""
        flat = torch.empty(first.numel, dtype=torch.float32)
        out = flat.numpy()
        chunk = first
        restarts = 0
        while True:
            out[chunk.offset : chunk.end] = chunk.values()
            if not momentum:
                self.progress(stage, chunk.end, first.numel, first.round, peer.peer_id)
            if chunk.end >= first.numel:
                got = StageState(stage=stage, round=first.round, peer_id=peer.peer_id, flat=flat)
                return got, first.version
            chunk = await self.ask(peer, stage, chunk.end, momentum=momentum)
            if (chunk.round, chunk.version, chunk.numel) != (
                first.round,
                first.version,
                first.numel,
            ):
                restarts += 1
                if restarts > MAX_RESTARTS:
                    raise TransportError(
                        f"peer {peer.peer_id}'s state changed {restarts} times during the"
                        " download (rounds apply faster than it can be fetched)",
                        peer_id=peer.peer_id,
                    )
                log.info(
                    "export: stage %d moved from round %d to %d mid-download; starting again",
                    stage, first.round, chunk.round,
                )  # fmt: skip
                first = chunk = await self.ask(peer, stage, 0, momentum=momentum)
                flat = torch.empty(first.numel, dtype=torch.float32)
                out = flat.numpy()


async def _join(client: CoordinatorClient, opts: LiveOptions) -> JoinReply:
    try:
        joined = await client.join(
            JoinRequest(observer=True, join_token=opts.join_token, device="export")
        )
    except CoordinatorError as exc:
        hint = " (pass --join-token)" if exc.code == "unauthorized" else ""
        raise LiveExportError(f"the coordinator refused the observer join: {exc}{hint}") from exc
    if joined.stage != joined.run.n_stages:  # an old coordinator placed us on a stage
        try:
            await client.leave()
        except (CoordinatorError, CoordinatorUnavailable):
            pass
        raise LiveExportError(
            "the coordinator does not support observers (it placed the exporter on stage"
            f" {joined.stage}); export from checkpoints instead (--checkpoints)"
        )
    return joined


async def fetch_live(
    address: CoordinatorAddress, opts: LiveOptions, progress: ProgressFn | None = None
) -> tuple[RunInfo, dict[int, StageState], bytes | None]:
    """Join as an observer, download every stage's newest global state and the run's
    tokenizer.json (hash-checked; None for the byte tokenizer), leave."""
    from node.identity import load_or_create_key

    key = load_or_create_key(opts.identity) if opts.identity is not None else NodeKey.generate()
    try:
        with trio.fail_after(opts.timeout_s):
            try:
                return await _session(address, key, opts, progress or (lambda *_: None))
            except BaseExceptionGroup as group:  # the libp2p host's nursery wraps errors
                leaf = _first_error(group)
                if leaf is None:
                    raise
                raise leaf from None
    except trio.TooSlowError:
        raise LiveExportError(
            f"the export did not finish within --timeout {opts.timeout_s:g} s"
        ) from None
    except (CoordinatorUnavailable, PinMismatch, UnpinnedSecret) as exc:
        raise LiveExportError(str(exc)) from exc
    except CoordinatorError as exc:
        raise LiveExportError(f"the coordinator refused: {exc}") from exc


async def _session(
    address: CoordinatorAddress, key: NodeKey, opts: LiveOptions, progress: ProgressFn
) -> tuple[RunInfo, dict[int, StageState], bytes | None]:
    transport = Libp2pTransport(key, P2PConfig(listen=[]))  # outbound only
    client_cfg = ClientConfig(retry_deadline_s=min(60.0, opts.timeout_s))
    async with transport.run(), CoordinatorClient.to(address, key, config=client_cfg) as client:
        joined = await _join(client, opts)
        run = joined.run
        log.info("export: joined run %s as observer %s", run.run_id, key.peer_id)
        tokenizer = None
        if run.tokenizer_hash:
            try:
                tokenizer = await client.fetch_tokenizer(run.tokenizer_hash)
            except ProtocolError as exc:
                raise LiveExportError(str(exc)) from exc
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.heartbeat_loop, list)
                states = await _fetch_stages(client, transport, run, opts, progress)
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(10.0) as scope:
                scope.shield = True
                try:
                    await client.leave()
                except (CoordinatorError, CoordinatorUnavailable) as exc:
                    log.warning("export: could not leave the run: %s", exc)
    return run, states, tokenizer


def _first_error(exc: BaseException) -> BaseException | None:
    """The first exception in a (nested) group that is not a cancellation."""
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            leaf = _first_error(sub)
            if leaf is not None:
                return leaf
        return None
    return None if isinstance(exc, trio.Cancelled) else exc


async def _replicas(client: CoordinatorClient, run: RunInfo, stage: int) -> list[PeerInfo]:
    """The live replicas of `stage` in the membership view, by peer id."""
    view = await client.membership()
    return sorted(
        (p for p in view.peers.values() if p.stage == stage and not p.observer),
        key=lambda p: p.peer_id,
    )


async def _attested(client: CoordinatorClient, stage: int) -> StateRef | None:
    status = await client.status()
    return next((s.attested for s in status.stages if s.stage == stage), None)


async def _fetch_stages(
    client: CoordinatorClient,
    transport: Libp2pTransport,
    run: RunInfo,
    opts: LiveOptions,
    progress: ProgressFn,
) -> dict[int, StageState]:
    empty = [s for s in range(run.n_stages) if not await _replicas(client, run, s)]
    if empty:
        raise LiveExportError(
            f"run {run.run_id!r}: no live replica of stage(s) {empty} in the membership view"
        )
    config = model_config(run)
    fetcher = _Fetcher(transport, run, opts, progress)
    states: dict[int, StageState] = {}
    for stage in range(run.n_stages):
        layout = stage_layout(config, stage, run.n_stages)
        states[stage] = await fetch_attested(
            fetcher,
            stage,
            layout,
            attested=functools.partial(_attested, client, stage),
            replicas=functools.partial(_replicas, client, run, stage),
        )
    return states


async def fetch_attested(
    fetcher: _Fetcher,
    stage: int,
    layout: StageLayout,
    attested: Callable[[], Awaitable[StateRef | None]],
    replicas: Callable[[], Awaitable[list[PeerInfo]]],
) -> StageState:
    """The stage's attested state (`attested()`: the coordinator's
    `StatusReply.stages[stage].attested`), its digest checked. Replicas step before a
    majority reports the new round (two that stepped apart agree again only at a later
    group round), and a new stage has nothing attested until its replicas report, so while
    no replica serves it, ask again (and for the `replicas()`) every `ATTEST_POLL_S`, for up
    to `attest_wait_s`. With `unattested`, a stage with nothing attested takes the newest
    round a replica serves, unchecked."""
    give_up = trio.current_time() + fetcher.opts.attest_wait_s
    waited = False
    while True:
        want = await attested()
        if want is None and fetcher.opts.unattested:
            log.warning(
                "export: stage %d has no attested state; taking the newest round a replica"
                " serves, unchecked (--unattested)", stage,
            )  # fmt: skip
            return await fetcher.download(stage, layout, await replicas(), None)
        try:
            if want is None:
                raise LiveExportError(
                    f"stage {stage} has no attested state (no majority of its replicas has"
                    " reported the state it holds)"
                )
            got = await fetcher.download(stage, layout, await replicas(), want)
            return dataclasses.replace(got, digest=want.digest)
        except LiveExportError as exc:
            if trio.current_time() + ATTEST_POLL_S > give_up:
                hint = (
                    "; --unattested takes the newest round a replica serves, unchecked"
                    if want is None
                    else ""
                )
                raise LiveExportError(
                    f"{exc}; still so after --attest-wait {fetcher.opts.attest_wait_s:g} s{hint}"
                ) from None
            (log.info if waited else log.warning)(
                "export: stage %d: %s; asking again for up to --attest-wait %g s",
                stage, exc, fetcher.opts.attest_wait_s,
            )  # fmt: skip
            waited = True
        await trio.sleep(ATTEST_POLL_S)


# --- assembling -----------------------------------------------------------------------------


def assemble_live(
    run: RunInfo, states: dict[int, StageState], tokenizer_json: bytes | None = None
) -> Assembled:
    """The whole model from the downloaded flat stage states (node.export_assembly `assemble`).

    `tokenizer_json`: the run's tokenizer.json as the coordinator served it, for
    `--format hf` (None: not fetched; the export then looks for it elsewhere)."""
    config = model_config(run)
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for stage, st in sorted(states.items()):
        layout = stage_layout(config, stage, run.n_stages)
        try:
            tensors[stage] = split_flat(st.flat, layout.names, layout.shapes)
        except ValueError as exc:
            raise LiveExportError(f"stage {stage} from {st.peer_id}: {exc}") from exc
    model = assemble(tensors, config)
    return Assembled(
        config=config,
        model=model,
        run_id=run.run_id,
        rounds={s: st.round for s, st in sorted(states.items())},
        sources={s: st.peer_id for s, st in sorted(states.items())},
        digests={s: st.digest for s, st in sorted(states.items()) if st.digest},
        tokenizer_hash=run.tokenizer_hash,
        tokenizer_json=tokenizer_json,
    )


def live_assembled(address: str, opts: LiveOptions) -> Assembled:
    """`agora export --coordinator HOST:PORT[#sha256:HEX]`: fetch the live states and
    assemble the whole model."""
    try:
        coordinator = parse_address(address, opts.fingerprint)
    except ValueError as exc:
        raise LiveExportError(f"--coordinator: {exc}") from None
    if opts.progress:
        bar, hook = download_bar()
        with bar:
            run, states, tokenizer = trio.run(fetch_live, coordinator, opts, hook)
    else:
        run, states, tokenizer = trio.run(fetch_live, coordinator, opts)
    return assemble_live(run, states, tokenizer_json=tokenizer)


__all__ = [
    "LiveExportError",
    "LiveOptions",
    "StageState",
    "assemble_live",
    "fetch_live",
    "live_assembled",
]
