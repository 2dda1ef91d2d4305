"""Checks a multiaddr's text form before anyone stores or dials it.

Addresses come from other participants (a join, a heartbeat), so they are validated at
the coordinator's edge, once, with a strict grammar: `/proto[/value]` components from a
fixed list, each value checked (IP addresses, ports, DNS names, base58 peer ids), at
most `MAX_COMPONENTS` components and `MAX_CHARS` characters; a member announces at most
`MAX_ADDRS` of them per list (`fit` keeps the first that pass). The bounds keep a
member's entry small, so a membership page of many members fits one reply frame. Everything accepted here is
an address py-multiaddr parses; much that it parses is refused here (exotic protocols
have no business in an Agora run). Pure: no sockets, no name resolution.
"""

from __future__ import annotations

import ipaddress
import re

MAX_CHARS = 256  # characters in one multiaddr
MAX_ADDRS = 8  # multiaddrs in one list a member announces (listen, DHT, relays)
MAX_COMPONENTS = 12  # /proto/value pairs count one each

_BASE58 = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,128}")
# Every protocol name of the multiaddr table: py-multiaddr reads such a value as the next
# protocol, so a host name spelled like one is refused.
_ALL_PROTOCOL_NAMES = frozenset(
    "certhash dccp dns dns4 dns6 dnsaddr garlic32 garlic64 http http-path https ip4 ip6"
    " ip6zone ipcidr ipfs memory noise onion onion3 p2p p2p-circuit p2p-webrtc-direct"
    " p2p-webrtc-star p2p-websocket-star quic quic-v1 sctp sni tcp tls udp udt unix utp"
    " webrtc webrtc-direct webtransport ws wss".split()
)
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _ip4(v: str) -> bool:
    try:
        ipaddress.IPv4Address(v)
    except ValueError:
        return False
    return True


def _ip6(v: str) -> bool:
    try:
        ipaddress.IPv6Address(v)
    except ValueError:
        return False
    return "%" not in v  # no zone ids


def _port(v: str) -> bool:
    return v.isascii() and v.isdigit() and len(v) <= 5 and int(v) <= 65535


def _dns(v: str) -> bool:
    labels = v.rstrip(".").split(".")
    return (
        0 < len(v) <= 253
        and v not in _ALL_PROTOCOL_NAMES
        and all(_DNS_LABEL.fullmatch(label) for label in labels)
    )


_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _peer_id(v: str) -> bool:
    """A base58 multihash of a key: sha2-256 (code 0x12, 32 bytes) or an inlined key
    (identity, code 0x00, at most 64 bytes), as libp2p peer ids are."""
    if _BASE58.fullmatch(v) is None:
        return False
    n = 0
    for ch in v:
        n = n * 58 + _B58_ALPHABET.index(ch)
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    raw = b"\0" * (len(v) - len(v.lstrip("1"))) + raw  # leading '1's are zero bytes
    if len(raw) < 2 or len(raw) != 2 + raw[1]:
        return False
    return (raw[0] == 0x12 and raw[1] == 32) or (raw[0] == 0x00 and 0 < raw[1] <= 64)


# protocol name -> value check (None: the protocol takes no value)
_PROTOCOLS = {
    "ip4": _ip4,
    "ip6": _ip6,
    "dns": _dns,
    "dns4": _dns,
    "dns6": _dns,
    "dnsaddr": _dns,
    "tcp": _port,
    "udp": _port,
    "p2p": _peer_id,
    "ipfs": _peer_id,
    "quic": None,
    "quic-v1": None,
    "ws": None,
    "wss": None,
    "tls": None,
    "p2p-circuit": None,
}


def multiaddr_problem(addr: object) -> str | None:
    """Why `addr` is not an acceptable multiaddr, or None when it is."""
    if type(addr) is not str:
        return f"expected a string, got {type(addr).__name__}"
    if not 0 < len(addr) <= MAX_CHARS:
        return f"length {len(addr)} outside [1, {MAX_CHARS}]"
    if not addr.startswith("/") or addr.endswith("/"):
        return f"{addr[:64]!r} is not /proto/value/..."
    parts = addr[1:].split("/")
    components = 0
    i = 0
    while i < len(parts):
        name = parts[i]
        if name not in _PROTOCOLS:
            return f"{addr[:64]!r}: unknown or unsupported protocol {name[:32]!r}"
        check = _PROTOCOLS[name]
        if check is not None:
            if i + 1 >= len(parts) or not check(parts[i + 1]):
                return f"{addr[:64]!r}: bad {name} value"
            i += 1
        i += 1
        components += 1
        if components > MAX_COMPONENTS:
            return f"{addr[:64]!r}: more than {MAX_COMPONENTS} components"
    return None


def cap(addrs: list[str]) -> list[str]:
    """The first `MAX_ADDRS` of `addrs` within `MAX_CHARS` characters: what a node
    announces (a host with many interfaces lists more; the grammar is still checked by
    the coordinator, which refuses a request with a bad address)."""
    return [a for a in addrs if len(a) <= MAX_CHARS][:MAX_ADDRS]


def fit(addrs: list[str]) -> list[str]:
    """The first `MAX_ADDRS` of `addrs` that are acceptable (what a node announces, and
    what a coordinator keeps of an entry stored under older, looser bounds)."""
    return [a for a in addrs if multiaddr_problem(a) is None][:MAX_ADDRS]
