"""The live export's progress bar: bytes of each stage's state downloaded, on stderr."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (stage, elements done, elements in all, round, peer id)
ProgressFn = Callable[[int, int, int, int, str], None]


def download_bar() -> tuple[Any, ProgressFn]:
    """A rich progress bar (use it as a context) and the download hook that advances it:
    one line per stage, in bytes of fp32 state."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    tasks: dict[int, Any] = {}

    def hook(stage: int, done: int, total: int, round_: int, peer_id: str) -> None:
        desc = f"stage {stage} round {round_} from ...{peer_id[-8:]}"
        task = tasks.get(stage)
        if task is None:
            task = tasks[stage] = bar.add_task(desc, total=total * 4)
        bar.update(task, completed=done * 4, total=total * 4, description=desc)  # bytes

    return bar, hook
