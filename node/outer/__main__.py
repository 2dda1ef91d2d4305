"""`python -m node.outer --fd N`: the outer-loop process's entry point.

Started by `node.outer_link.OuterLink` as a fresh interpreter on an inherited Unix socket;
it serves `node.outer.process.OuterProcess` there and reports a crash as a `Fatal` reply
before it exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from node.outer.contract import Fatal, encode

if TYPE_CHECKING:
    from node.outer.averager import StageAverager


def main(argv: list[str] | None = None, averager_cls: type[StageAverager] | None = None) -> int:
    """Serve the outer-loop process; `averager_cls` replaces `StageAverager` (a rogue
    subclass, for `swarmlab.chaos.rogue_outer`)."""
    parser = argparse.ArgumentParser(
        prog="python -m node.outer",
        description="Outer-loop process of an Agora node: runs hivemind's DHT and averager for "
        "one stage and serves the stage process over an inherited Unix socket. "
        "Started by node.outer_link.OuterLink; not meant to be run by hand.",
    )
    parser.add_argument("--fd", type=int, required=True, help="inherited socket file descriptor")
    parser.add_argument("--log-level", default=os.environ.get("AGORA_OUTER_LOG", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s outer[%(process)d] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stage process decides when we stop

    import torch

    torch.set_num_threads(1)
    from node.outer.averager import StageAverager
    from node.outer.process import OuterProcess

    # "Could not find a group" is routine (a replica alone steps alone, and we log that
    # in one line); hivemind reports it as an ERROR with a traceback.
    logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)

    sock = socket.socket(fileno=args.fd)
    try:
        return OuterProcess(sock, averager_cls or StageAverager).serve()
    except Exception as exc:
        logging.getLogger("node.outer").exception("outer process failed")
        try:
            sock.sendall(encode(Fatal(error=f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
