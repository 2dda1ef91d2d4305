"""Checks a multiaddr's text form before anyone stores or dials it.

Addresses come from other participants (a join, a heartbeat), so they are validated at
the coordinator's edge, once, with a strict grammar: `/proto[/value]` components from a
fixed list, each value checked (IP addresses, ports, DNS names, base58 peer ids), at
most `MAX_COMPONENTS` components and `MAX_CHARS` characters; a member announces at most
`MAX_ADDRS` of them per list (`fit` keeps the first that pass). The bounds keep a
member's entry small, so a membership page of many members fits one reply frame. Everything accepted here is
an address py-multiaddr parses; much that it parses is refused here (exotic protocols
have no business in an Agora run).

It also holds the rules of what is announced across hosts: `expand_wildcards` turns a
listen address on 0.0.0.0 / :: into one address per interface (loopback left out when
the host has another interface), and `observed` is what the coordinator keeps of a
member's announced addresses given the source address it saw the member at: never a
wildcard, no loopback address unless the member is on the coordinator's own host, and
the observed IP (with each announced TCP port) first. Pure: no sockets, no name
resolution.
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


def owner_problem(addrs: list[str], peer_id: str) -> str | None:
    """Why `addrs` (checked multiaddrs) are not all `peer_id`'s own: each must end in
    `/p2p/<peer_id>` (after a relay's `/p2p/<relay>/p2p-circuit`, too). A node's outer
    loop runs under the node's key, so the DHT addresses it announces name the member;
    a member cannot announce another peer's DHT as its own."""
    for addr in addrs:
        parts = addr.split("/")
        if len(parts) < 3 or parts[-2] not in ("p2p", "ipfs") or parts[-1] != peer_id:
            return f"{addr[:96]!r} does not end in /p2p/ of this peer ({peer_id[:64]})"
    return None


def announce_problem(addr: object) -> str | None:
    """Why `addr` cannot be announced in place of a listen address (a port a router
    forwards, a proxy in front of the node), or None: `/ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT`
    with a real port, no wildcard IP and no `/p2p` part."""
    problem = multiaddr_problem(addr)
    if problem is not None:
        return problem
    assert isinstance(addr, str)
    parts = addr.split("/")
    if len(parts) != 5 or parts[1] not in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return f"{addr[:64]!r}: expected /ip4|ip6|dns|dns4|dns6/HOST/tcp/PORT"
    if parts[3] != "tcp" or parts[4] == "0":
        return f"{addr[:64]!r}: expected a TCP port other than 0"
    if is_wildcard(addr):
        return f"{addr[:64]!r}: 0.0.0.0 and :: cannot be dialled"
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


WILDCARD_IPS = frozenset({"0.0.0.0", "::"})  # listen-on-all addresses: never announced


def _parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an IP (an IPv4-mapped IPv6 address as its IPv4 one), or None."""
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def ip_of(addr: str) -> str | None:
    """The IP a multiaddr starts with (`/ip4/X/...` or `/ip6/X/...`), else None."""
    parts = addr.split("/")
    if len(parts) >= 3 and parts[0] == "" and parts[1] in ("ip4", "ip6"):
        return parts[2]
    return None


def is_wildcard(addr: str) -> bool:
    """An address on 0.0.0.0 or :: (a listen address, not one anybody can dial)."""
    ip = ip_of(addr)
    parsed = _parse_ip(ip) if ip is not None else None
    return parsed is not None and parsed.is_unspecified


def is_loopback(addr: str) -> bool:
    """An address on 127.0.0.0/8 or ::1 (reachable from the same host only)."""
    ip = ip_of(addr)
    return ip is not None and is_loopback_ip(ip)


def is_loopback_ip(ip: str) -> bool:
    """A bare IP (`127.0.0.1`, `::1`, `::ffff:127.0.0.1`) on loopback."""
    parsed = _parse_ip(ip)
    return parsed is not None and parsed.is_loopback


def _with_ip(addr: str, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """`addr` with its leading /ip4|ip6/X replaced by `ip`."""
    rest = addr.split("/", 3)[3] if addr.count("/") >= 3 else ""
    proto = "ip4" if ip.version == 4 else "ip6"
    return f"/{proto}/{ip}" + (f"/{rest}" if rest else "")


def expand_wildcards(addrs: list[str], interface_ips: list[str]) -> list[str]:
    """The addresses to announce for `addrs` (a host's bound listen addresses) on a host
    whose interfaces carry `interface_ips`: each address on 0.0.0.0 (::) becomes one per
    IPv4 (IPv6) interface IP, loopback and link-local ones left out unless there is no
    other; other addresses stay as they are. Order kept, duplicates dropped."""
    ips = [ip for ip in (_parse_ip(t) for t in interface_ips) if ip is not None]
    by_family: dict[int, list[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {}
    for version in (4, 6):
        family = [ip for ip in ips if ip.version == version and not ip.is_unspecified]
        usable = [ip for ip in family if not (ip.is_loopback or ip.is_link_local)]
        by_family[version] = usable or [ip for ip in family if ip.is_loopback]
    out: list[str] = []
    for addr in addrs:
        ip_text = ip_of(addr)
        ip = _parse_ip(ip_text) if ip_text is not None else None
        if ip is None or not ip.is_unspecified:
            out.append(addr)
            continue
        out.extend(_with_ip(addr, concrete) for concrete in by_family[ip.version])
    return list(dict.fromkeys(out))


def observed(addrs: list[str], source: str | None) -> list[str]:
    """What the coordinator keeps of addresses a member announced, given the `source`
    IP it saw the member's connection come from (None or not an IP: unknown).

    - Never an address on a wildcard IP (0.0.0.0, ::): nobody can dial it.
    - A member on another host (`source` not loopback) keeps no loopback address: to
      everyone else, 127.0.0.1 is themselves.
    - The observed IP with each TCP port the member announced directly on an IP of the
      same family comes first (a host behind a 1:1 NAT, as cloud machines are, knows
      only its private IP); an address already announced is not repeated.
    - At most `MAX_ADDRS`, each acceptable to `multiaddr_problem`.
    """
    src = _parse_ip(source) if source else None
    remote = src is not None and not src.is_loopback and not src.is_unspecified
    kept: list[str] = []
    seen_at: list[str] = []
    for addr in addrs:
        if multiaddr_problem(addr) is not None:
            continue
        wildcard, loop = is_wildcard(addr), is_loopback(addr)
        ip_text = ip_of(addr)
        ip = _parse_ip(ip_text) if ip_text is not None else None
        direct = ip is not None and "/p2p-circuit" not in addr
        tcp = addr.split("/")[3:4] == ["tcp"]
        if remote and src is not None and direct and tcp and ip is not None:
            if ip.version == src.version:  # the observed IP speaks this family
                seen_at.append(_with_ip(addr, src))
        if wildcard or (remote and loop):
            continue
        kept.append(addr)
    out = [a for a in dict.fromkeys(seen_at + kept) if multiaddr_problem(a) is None]
    return out[:MAX_ADDRS]
