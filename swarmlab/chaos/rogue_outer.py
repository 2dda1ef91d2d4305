"""A rogue outer-loop process: `StageAverager` with one attack from inside a stage's
averaging group, started in place of `node.outer` through `OuterLink.start(entry=...)`.

Attacks (`--attack`):
- `freeze_in_group`: the averager stops itself (SIGSTOP) as soon as its group formed,
  before it sends anything: a member that dies mid-round, at a known moment;
- `own_part_only`: as the reducer of its part it aggregates its own contribution alone,
  although it acknowledged the others', and says so in its manifest: every honest member
  whose contribution it acknowledged catches it (`own_entry_finding`);
- `scaled_delta`, `nan_delta`: it contributes its pseudo-gradient times 100, or with NaNs
  and Infs;
- `stretched_delta`: it contributes its pseudo-gradient times `STRETCH`, inside the
  median check's bound and in the honest direction: only centered clipping bounds it;
- `sign_flip`, `noise`: it contributes its pseudo-gradient negated, or random noise of the
  same norm (inside every norm bound);
- `inflated_claims`: it claims round 2**62 and 10**15 tokens in its gathered metadata;
- `dht_forgery`: before each round it stores, under every other listed member's subkey
  of the group key, "not looking for a group" with a later expiration than theirs (it
  cannot sign them: its own record validator signs its own subkey only), which would
  hide them from every leader search if the DHT kept unsigned records;
- `state_takeover`: once it holds a state, it declares state-sharing priority 2**62 in
  the DHT and serves a forged state of round 2**62 to whoever downloads one;
- `resend_late` (a fault, not an attack): it sends each reduced part once more
  `LATE_RESEND_S` after it was acknowledged, as a member does whose acknowledgement was
  lost: by then its groupmates have ended the round.

This module imports hivemind only through `node.outer` and never imports libp2p: it runs
as an outer-loop process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from swarmlab.chaos.schedule import FORGED_ROUND

ATTACKS = (
    "freeze_in_group", "own_part_only", "scaled_delta", "stretched_delta", "nan_delta",
    "sign_flip", "noise", "inflated_claims", "state_takeover", "dht_forgery", "resend_late",
)  # fmt: skip
STRETCH = 5.0  # `stretched_delta`'s factor: below the median check's 20 x, past clip_rel 2 x
FORGED_RECORD_S = 120.0  # how far ahead `dht_forgery`'s records expire (s)
LATE_RESEND_S = 2.0  # s after its acknowledgement that `resend_late` sends a part again


def rogue_averager(attack: str) -> Any:
    """The `StageAverager` subclass that runs `attack`."""
    import asyncio
    import time

    import torch

    from node.outer.averager import StageAverager
    from node.outer.parts import decode_header
    from node.outer.state_download import state_digest
    from protocol.identity import b58decode

    class Rogue(StageAverager):
        _rpc_handlers = None  # collect this class's rpc_* handlers (the same as the base's)
        _stub_type = None

        @property
        def state_sharing_priority(self) -> float:
            return float(StageAverager.state_sharing_priority.fget(self))

        @state_sharing_priority.setter
        def state_sharing_priority(self, value: float) -> None:
            if attack == "state_takeover":
                value = float(FORGED_ROUND)
            StageAverager.state_sharing_priority.fset(self, value)

        def prepare(self, members: Any) -> None:
            super().prepare(members)
            if attack == "dht_forgery" and members:
                self._forge(m for m in members if m != self.dht.peer_id.to_base58())

        def _forge(self, victims: Any) -> None:
            key = f"{self.prefix}.0b"  # hivemind's group key (no group bits)
            expiration = time.time() + FORGED_RECORD_S  # hivemind's DHT time is unix time
            for peer in victims:
                self.dht.store(key, subkey=b58decode(peer), value=False,
                               expiration_time=expiration, return_future=True)  # fmt: skip

        def get_current_state(self) -> Any:
            meta, tensors, infos = super().get_current_state()
            if attack == "state_takeover" and len(tensors) == 2:
                forged = [torch.full_like(tensors[0], 1e3), torch.zeros_like(tensors[1])]
                digest = state_digest(FORGED_ROUND, *forged)
                meta = {"round": FORGED_ROUND, "digest": digest, "lineage": []}
                return meta, forged, infos
            return meta, tensors, infos

        async def _aggregate_with_group(self, group_info: Any, *args: Any, **kwargs: Any) -> Any:
            if attack == "freeze_in_group":
                os.kill(os.getpid(), signal.SIGSTOP)
            return await super()._aggregate_with_group(group_info, *args, **kwargs)

        def step(self, *args: Any, gather: Any = None, **kwargs: Any) -> Any:
            with self.get_tensors() as tensors:  # the contribution, as the host wrote it
                if attack == "scaled_delta":
                    tensors[0].mul_(100.0)
                elif attack == "stretched_delta":
                    tensors[0].mul_(STRETCH)
                elif attack == "nan_delta":
                    tensors[0][::7] = float("nan")
                    tensors[0][3::7] = float("inf")
                elif attack == "sign_flip":
                    tensors[0].neg_()
                elif attack == "noise":
                    norm = torch.linalg.vector_norm(tensors[0])
                    noise = torch.randn_like(tensors[0])
                    tensors[0].copy_(noise * (norm / torch.linalg.vector_norm(noise)))
            if attack == "inflated_claims" and isinstance(gather, dict):
                gather = {**gather, "round": 2**62, "base_round": 2**62, "tokens": 10**15}
            return super().step(*args, gather=gather, **kwargs)

        async def _push(self, rnd: Any, gid: bytes, peer: Any, header: bytes, *rest: Any) -> bool:
            ok = bool(await super()._push(rnd, gid, peer, header, *rest))
            if attack == "resend_late" and ok:
                if decode_header(header, len(rnd.bounds)).kind == "reduced":
                    await asyncio.sleep(LATE_RESEND_S)
                    ok = bool(await super()._push(rnd, gid, peer, header, *rest))
            return ok

        def _reduce(self, contribs: dict[Any, Any], *args: Any) -> Any:
            if attack == "own_part_only" and self.peer_id in contribs:
                contribs = {self.peer_id: contribs[self.peer_id]}
            return super()._reduce(contribs, *args)

    # hivemind names its handlers after the class: honest members must reach this one
    Rogue.__name__ = Rogue.__qualname__ = StageAverager.__name__
    return Rogue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarmlab.chaos.rogue_outer",
        description="A rogue outer-loop process (one attack from inside an averaging group);"
        " started by OuterLink.start(entry=...) in chaos tools and tests.",
    )
    parser.add_argument("--attack", choices=ATTACKS, required=True)
    args, rest = parser.parse_known_args(argv)
    from node.outer.__main__ import main as outer_main

    return outer_main(rest, averager_cls=rogue_averager(args.attack))


if __name__ == "__main__":
    sys.exit(main())
