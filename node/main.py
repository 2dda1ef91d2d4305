"""`agora-node`: run a training peer."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("agora-node: not yet available (the pipeline issue delivers it)", file=sys.stderr)
    return 2
