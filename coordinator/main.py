"""`agora-coordinator`: run the control plane."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "agora-coordinator: not yet available (the coordinator issue delivers it)", file=sys.stderr
    )
    return 2
