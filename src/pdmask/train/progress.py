"""Progress bars (rich) that can be switched off without changing the calling code."""

from __future__ import annotations

import contextlib


class _NullProgress(contextlib.AbstractContextManager):
    def __exit__(self, *exc):
        return False

    def add_task(self, *a, **k):
        return 0

    def update(self, *a, **k):
        pass


def make_progress(enabled: bool, console=None):
    """A ``rich.progress.Progress`` (or a no-op stand-in when ``enabled`` is False)."""
    if not enabled:
        return _NullProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, transient=False)
