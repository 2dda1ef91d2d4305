"""The data-plane attackers of `agora chaos --hostile`: a rogue that joins the run as a
member and abuses what membership lets it do, over the real `Libp2pTransport`.

Run as `python -m swarmlab.chaos.member_attacks --coordinator HOST:PORT --attack NAME
--victim PEER_ID --hold SECONDS --json OUT`. Attacks:

- `poison_backward`: the rogue joins stage 1 and answers every Forward it is routed with
  a Backward whose gradient decodes to NaN or Inf. Defended when the senders stop using
  it: each poisoned reply counts against the rogue (ban with doubling back-off), so it
  gets at most `poison_bound(hold)` forwards instead of one per micro-batch;
- `oversized_forward`: the rogue joins stage 0 and sends the stage-1 victim Forwards of
  far more rows than a micro-batch, under the predictable ids of other senders'
  micro-batches. Defended when they are refused (a row cap);
- `forged_export` (`agora chaos --byzantine`): the rogue joins `--stage` and serves, over
  the real `/agora/state/1` server, a forged state of the stage (every weight
  `FORGED_VALUE`, round `FORGED_ROUND`): the newest round any replica serves, for an
  `agora export --coordinator` run meanwhile. Defended when that export takes the stage's
  attested state instead, which the caller checks.

Whether the honest nodes kept training meanwhile is judged by the caller
(`swarmlab.chaos.hostile`), from the coordinator and the probe.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any

import trio

from node.coordinator_client import CoordinatorClient, CoordinatorError, CoordinatorUnavailable
from node.p2p.host import Libp2pTransport
from node.p2p.transport import P2PConfig
from protocol import control as c
from protocol.errors import ProtocolError
from protocol.identity import NodeKey
from protocol.message import Message
from protocol.pinning import parse_address
from protocol.pipeline import FORWARD_PROTOCOL, Backward, Forward
from protocol.state import STATE_PROTOCOL
from swarmlab.chaos.control_wire import write_outcome
from swarmlab.chaos.rogue import MEMBER_WAIT_S, REQUEST_S, encoded, forward, send
from swarmlab.chaos.schedule import FORGED_ROUND

log = logging.getLogger("agora.chaos.member_attacks")

OVERSIZED_ROWS = 512  # rows of an oversized Forward (a micro-batch has 8)
GUESSED_IDS = ("1.0.0", "1.1.0", "2.0.0", "2.1.0", "3.0.0", "3.0.8192")  # other senders' ids
IN_FLIGHT = 8  # micro-batches a stage-0 node may have in flight to one peer at once
FORGED_VALUE = 1e3  # every weight of the state `forged_export` serves


def poison_bound(hold_s: float, senders: int = 2, ban_base_s: float = 2.0) -> int:
    """Forwards a poisoning stage-1 member can get in `hold_s` from `senders` stage-0
    nodes that ban it after each poisoned reply (first ban `ban_base_s`, doubling): the
    micro-batches already in flight, then one per ban."""
    bans = math.ceil(math.log2(max(hold_s, ban_base_s) / ban_base_s)) + 1
    return senders * (IN_FLIGHT + bans)


async def _leave(client: CoordinatorClient) -> None:
    await client.aclose()  # a cancelled heartbeat may have left a reply unread
    with trio.move_on_after(REQUEST_S):
        try:
            await client.leave()
        except (CoordinatorError, CoordinatorUnavailable) as exc:
            log.info("leave failed (the lease TTL will do): %s", exc)


async def poison_backward(host: str, port: int, run: c.RunInfo, hold_s: float) -> dict[str, Any]:
    key = NodeKey.generate()
    transport = Libp2pTransport(key, P2PConfig())
    got: list[float] = []
    t0 = trio.current_time()

    async def answer(remote: str, msg: Message) -> Message:
        if not isinstance(msg, Forward):
            raise ProtocolError(f"expected a Forward, got {msg.TYPE}")
        got.append(round(trio.current_time() - t0, 2))
        shape = list(msg.hidden.shape)
        bad = math.nan if len(got) % 2 else math.inf
        return Backward(
            mb_id=msg.mb_id, grad=encoded(run, shape, bad=bad), loss=1.0, tokens=shape[0] * shape[1]
        )

    transport.set_handler(FORWARD_PROTOCOL, answer)
    async with transport.run(), CoordinatorClient(host, port, key) as client:
        await client.join(c.JoinRequest(addrs=transport.listen_addrs, stage=1))
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.heartbeat_loop, list)
            await trio.sleep(hold_s)
            nursery.cancel_scope.cancel()
        await _leave(client)
    bound = poison_bound(hold_s)
    return {
        "peer_id": key.peer_id, "forwards": len(got), "at_s": got[:50], "bound": bound,
        "defended": (0 < len(got) <= bound) if got else None,
        "expect": f"routed to at most {bound} times in {hold_s:.0f} s (each poisoned reply bans it)",
    }  # fmt: skip


async def oversized_forward(
    host: str, port: int, run: c.RunInfo, victim: str, hold_s: float
) -> dict[str, Any]:
    key = NodeKey.generate()
    transport = Libp2pTransport(key, P2PConfig())
    out: dict[str, Any] = {"peer_id": key.peer_id}
    async with transport.run(), CoordinatorClient(host, port, key) as client:
        await client.join(c.JoinRequest(addrs=transport.listen_addrs, stage=0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.heartbeat_loop, list)
            view = await client.membership()
            if victim not in view.peers:
                raise SystemExit(f"member_attacks: victim {victim} is not a member")
            addrs = list(view.peers[victim].addrs)
            deadline = trio.current_time() + MEMBER_WAIT_S
            while (await send(transport, victim, addrs, forward(run))).get(
                "reason"
            ) == "not_member":
                if trio.current_time() > deadline:
                    raise SystemExit("member_attacks: the victim never saw us as a member")
                await trio.sleep(0.3)
            replies = []
            for mb_id in GUESSED_IDS:
                msg = forward(run, rows=OVERSIZED_ROWS, mb_id=mb_id)
                replies.append(await send(transport, victim, addrs, msg))
            out["replies"] = replies
            out["after"] = await send(transport, victim, addrs, forward(run))
            nursery.cancel_scope.cancel()
        await _leave(client)
    out["defended"] = all(r["outcome"] != "answered" for r in out["replies"])
    out["expect"] = f"Forwards of {OVERSIZED_ROWS} rows refused (more than a micro-batch)"
    return out


async def forged_export(
    host: str, port: int, run: c.RunInfo, stage: int, hold_s: float
) -> dict[str, Any]:
    import torch

    from node.checkpoint import GlobalState
    from node.export_live import model_config, stage_layout
    from node.state_server import StateServer
    from node.worker import TorchWorker

    key = NodeKey.generate()
    numel = stage_layout(model_config(run), stage, run.n_stages).numel
    server = StateServer(
        TorchWorker(), run_id=run.run_id, stage=lambda: stage, params=list, outer=True
    )
    server.hold(GlobalState(
        theta_g=torch.full((numel,), FORGED_VALUE), momentum=torch.zeros(numel),
        round=FORGED_ROUND,
    ))  # fmt: skip
    transport = Libp2pTransport(key, P2PConfig())
    transport.set_handler(STATE_PROTOCOL, server.handle)
    async with transport.run(), CoordinatorClient(host, port, key) as client:
        await client.join(c.JoinRequest(addrs=transport.listen_addrs, stage=stage))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.heartbeat_loop, list)
            await trio.sleep(hold_s)
            nursery.cancel_scope.cancel()
        await _leave(client)
    return {
        "peer_id": key.peer_id, "stage": stage, "round": FORGED_ROUND,
        "chunks_served": server.served_chunks, "defended": None,  # the exporter judges
        "expect": "an export meanwhile takes the stage's attested state, not this one",
    }  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    address = parse_address(args.coordinator)
    host, port = address.host, address.port
    async with CoordinatorClient.to(address, NodeKey.generate()) as client:
        run = (await client.join(c.JoinRequest(observer=True))).run
        await client.leave()
    if args.attack == "poison_backward":
        return await poison_backward(host, port, run, args.hold)
    if args.attack == "forged_export":
        return await forged_export(host, port, run, args.stage, args.hold)
    return await oversized_forward(host, port, run, args.victim, args.hold)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m swarmlab.chaos.member_attacks",
        description="Play one data-plane attack as a member (for agora chaos --hostile and"
        " --byzantine).",
    )
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument(
        "--attack", required=True,
        choices=("poison_backward", "oversized_forward", "forged_export"),
    )  # fmt: skip
    p.add_argument("--stage", type=int, default=0, help="the stage forged_export joins")
    p.add_argument("--victim", default="", help="peer id of a stage-1 node (oversized_forward)")
    p.add_argument(
        "--hold", type=float, default=10.0,
        help="seconds poison_backward and forged_export serve",
    )  # fmt: skip
    p.add_argument("--json", required=True, help="write the outcome here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s member_attacks: %(message)s")
    return write_outcome(
        args.json,
        lambda: trio.run(main_async, args),
        (CoordinatorError, CoordinatorUnavailable, OSError),
    )


if __name__ == "__main__":
    sys.exit(main())
