"""`GroupRoundHost`: what the averaging schemes' mixins read of `StageAverager`.

Both schemes (`node.outer.all_gather`, `node.outer.reduce_scatter`) run inside hivemind's
averager process and keep their running rounds in a `node.outer.round_book.RoundBook`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hivemind.compression import CompressionBase
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from node.diloco import DilocoConfig
from node.outer.credit import credit_caps, credited_rates
from node.outer.parts import group_claims

log = logging.getLogger(__name__)


class GroupRoundHost:
    """Attributes the averager provides to the scheme mixins (set in its `__init__`)."""

    peer_id: PeerID
    prefix: str
    _p2p: Any
    _averaged_tensors: Any
    _wire: CompressionBase
    _diloco: DilocoConfig
    _exchange_timeout: float  # s: the most one round's exchange may take
    # (run id, stage) that members' credits must name; None: credits are not read
    _credit_scope: tuple[str, int] | None
    get_stub: Any  # hivemind's ServicerBase.get_stub (a classmethod)

    def _group_claims(
        self, peers: list[PeerID], gathered: dict[PeerID, dict[str, Any]]
    ) -> tuple[int, list[int], list[int]]:
        """`node.outer.parts.group_claims` over `peers`, each member's tokens bounded by
        what its coordinator credit backs (`node.outer.credit`)."""
        metas = [gathered[p] for p in peers]
        caps = None
        if self._credit_scope is not None and self._diloco.credit_slack > 0:
            run, stage = self._credit_scope
            names = [p.to_base58() for p in peers]
            rates = credited_rates([g["credit"] for g in metas], names, run=run, stage=stage)
            caps = credit_caps([int(g["tokens"]) for g in metas], rates, self._diloco.credit_slack)
        head, stale, counted = group_claims(metas, self._diloco.max_token_ratio, caps)
        for p, g, n, cap in zip(peers, metas, counted, caps or [None] * len(peers), strict=True):
            if cap is not None and n == cap < int(g["tokens"]):
                log.info("credit: %s counts %d of the %d tokens it claims", p, n, g["tokens"])
        return head, stale, counted

    async def _dial_group(self, gathered: dict[PeerID, dict[str, Any]], timeout: float) -> None:
        """Dial the groupmates whose peer ids sort after ours at the addresses they
        announced in their gathered metadata, for up to `timeout` (s). The p2p daemon
        keeps only a few bootstrap connections and finds other peers through its DHT,
        which may not know a groupmate yet (a dial then fails with "routing: not found",
        or hangs); a groupmate already connected costs nothing. One side of each pair
        dials: when both did at once, a push sometimes stalled or lost its reply on a
        connection the daemons were replacing (`_push` resends those). Addresses are a
        member's own claim: a dial proves the peer id (Noise), and one that fails costs
        only that member's pushes."""

        await asyncio.gather(
            *(
                self._dial_at(p, g["addrs"], timeout)
                for p, g in gathered.items()
                if p.to_bytes() > self.peer_id.to_bytes() and g["addrs"]
            )
        )

    async def _dial_at(self, peer: PeerID, addrs: list[str], timeout: float) -> None:
        """Connect to `peer` at `addrs` (checked multiaddrs without /p2p/), for up to
        `timeout` (s); a failure is logged and costs nothing else (already connected:
        nothing to do)."""
        try:
            maddrs = [Multiaddr(a) for a in addrs]
            await asyncio.wait_for(self._p2p._client.connect(peer, maddrs), timeout)
        except Exception as exc:
            log.info("dialing %s at its announced addresses failed: %r", peer, exc)
