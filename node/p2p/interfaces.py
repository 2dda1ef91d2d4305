"""The IP addresses of this host's network interfaces that are up, for announcing.

A node that listens on 0.0.0.0 (or ::) cannot announce that: `announce` turns its bound
listen addresses into one per interface IP (`protocol.addrs.expand_wildcards`: loopback
only when the host has no other interface). Read from psutil each time it is asked, so an
interface that comes up later is announced at the next join.
"""

from __future__ import annotations

import logging
import socket

import psutil

from protocol.addrs import expand_wildcards

log = logging.getLogger(__name__)


def interface_ips() -> list[str]:
    """IPv4 and IPv6 addresses of the interfaces that are up (IPv6 zone ids removed)."""
    try:
        stats = psutil.net_if_stats()
        table = psutil.net_if_addrs()
    except OSError as exc:  # no /proc/net, a sandbox: announce what is bound
        log.warning("p2p: cannot list network interfaces: %s", exc)
        return []
    ips: list[str] = []
    for name, entries in table.items():
        if name in stats and not stats[name].isup:
            continue
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                ips.append(str(entry.address).split("%", 1)[0])
    return ips


def announce(bound: list[str]) -> list[str]:
    """The addresses to announce for the `bound` listen addresses."""
    if not any(a.startswith(("/ip4/0.0.0.0/", "/ip6/::/")) for a in bound):
        return list(bound)
    return expand_wildcards(bound, interface_ips())
