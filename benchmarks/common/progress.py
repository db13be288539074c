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

from typing import Any

__all__ = ["progress"]


def progress(width: int = 40) -> Any:
    """A ``rich.progress.Progress`` whose description column is ``width`` characters wide."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(f"{{task.description:<{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
