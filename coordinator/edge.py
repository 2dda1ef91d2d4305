"""The control plane's edge accounting, before any byte is trusted: token buckets (per
source host, per key), concurrent connections per source host, and the global budget of
bytes buffered in partially received frames. Pure and clock-free (callers pass `now`).

Sources are counted by `host_key`: an IPv4 address, or the /64 network of an IPv6
address (one subscriber usually holds a whole /64, so counting single IPv6 addresses
would give each attacker billions of buckets).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Hashable


def host_key(host: str) -> str:
    """The unit a source address is counted in: the IPv4 address, or the IPv6 /64."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


class RateLimiter:
    """Token bucket per key; idle buckets are dropped by `prune`. A `rate` of 0 admits
    everything (no buckets are kept). A bucket is two floats in two dicts rather than a
    list per key: dicts of str/bytes keys and float values are not tracked by Python's
    cyclic GC, so a bucket per peer adds nothing to what a full collection scans."""

    __slots__ = ("_stamp", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst  # requests/s, requests
        self._tokens: dict[Hashable, float] = {}  # requests left at the last request
        self._stamp: dict[Hashable, float] = {}  # unix seconds of the last request

    def allow(self, key: Hashable, now: float) -> bool:
        if self.rate <= 0:
            return True
        last = self._stamp.get(key)
        self._stamp[key] = now
        if last is None:
            self._tokens[key] = self.burst - 1
            return True
        tokens = min(self.burst, self._tokens[key] + (now - last) * self.rate)
        if tokens < 1:
            self._tokens[key] = tokens
            return False
        self._tokens[key] = tokens - 1
        return True

    def prune(self, now: float) -> None:
        if self.rate <= 0:
            return
        full = self.burst / self.rate
        self._stamp = {k: t for k, t in self._stamp.items() if now - t < full}
        self._tokens = {k: self._tokens[k] for k in self._stamp}

    def __len__(self) -> int:
        return len(self._stamp)


class HostConnections:
    """Open connections per source host, capped at `per_host`."""

    __slots__ = ("_open", "per_host")

    def __init__(self, per_host: int) -> None:
        self.per_host = per_host  # connections
        self._open: dict[str, int] = {}

    def enter(self, host: str) -> bool:
        """Count a new connection from `host`; False (not counted) over the cap."""
        n = self._open.get(host, 0)
        if n >= self.per_host:
            return False
        self._open[host] = n + 1
        return True

    def leave(self, host: str) -> None:
        n = self._open.get(host, 0) - 1
        if n > 0:
            self._open[host] = n
        else:
            self._open.pop(host, None)

    def count(self, host: str) -> int:
        return self._open.get(host, 0)


class ByteBudget:
    """The bytes all connections hold in partial frames, bounded by `limit`."""

    __slots__ = ("limit", "total")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes
        self.total = 0  # bytes held now

    def resize(self, held: int, want: int) -> bool:
        """Move one connection's holding from `held` to `want` bytes. False (nothing
        changed) when growing would pass the limit: the caller drops the connection
        and then calls `resize(held, 0)`."""
        if want > held and self.total + want - held > self.limit:
            return False
        self.total += want - held
        return True
