"""The settings of a node's outer-loop process: `OuterConfig`, and within it the outer
optimizer's `DilocoConfig`.

The stage process builds them (from the node's configuration), and `Init` carries them to
the outer-loop process, so they are plain torch-free data with explicit `to_wire()` /
`from_wire()`. Construction checks ranges (ValueError); decoding also checks types and
unknown keys, and raises `protocol.errors.ProtocolError` for anything malformed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field
from typing import Any

from protocol.addrs import MAX_ADDRS, announce_problem
from protocol.errors import ProtocolError

# pseudo-gradient wire codecs, by name: dense ones, and the top 1 or 3 % of each chunk of
# 4,096 values with error feedback, sent as nonzeros (node.outer.sparse)
COMPRESSIONS = ("none", "fp16", "uint8", "topk1", "topk3")
# bytes a parameter on the wire, by codec (sparse: one contribution, 4 bytes a nonzero;
# a reduced part holds up to a group's contributions' nonzeros: `exchange_s`)
WIRE_BYTES = {"none": 4.0, "fp16": 2.0, "uint8": 1.0, "topk1": 0.04, "topk3": 0.12}
# how a group averages (docs/outer-averaging.md): reduce-scatter + all-gather of compressed
# parts (bytes per replica flat in the group size), or every member sending its whole
# contribution to every other member (bytes per replica grow with the group)
AVERAGINGS = ("reduce_scatter", "all_gather")
MAX_COUNT = 2**62  # bound on integers on the wire: tokens, rounds, bytes
MAX_SETTING_STR = 1024  # characters in a str setting
# how far ahead a DHT record may expire (s): a replica's records live a round's
# matchmaking or a few seconds (node.outer.dht_records refuses any that claims longer)
MAX_RECORD_AHEAD_S = 900.0


@dataclass(kw_only=True, slots=True)
class DilocoConfig:
    """Outer optimizer settings: elastic Nesterov with a participation-adaptive step."""

    eta: float = 0.7  # outer learning rate (dimensionless)
    mu: float = 0.9  # outer Nesterov momentum (dimensionless)
    target_tokens: int = (
        0  # tokens one full round gathers over the stage group (tokens); 0 = no scaling
    )
    participation_power: float = 0.5  # p in eta_r = eta * min(1, tokens/target)^p (dimensionless)
    staleness_decay: float = 0.5  # weight multiplier per round a contribution lags (dimensionless)
    max_staleness: int = 2  # contributions lagging more rounds than this are dropped (rounds)
    max_rel_norm: float = 1.0  # reject ||delta|| > max_rel_norm * ||theta_g|| (dimensionless)
    max_median_ratio: float = (
        20.0  # with >= 3 contributions, reject norm > ratio * median (dimensionless)
    )
    clip_radius: float = (
        0.0  # centered-clipping radius tau (parameter units); 0 = plain weighted mean
    )
    clip_iters: int = 3  # centered-clipping iterations (count)
    # with clip_radius 0 and >= 3 usable contributions: centered clipping at this x the
    # median usable contribution norm (dimensionless); 0 = plain weighted mean
    clip_rel: float = 2.0
    # a member's claimed tokens count up to this x the group's median claim (dimensionless)
    max_token_ratio: float = 4.0
    # ... and, where the coordinator's credits measure the group, up to this x what its
    # credit backs: its witnessed tokens/s x the group's median claim per witnessed
    # token/s (`node.outer.credit`) (dimensionless); 0 = credits are not read
    credit_slack: float = 2.0
    # two usable contributions to a reduced part (no majority to take a median of): the
    # reducer rejects the other's when its norm passes this x its own, times their token
    # ratio when the other claims more (dimensionless); 0 = no norm bound
    pair_max_ratio: float = 4.0
    # ... or when their cosine is below this many standard deviations of two random
    # directions (sigmas / sqrt(part length)): noise, or opposed to the reducer's own
    # descent. With three or more, a contribution must reach that cosine with (m - 1) // 2
    # of the other m - 1 (`node.diloco.direction_problems`) (dimensionless); 0 = no
    # direction bound
    pair_cos_sigmas: float = 4.0

    def __post_init__(self) -> None:
        if not 0.0 < self.eta <= 10.0:
            raise ValueError(f"eta must be in (0, 10], got {self.eta}")
        if not 0.0 <= self.mu < 1.0:
            raise ValueError(f"mu must be in [0, 1), got {self.mu}")
        if self.target_tokens < 0:
            raise ValueError(f"target_tokens must be >= 0, got {self.target_tokens}")
        if not 0.0 <= self.participation_power <= 2.0:
            raise ValueError(
                f"participation_power must be in [0, 2], got {self.participation_power}"
            )
        if not 0.0 <= self.staleness_decay <= 1.0:
            raise ValueError(f"staleness_decay must be in [0, 1], got {self.staleness_decay}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_rel_norm <= 0.0 or self.max_median_ratio <= 1.0:
            raise ValueError(
                f"max_rel_norm must be > 0 and max_median_ratio > 1, got "
                f"{self.max_rel_norm} and {self.max_median_ratio}"
            )
        if self.max_token_ratio < 1.0:
            raise ValueError(f"max_token_ratio must be >= 1, got {self.max_token_ratio}")
        if not (self.credit_slack == 0.0 or 1.0 <= self.credit_slack <= 1e6):
            raise ValueError(
                f"credit_slack must be 0 (off) or in [1, 1e6], got {self.credit_slack}"
            )
        if not 0.0 <= self.clip_rel <= 1e6:
            raise ValueError(f"clip_rel must be in [0, 1e6], got {self.clip_rel}")
        if not (0.0 <= self.pair_max_ratio <= 1e6 and 0.0 <= self.pair_cos_sigmas <= 1e6):
            raise ValueError(
                f"pair_max_ratio and pair_cos_sigmas must be in [0, 1e6], got "
                f"{self.pair_max_ratio} and {self.pair_cos_sigmas}"
            )
        if 0.0 < self.pair_max_ratio < 1.0:
            raise ValueError(f"pair_max_ratio must be 0 (off) or >= 1, got {self.pair_max_ratio}")
        if self.clip_radius < 0.0 or self.clip_iters < 1:
            raise ValueError(
                f"clip_radius must be >= 0 and clip_iters >= 1, got {self.clip_radius}, {self.clip_iters}"
            )

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, obj: Any) -> DilocoConfig:
        """From a plain map; missing keys take their defaults, unknown keys are an error."""
        kwargs = _settings(cls, obj, "DilocoConfig")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"DilocoConfig: {exc}") from exc


OUTER_PROGRAM = ("-m", "node.outer")  # the outer process's own program (argv after python)


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """Settings of the outer-loop process."""

    compression: str = "fp16"  # pseudo-gradient wire codec, one of COMPRESSIONS (name)
    averaging: str = "reduce_scatter"  # group averaging scheme, one of AVERAGINGS (name)
    matchmaking_s: float = 3.0  # time to gather a group before a round (s)
    round_timeout_s: float = 10.0  # max time for the exchange once a group formed (s)
    request_timeout_s: float = 1.0  # matchmaking request timeout, < matchmaking_s (s)
    target_group_size: int = 8  # largest group of replicas averaged at once (peers)
    # DHT listen IPv4 address (IP); 0.0.0.0 = every interface, so replicas on other hosts
    # can dial it (the coordinator keeps no loopback address from another host)
    host: str = "0.0.0.0"
    port: int = 0  # DHT listen port; 0 = chosen by the OS (port number)
    # multiaddrs the DHT announces instead of its listen addresses, explicit ports
    # (a forwarded port, a proxy in front of it); empty = its listen addresses
    announce: list[str] = field(default_factory=list)
    startup_timeout_s: float = 90.0  # max time for the outer process to start its DHT (s)
    # time for a state download to find a source and start (s); the transfer itself gets
    # its bytes at min_rate_mb_s on top (`transfer_s`)
    state_timeout_s: float = 20.0
    # the slowest link an outer-loop transfer is waited for (MB/s): state downloads and a
    # round's exchange get their bytes at this rate on top of their timeouts
    min_rate_mb_s: float = 1.0
    diloco: DilocoConfig = field(default_factory=DilocoConfig)  # outer optimizer (see there)
    # what follows the Python interpreter on the outer process's command line (argv);
    # `agora chaos --byzantine` substitutes a rogue one (swarmlab.chaos.rogue_outer)
    program: tuple[str, ...] = OUTER_PROGRAM

    def transfer_s(self, numel: int) -> float:
        """Seconds a state download of a stage of `numel` parameters may take beyond its
        timeout: theta_g and m (fp32, 8 bytes a parameter) at `min_rate_mb_s`."""
        return 8 * numel / (self.min_rate_mb_s * 1e6)

    def exchange_s(self, numel: int) -> float:
        """Seconds a round's exchange may take beyond `round_timeout_s`: what one replica
        sends (as much as it receives) at `min_rate_mb_s`, 2 compressed stages with the
        reduce-scatter, one per other member of the largest group with the all-gather."""
        copies = 2 if self.averaging == "reduce_scatter" else self.target_group_size - 1
        per_param = WIRE_BYTES[self.compression]
        if self.compression.startswith("topk"):
            per_param = min(4.0, per_param * self.target_group_size)
        return copies * per_param * numel / (self.min_rate_mb_s * 1e6)

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if self.averaging not in AVERAGINGS:
            raise ValueError(f"averaging must be one of {AVERAGINGS}, got {self.averaging!r}")
        if not 0.0 < self.request_timeout_s < self.matchmaking_s:
            raise ValueError(
                f"request_timeout_s ({self.request_timeout_s}) must be in (0, matchmaking_s = "
                f"{self.matchmaking_s})"
            )
        if self.matchmaking_s * 2 + 1.0 >= MAX_RECORD_AHEAD_S:
            raise ValueError(
                f"matchmaking_s ({self.matchmaking_s}) must be < {(MAX_RECORD_AHEAD_S - 1) / 2}: "
                "a matchmaking declaration lives twice the window, and peers refuse DHT "
                f"records that expire more than {MAX_RECORD_AHEAD_S:.0f} s ahead"
            )
        if not self.program or not all(isinstance(a, str) and a for a in self.program):
            raise ValueError(f"program must be a non-empty list of arguments, got {self.program!r}")
        for name in ("round_timeout_s", "startup_timeout_s", "state_timeout_s",
                     "min_rate_mb_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        try:
            ipaddress.IPv4Address(self.host)
        except ValueError:
            raise ValueError(
                f"host must be an IPv4 address (the DHT listens on /ip4/HOST), got {self.host!r}"
            ) from None
        if len(self.announce) > MAX_ADDRS:
            raise ValueError(f"announce: at most {MAX_ADDRS} addresses, got {len(self.announce)}")
        for addr in self.announce:
            if (problem := announce_problem(addr)) is not None:
                raise ValueError(f"announce {addr!r:.80}: {problem}")
        if self.target_group_size < 1 or not 0 <= self.port < 65536:
            raise ValueError(f"bad target_group_size {self.target_group_size} or port {self.port}")

    def to_wire(self) -> dict[str, Any]:
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "diloco"
        }
        out["diloco"] = self.diloco.to_wire()
        out["program"] = list(self.program)
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> OuterConfig:
        """From a plain map (`to_wire`'s, or one written by hand); missing keys take their
        defaults, unknown keys are an error."""
        nested = {
            "diloco": DilocoConfig.from_wire,
            "announce": _str_list,
            "program": lambda o: tuple(_str_list(o)),
        }
        kwargs = _settings(cls, obj, "OuterConfig", nested=nested)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"OuterConfig: {exc}") from exc


# --- decoding helpers: every failure is a ProtocolError ---------------------------------


def finite(v: Any) -> float | None:
    """`v` as a finite float when it is an int or float that is one, else None."""
    if type(v) is int and -MAX_COUNT <= v <= MAX_COUNT:
        return float(v)
    if type(v) is float and math.isfinite(v):
        return v
    return None


def _str_list(obj: Any) -> list[str]:
    """A short list of short strings (what each one must be is the class's check)."""
    if type(obj) is not list or len(obj) > MAX_ADDRS:
        raise ProtocolError(f"expected a list of at most {MAX_ADDRS} strings")
    if any(type(v) is not str or len(v) > MAX_SETTING_STR for v in obj):
        raise ProtocolError(f"expected strings of at most {MAX_SETTING_STR} chars")
    return list(obj)


def _settings(
    cls: type, obj: Any, where: str, nested: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Keyword arguments for a settings dataclass whose fields are int, float or str (the
    type of each default), or one of `nested` (name -> decoder). Ranges are the class's
    own `__post_init__` checks."""
    nested = nested or {}
    if type(obj) is not dict:
        raise ProtocolError(f"{where}: expected a map")
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, v in obj.items():
        if key not in defaults:
            raise ProtocolError(f"{where}: unknown key {str(key)[:64]!r}")
        if key in nested:
            kwargs[key] = nested[key](v)
            continue
        kind = type(defaults[key])
        if kind is int and (type(v) is not int or not -MAX_COUNT <= v <= MAX_COUNT):
            raise ProtocolError(f"{where}: {key} must be an int")
        if kind is float and finite(v) is None:
            raise ProtocolError(f"{where}: {key} must be a finite number")
        if kind is str and (type(v) is not str or len(v) > MAX_SETTING_STR):
            raise ProtocolError(f"{where}: {key} must be a str of at most {MAX_SETTING_STR} chars")
        kwargs[key] = float(v) if kind is float else v
    return kwargs
