"""The progress of a scan: bundles judged out of all, and the running count of divergences.

`scan_store` takes a `ScanProgress`; the default does nothing, so the Python API is silent. The CLI passes a
`RichScanProgress`, a rich bar on stderr, where `trajectory_replay.ops.progress.progress_wanted` says a bar is
wanted (as for the other store commands).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from trajectory_replay.ops.scan.verdicts import DIVERGED, Verdict

if TYPE_CHECKING:
    from rich.progress import TaskID


class ScanProgress:
    """Receives a scan's progress; this base class ignores it."""

    def start(self, total: int) -> None:
        """`total` bundles to judge."""

    def done(self, verdict: Verdict) -> None:
        """One bundle judged (replayed, read from its stored verdict, or not replayable)."""


class RichScanProgress(ScanProgress):
    """A rich bar on stderr: bundles done / total and the running count of divergences."""

    def __init__(self, console=None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("scan"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} bundles"),
            TextColumn("{task.fields[diverged]} diverged"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._task: TaskID | None = None
        self._diverged = 0
        self._lock = threading.Lock()

    def __enter__(self) -> RichScanProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()

    def start(self, total: int) -> None:
        self._task = self._bar.add_task("scan", total=total, diverged=0)

    def done(self, verdict: Verdict) -> None:
        with self._lock:
            self._diverged += verdict.status == DIVERGED
            if self._task is not None:
                self._bar.update(self._task, advance=1, diverged=self._diverged)


__all__ = ["RichScanProgress", "ScanProgress"]
