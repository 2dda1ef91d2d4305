"""Control-plane messages between nodes and the coordinator.

Transport: one TCP connection, frames of `protocol.framing` (4-byte length + msgpack).
Every request frame is a `protocol.signing.SignedRequest` whose `body` is one of the
request messages below, signed by the node key. The coordinator answers each request
with exactly one reply frame (a plain, unsigned message), in request order, so a client
may pipeline. Any request may instead be answered with `ErrorReply`; its `code` is one
of `ERROR_CODES`.

Node-facing calls (request -> reply):

- `JoinRequest` -> `JoinReply`: become a member. The reply carries the run (`RunInfo`:
  run id, model preset, stages, activation codec, seed, heartbeat interval, lease TTL,
  dataset hash) and the node's `stage`. `JoinRequest(observer=True)` joins as an
  observer (`agora export`): listed in the view with `PeerInfo.observer` so peers serve
  its requests, but placed on no stage (its `stage` is `n_stages`), never routed to,
  counted as a replica or granted a lease (`LeaseGrant(reason="observer")`). Joining again with the same key replaces the
  old membership (its leases are fenced). A node that reports its device memory
  (`JoinRequest.memory`) is placed only on a stage whose estimate (`protocol.memory`)
  fits it: when none does, or not the `stage` it asked for, the join is refused with
  `no_stage_fits`. With `max_source_share` set, members from one source address hold at
  most that share of a stage's replicas, else the join goes elsewhere or is refused with
  `source_share`. Fetch the dataset manifest with
  `ManifestRequest` -> `protocol.corpus.Manifest`.
- `HeartbeatRequest` -> `HeartbeatReply`: send every `RunInfo.heartbeat_interval_s`.
  Renews the membership and every lease the node holds. The reply lists the leases
  renewed and those fenced (the node must drop their uncommitted work), the node's
  current stage (`moved` is true when the coordinator rebalanced it: load the new
  stage's state from peers) and `drain` (finish the round, commit, release, leave).
  A replica reports the global state it holds (`state`, a `StateRef`); the reply names
  its stage's attested state (`attested`: the newest one a majority of the stage's
  reporting replicas hold). A node whose membership lapsed gets `ErrorReply(code="not_member")` and re-joins.
- `MembershipRequest(since=v)` -> `MembershipReply`: one page of at most the
  coordinator's page size (<= `MAX_PEERS_PER_PAGE`) entries, so a reply always fits a
  frame. A delta page (`full` false) lists the peers that joined or changed (`peers`,
  current entries) and the ids that left (`left`) among the changes after `v`, complete
  up to `version`; `more` is true when later changes remain: ask again with
  `since=version`. When `v` is 0 or older than the change log the reply is a page of
  the full view (`full` true) in peer-id order: its `version` is the view's at that
  moment; while `more`, ask for the next page with `since=0, after=cursor`. Once the
  last page arrived, ask `since=` the first page's version for the changes made while
  paging (`node.coordinator_client.CoordinatorClient.membership` does all this).
- `LeaseAcquire` -> `LeaseGrant`: a data lease, or `lease=None` with a `reason`
  ("no_shards", "deadline", "max_leases", "fair_share", "paused", "no_freed"). A lease covers the
  token range `[committed, limit)` of one shard. `limit` is below the shard end when the node's
  deadline allows only part of it (deadline-aware granting). A stage-0 node's heartbeat
  reply counts the ranges that expired or released leases left waiting
  (`HeartbeatReply.freed`); `LeaseAcquire(freed_only=True)` asks for one of those only,
  so a node whose lease pool is full can take one at once without growing further.
- `LeaseCommit(lease_id, epoch, start, end)` -> `LeaseReply`: commit `[start, end)`;
  `start` must equal the lease's committed offset (commits are monotonic) and
  `end <= limit`. Optional `stage`, `round` and `digest` name the global state the
  range's training reached (its lineage); the coordinator records them in the audit log. Committing up to `limit` completes the lease. Repeating the last
  commit exactly is acknowledged again (safe retry). A stale holder gets
  `ErrorReply(code="fenced")`.
- `LeaseComplete(lease_id, epoch)` -> `LeaseReply`: confirm a lease whose committed
  offset reached its limit (idempotent).
- `LeaseRelease(lease_id, epoch)` -> `LeaseReply`: give the lease back; the shard
  returns to the queue at its committed offset with a higher fencing epoch.
- `ShardFetch(shard_id)` -> `ShardData`: the shard's bytes and sha256 (verify it).
- `TokenizerFetch` -> `TokenizerData`: the run's tokenizer.json and its sha256, which
  must equal `RunInfo.tokenizer_hash` (a run of the byte tokenizer has none to fetch).
- `LeaveRequest` -> `OkReply`: leave cleanly (releases every lease).
- `StatusRequest` -> `StatusReply`: read-only run summary; any valid signature will do
  (an ephemeral key is fine), membership is not required. It is the one request a
  coordinator takes signed for no run (`sign_request(..., run=None)`); every other
  request must be signed for `StatusReply.run_id`.

Admin calls carry `admin_token` and answer `OkReply` or `ErrorReply(code="forbidden")`:
`AdminDrain(peer_id)`, `AdminBan(peer_id)`, `AdminPause(paused)`.
"""

from __future__ import annotations

from protocol.addrs import MAX_ADDRS, multiaddr_problem
from protocol.credit import MAX_CREDIT_BYTES
from protocol.message import Message, bounded, message, record

__all__ = ["MAX_ADDRS"]  # re-exported: the bound of every address list below

MAX_DIGEST_CHARS = 64  # characters of a state digest (lowercase hex)
MAX_PEERS_PER_PAGE = 4096  # entries (peers + left) in one MembershipReply
PEER_ID_LEN = 128  # characters, upper bound on a base58 peer id
# bytes, upper bound on one encoded PeerInfo within the bounds below (two lists of
# MAX_ADDRS addresses of MAX_CHARS characters, a peer id, a device); a membership page
# of n entries fits a reply frame of n * MAX_PEER_INFO_BYTES + 4096 bytes
MAX_PEER_INFO_BYTES = 5120


def digest_problem(value: str) -> str | None:
    """Why `value` is not a state digest (lowercase hex, may be empty), or None."""
    if value.strip("0123456789abcdef"):
        return "a digest is lowercase hex"
    return None


ERROR_CODES = (
    "bad_request",  # malformed or invalid request (detail says what)
    "bad_frame",  # the frame could not be decoded; the connection is closed
    "bad_signature",  # signature invalid
    "replay",  # nonce already seen, or timestamp outside the skew window
    "unauthorized",  # join refused by the auth mode (token / allowlist)
    "banned",  # the peer is banned from the run
    "forbidden",  # admin call without a valid admin token
    "not_member",  # the sender is not a live member: (re-)join first
    "fenced",  # the lease was fenced: a newer holder owns the shard; drop the work
    "not_found",  # no such lease / shard
    "conflict",  # commit does not start at the committed offset, or exceeds the limit
    "rate_limited",  # too many requests from this key; back off
    "too_busy",  # connection limit reached
    # join refused: no stage's memory estimate (protocol.memory) fits the device memory the
    # node reported, or the stage it asked for does not; detail: the need and the memory
    "no_stage_fits",
    # join refused: members from the joiner's source address already hold
    # `max_source_share` of the stage it asked for, or of every stage it fits
    "source_share",
    "internal",  # the coordinator failed; retry later
)


@message("error", version=1)
class ErrorReply(Message):
    """Any request can be answered with an error; `code` is machine-readable."""

    code: str = bounded(max_len=64)
    detail: str = bounded(max_len=1024, default="")


@message("ok", version=1)
class OkReply(Message):
    """Plain acknowledgement."""

    detail: str = bounded(max_len=256, default="")


# --- records -----------------------------------------------------------------------------


@record
class RunInfo(Message):
    """What a node needs to know about the run it joined."""

    run_id: str = bounded(max_len=128)
    model_preset: str = bounded(max_len=64)
    n_stages: int = bounded(ge=1, le=1024)
    codec: str = bounded(max_len=64)  # activation codec id, e.g. "subspace_int8"
    seed: int = bounded(ge=0)
    heartbeat_interval_s: float = bounded(ge=0.01, le=3600.0)  # seconds
    lease_ttl_s: float = bounded(ge=0.05, le=86_400.0)  # seconds
    dataset_name: str = bounded(max_len=256)
    dataset_hash: str = bounded(max_len=64)  # sha256 of the corpus (Manifest.content_hash)
    shards: int = bounded(ge=0)  # training shards in the manifest
    data_epoch: int = bounded(ge=0)
    # circuit-relay v2 hops the run offers to outbound-only nodes (multiaddrs, /p2p/<id>)
    relays: list[str] = bounded(max_len=MAX_ADDRS, default_factory=list)
    # seconds between the coordinator's expiry sweeps (0 = not told: assume lease_ttl_s)
    sweep_interval_s: float = bounded(ge=0.0, le=86_400.0, default=0.0)
    # the model's vocabulary (tokens; 0 = the preset's, the byte tokenizer's 256)
    vocab_size: int = bounded(ge=0, le=1 << 20, default=0)
    # sha256 of the run's tokenizer.json ("" = the byte tokenizer); the file comes from
    # `TokenizerFetch`, checked against this
    tokenizer_hash: str = bounded(max_len=64, default="")
    # layers of each stage (empty = an even split; protocol.model_config.stage_layers)
    stage_layers: list[int] = bounded(max_len=1024, default_factory=list)


@record
class PeerInfo(Message):
    """One member as others see it."""

    peer_id: str = bounded(max_len=PEER_ID_LEN)
    stage: int = bounded(ge=0)
    # libp2p multiaddrs; checked by the node entry by entry (node/peer_view.py), so one
    # bad entry costs its member, not the whole reply
    addrs: list[str] = bounded(max_len=MAX_ADDRS)
    dht_addrs: list[str] = bounded(max_len=MAX_ADDRS, default_factory=list)  # hivemind DHT
    device: str = bounded(max_len=64)
    throughput: float = bounded(ge=0.0)  # tokens/s
    deadline: float | None = bounded(ge=0.0, default=None)  # unix seconds
    # an observer (e.g. `agora export`): a member whose streams peers admit, on no stage
    # (`stage` is the run's `n_stages`); never routed to, counted or given leases
    observer: bool = False


@record
class LeaseRef(Message):
    """A lease as the holder names it."""

    lease_id: int = bounded(ge=1)
    epoch: int = bounded(ge=0)  # fencing epoch


@record
class LeaseInfo(Message):
    """A DARL lease: the holder may train on tokens `[committed, limit)` of the shard."""

    lease_id: int = bounded(ge=1)
    shard_id: int = bounded(ge=0)
    epoch: int = bounded(ge=0)  # fencing epoch; a commit must quote it
    data_epoch: int = bounded(ge=0)
    committed: int = bounded(ge=0)  # tokens of the shard committed so far
    limit: int = bounded(ge=0)  # end of the granted range (<= shard_tokens)
    shard_tokens: int = bounded(ge=1)
    expires_at: float = bounded(ge=0.0)  # unix seconds; heartbeats extend it
    state: str = bounded(max_len=16)  # active | complete | released | expired


@record
class StateRef(Message):
    """A stage's global state as its replicas name it (node.outer): the outer round and
    the state's digest."""

    round: int = bounded(ge=0)  # outer steps in the state
    digest: str = bounded(min_len=1, max_len=MAX_DIGEST_CHARS, each=digest_problem)


MAX_ACCUSED = 16  # accusations in one heartbeat
MAX_ACCUSATION_TEXT = 200  # characters of an accusation's reason


@record
class Accusation(Message):
    """A groupmate this replica caught itself in an outer round: a contribution its own
    reduction rejected as no honest replica sends it (non-finite, past the norm bounds),
    or a reducer whose part contradicts what it acknowledged. The coordinator drops a
    replica that most of its stage keeps accusing (coordinator.accuse)."""

    peer: str = bounded(min_len=1, max_len=PEER_ID_LEN)  # the accused member
    round: int = bounded(ge=0)  # the outer round of the accuser's state when it caught it
    reason: str = bounded(max_len=MAX_ACCUSATION_TEXT, default="")  # for people


MAX_WITNESSED = 64  # members one heartbeat reports work for
MAX_WITNESSED_TOKENS = 1 << 40  # tokens one entry may report


@record
class Witnessed(Message):
    """Work an adjacent member did with this one since the last report: the tokens of
    micro-batches that completed through it (a next-stage member's replies; at stage 1,
    also the forwards it served for a stage-0 member). The coordinator checks claimed
    throughput against it (coordinator.witness)."""

    peer: str = bounded(min_len=1, max_len=PEER_ID_LEN)  # the member that did the work
    tokens: int = bounded(ge=1, le=MAX_WITNESSED_TOKENS)


@record
class StageStatus(Message):
    stage: int = bounded(ge=0)
    peers: int = bounded(ge=0)
    throughput: float = bounded(ge=0.0)  # tokens/s, sum over the stage's peers
    cost: float = bounded(ge=0.0)  # relative compute cost of the stage
    attested: StateRef | None = None  # the stage's attested global state (see heartbeat)


# --- node requests and replies -----------------------------------------------------------

MAX_DEVICE_BYTES = 1 << 50  # bytes, upper bound on a reported device memory (1 PiB)


@record
class DeviceMemory(Message):
    """A joining node's device memory and the settings that size a stage's need of it
    (protocol.memory.NodeSettings): the coordinator places it only on a stage that fits."""

    total_bytes: int = bounded(ge=0, le=MAX_DEVICE_BYTES, default=0)  # bytes; 0 = unknown
    # bytes free for the stage (capped by --memory-limit); 0 = unknown: placed as before
    free_bytes: int = bounded(ge=0, le=MAX_DEVICE_BYTES, default=0)
    cuda: bool = False  # a CUDA device (its context and workspaces are counted too)
    micro_batch: int = bounded(ge=1, le=1 << 16, default=8)  # sequences per micro-batch
    seq_len: int = bounded(ge=1, le=1 << 20, default=128)  # tokens per sequence
    in_flight: int = bounded(ge=1, le=1 << 16, default=4)  # micro-batches (stage 0)
    activation_cache: int = bounded(ge=1, le=1 << 16, default=16)  # micro-batches kept
    precision: str = bounded(choices=("fp32", "bf16"), default="fp32")  # resolved
    recompute: bool = False  # activations recomputed in backward


@message("join", version=1)
class JoinRequest(Message):
    """Become a member. The identity is the signing key of the enclosing SignedRequest."""

    addrs: list[str] = bounded(
        max_len=MAX_ADDRS, each=multiaddr_problem, default_factory=list
    )  # libp2p multiaddrs
    # hivemind DHT multiaddrs of the node's outer-loop process (bootstrap for others)
    dht_addrs: list[str] = bounded(max_len=MAX_ADDRS, each=multiaddr_problem, default_factory=list)
    device: str = bounded(max_len=64, default="cpu")
    throughput: float = bounded(ge=0.0, le=1e12, default=0.0)  # measured tokens/s
    deadline: float | None = bounded(ge=0.0, default=None)  # unix seconds (batch jobs)
    stage: int | None = bounded(ge=0, default=None)  # ask for a fixed stage
    join_token: str = bounded(max_len=256, default="")  # for auth mode "token"
    # Prometheus port; not a privileged one, since Prometheus will scrape it
    metrics_port: int | None = bounded(ge=1024, le=65535, default=None)
    # ignored: the scrape target is the join's source address, so a member cannot point
    # Prometheus at another host (kept so that older nodes still decode)
    metrics_host: str | None = bounded(max_len=255, default=None)
    # join as an observer: listed in the membership view (so peers serve its data-plane
    # requests) but on no stage, never routed to, never given a lease; `stage` must be
    # unset and the reply's stage is `RunInfo.n_stages`. Auth modes apply as to any join.
    observer: bool = False
    # the device's memory (None: not reported, as by older nodes: placed without it)
    memory: DeviceMemory | None = None


@message("join.reply", version=1)
class JoinReply(Message):
    peer_id: str = bounded(max_len=PEER_ID_LEN)
    stage: int = bounded(ge=0)
    run: RunInfo
    membership_version: int = bounded(ge=0)


@message("heartbeat", version=1)
class HeartbeatRequest(Message):
    leases: list[LeaseRef] = bounded(max_len=1024, default_factory=list)  # leases held
    throughput: float | None = bounded(ge=0.0, le=1e12, default=None)  # tokens/s update
    # the node's hivemind DHT addresses, sent once when they change (None = unchanged)
    dht_addrs: list[str] | None = bounded(max_len=MAX_ADDRS, each=multiaddr_problem, default=None)
    # the global state this replica holds now (None: none yet, or no outer loop)
    state: StateRef | None = None
    # groupmates caught since the last heartbeat the coordinator answered
    accused: list[Accusation] = bounded(max_len=MAX_ACCUSED, default_factory=list)
    # work adjacent members did with this one since its last report (a few per minute)
    witnessed: list[Witnessed] = bounded(max_len=MAX_WITNESSED, default_factory=list)


@message("heartbeat.reply", version=1)
class HeartbeatReply(Message):
    stage: int = bounded(ge=0)
    moved: bool = False  # the coordinator moved this node to `stage`
    drain: bool = False  # drain: finish the round, commit, release, leave
    paused: bool = False  # the run is paused: no new leases
    renewed: list[LeaseRef] = bounded(max_len=1024, default_factory=list)
    fenced: list[LeaseRef] = bounded(max_len=1024, default_factory=list)  # drop their work
    expires_at: float = bounded(ge=0.0, default=0.0)  # unix seconds, membership expiry
    membership_version: int = bounded(ge=0, default=0)
    data_epoch: int = bounded(ge=0, default=0)
    # ranges of expired or released leases waiting for a holder (told to stage-0 nodes
    # only): a node with room asks for one at once (`LeaseAcquire(freed_only=True)`)
    freed: int = bounded(ge=0, default=0)
    # the newest state of this node's stage that a majority of the stage's replicas
    # reported (coordinator.attest); None while none is. Joiners, rebasing replicas and
    # the live export take only this state.
    attested: StateRef | None = None
    # the coordinator's signed credit for this member (`protocol.credit`, encoded): the
    # work others witnessed for it; it carries it into its outer rounds. b"": none (the
    # witness check is off, or this member is an observer)
    credit: bytes = bounded(max_len=MAX_CREDIT_BYTES, default=b"")


@message("membership", version=1)
class MembershipRequest(Message):
    since: int = bounded(ge=0, default=0)  # membership version already known
    stage: int | None = bounded(ge=0, default=None)  # only peers of this stage
    after: str = bounded(max_len=PEER_ID_LEN, default="")  # full view: the page after this id


@message("membership.reply", version=1)
class MembershipReply(Message):
    version: int = bounded(ge=0)  # the view is complete up to this version (see above)
    full: bool = False  # a page of the whole view (peer-id order), not a delta
    peers: list[PeerInfo] = bounded(max_len=MAX_PEERS_PER_PAGE, default_factory=list)
    left: list[str] = bounded(max_len=MAX_PEERS_PER_PAGE, default_factory=list)
    more: bool = False  # another page follows (delta: since=version; full: after=cursor)
    cursor: str = bounded(max_len=PEER_ID_LEN, default="")  # full view: the next `after`
    # the run's DHT bootstrap as the coordinator assigns it now: the live member, not an
    # observer, that first announced a DHT (directly reachable ones before those with
    # relay addresses only); "" when none
    dht_root: str = bounded(max_len=PEER_ID_LEN, default="")


@message("manifest.get", version=1)
class ManifestRequest(Message):
    """Answered with `protocol.corpus.Manifest`."""


@message("lease.acquire", version=1)
class LeaseAcquire(Message):
    max_tokens: int | None = bounded(ge=1, default=None)  # cap the granted range
    # only a range an expired or released lease left (else `reason="no_freed"`)
    freed_only: bool = False


@message("lease.grant", version=1)
class LeaseGrant(Message):
    lease: LeaseInfo | None = None
    reason: str = bounded(max_len=32, default="")  # why nothing was granted


@message("lease.commit", version=1)
class LeaseCommit(Message):
    lease_id: int = bounded(ge=1)
    epoch: int = bounded(ge=0)
    start: int = bounded(ge=0)  # must equal the committed offset
    end: int = bounded(ge=0)  # exclusive; start < end <= limit
    # The lineage the range rode in, recorded in the audit log (None / "" = not known,
    # e.g. no outer loop): the committing replica's stage, the outer round (outer steps)
    # of the global state that holds the range's training, and that state's digest.
    stage: int | None = bounded(ge=0, le=1023, default=None)
    round: int | None = bounded(ge=0, default=None)
    digest: str = bounded(max_len=MAX_DIGEST_CHARS, each=digest_problem, default="")


@message("lease.complete", version=1)
class LeaseComplete(Message):
    lease_id: int = bounded(ge=1)
    epoch: int = bounded(ge=0)


@message("lease.release", version=1)
class LeaseRelease(Message):
    lease_id: int = bounded(ge=1)
    epoch: int = bounded(ge=0)


@message("lease.reply", version=1)
class LeaseReply(Message):
    lease: LeaseInfo
    shard_done: bool = False  # the whole shard is committed for this data epoch


@message("shard.fetch", version=1)
class ShardFetch(Message):
    shard_id: int = bounded(ge=0)


@message("shard.data", version=1)
class ShardData(Message):
    shard_id: int = bounded(ge=0)
    sha256: str = bounded(min_len=64, max_len=64)
    data: bytes


MAX_TOKENIZER_BYTES = 32 << 20  # bytes of a tokenizer.json the coordinator serves


@message("tokenizer.fetch", version=1)
class TokenizerFetch(Message):
    """Answered with `TokenizerData` (`ErrorReply(code="not_found")` for the byte tokenizer)."""


@message("tokenizer.data", version=1)
class TokenizerData(Message):
    sha256: str = bounded(min_len=64, max_len=64)  # RunInfo.tokenizer_hash (verify it)
    data: bytes = bounded(max_len=MAX_TOKENIZER_BYTES)  # the tokenizer.json bytes


@message("leave", version=1)
class LeaveRequest(Message):
    pass


@message("status", version=1)
class StatusRequest(Message):
    pass


@message("status.reply", version=1)
class StatusReply(Message):
    run_id: str = bounded(max_len=128)
    membership_version: int = bounded(ge=0)
    paused: bool
    peers: int = bounded(ge=0)
    stages: list[StageStatus] = bounded(max_len=1024)
    leases: dict[str, int] = bounded(max_len=16)  # lease state -> count (live view)
    shards: dict[str, int] = bounded(max_len=16)  # shard state -> count, this data epoch
    data_epoch: int = bounded(ge=0)
    committed_tokens: int = bounded(ge=0)  # this data epoch
    epoch_tokens: int = bounded(ge=0)  # tokens in one data epoch
    tokens_per_s: float = bounded(ge=0.0)  # recent commit rate
    eta_s: float | None = bounded(ge=0.0, default=None)  # to the end of this data epoch
    uptime_s: float = bounded(ge=0.0, default=0.0)
    # circuit-relay v2 hops for outbound-only nodes, asked before they can join (multiaddrs)
    relays: list[str] = bounded(max_len=MAX_ADDRS, default_factory=list)
    observers: int = bounded(ge=0, default=0)  # live observers (not in `peers` or `stages`)


# --- admin -------------------------------------------------------------------------------


@message("admin.drain", version=1)
class AdminDrain(Message):
    admin_token: str = bounded(max_len=256)
    peer_id: str = bounded(max_len=PEER_ID_LEN)


@message("admin.ban", version=1)
class AdminBan(Message):
    admin_token: str = bounded(max_len=256)
    peer_id: str = bounded(max_len=PEER_ID_LEN)


@message("admin.pause", version=1)
class AdminPause(Message):
    admin_token: str = bounded(max_len=256)
    paused: bool = True


REQUEST_TYPES: tuple[type[Message], ...] = (
    JoinRequest,
    HeartbeatRequest,
    MembershipRequest,
    ManifestRequest,
    LeaseAcquire,
    LeaseCommit,
    LeaseComplete,
    LeaseRelease,
    ShardFetch,
    LeaveRequest,
    StatusRequest,
    AdminDrain,
    AdminBan,
    AdminPause,
)
