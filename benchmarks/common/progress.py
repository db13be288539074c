"""The progress bar of the timing benchmarks (``benchmarks/kernels.py``, ``step.py``).

One line per bar: what is being timed now, the bar, done/total and the time elapsed.
``rich`` is imported when a bar is made, so importing this module costs nothing.

Example:
    >>> from benchmarks.common.progress import progress
    >>> bar = progress(width=20)   # use as ``with bar: task = bar.add_task(...)``
    >>> [type(c).__name__ for c in bar.columns]
    ['TextColumn', 'BarColumn', 'MofNCompleteColumn', 'TimeElapsedColumn']
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["progress"]


def progress(width: int = 40) -> Any:
    """A ``rich.progress.Progress`` whose description column is ``width`` characters wide.

    Where the output is not a terminal (a log file, the GPU command's captured output) a
    live bar draws nothing until it stops, so a run killed at its time limit would leave no
    trace of where it was: there every new description is also printed as a line with the
    seconds elapsed.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn(f"{{task.description:<{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    if sys.stdout.isatty():
        return Progress(*columns)
    started = time.perf_counter()

    class LoggedProgress(Progress):
        def update(self, task_id: Any, *args: Any, **kwargs: Any) -> None:
            text = kwargs.get("description")
            if text is not None and text != self._tasks[task_id].description:
                print(f"[{time.perf_counter() - started:8.1f} s] {text}", flush=True)
            super().update(task_id, *args, **kwargs)

    return LoggedProgress(*columns)
