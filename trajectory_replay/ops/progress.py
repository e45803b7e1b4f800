"""Progress of long store operations (cp, gc, fsck, export): objects and bytes, on stderr.

Operations take a `Progress` and call `phase()` / `advance()`; the default does nothing, so
the Python API is silent. The CLI passes `terminal_progress(quiet)`, a rich bar on stderr that
is shown only when both stdout and stderr are terminals and `--quiet` was not given.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported when a bar is drawn
    from rich.progress import TaskID


class Progress:
    """Receives progress; this base class ignores it (thread-safe, as operations report from pools)."""

    def phase(self, description: str, *, objects: int | None = None, nbytes: int | None = None) -> None:
        """Start a new phase with its totals (None when unknown)."""

    def advance(self, objects: int = 0, nbytes: int = 0) -> None:
        """Count objects and bytes done in the current phase."""


class RichProgress(Progress):
    """A rich progress bar on stderr: description, bar, objects done/total, bytes, rate."""

    def __init__(self, console=None) -> None:
        """`console`: a rich Console to draw on (default: stderr)."""
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        # sizes in IEC units (KiB, MiB), as everywhere else; rich's own rate column is decimal (kB/s)
        self._bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[done]}/{task.fields[objects]} objects"),
            DownloadColumn(binary_units=True),
            _rate_column(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._task: TaskID | None = None
        self._lock = threading.Lock()
        self._done = 0

    def __enter__(self) -> RichProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self._bar.stop()

    def phase(self, description: str, *, objects: int | None = None, nbytes: int | None = None) -> None:
        with self._lock:
            if self._task is not None:  # close the previous phase as done
                finished = next(t for t in self._bar.tasks if t.id == self._task)
                self._bar.update(self._task, total=finished.completed)
            self._done = 0
            self._task = self._bar.add_task(
                description, total=nbytes, done=0, objects="?" if objects is None else objects
            )

    def advance(self, objects: int = 0, nbytes: int = 0) -> None:
        with self._lock:
            if self._task is None:
                return
            self._done += objects
            self._bar.update(self._task, advance=nbytes, done=self._done)


def _rate_column():
    """A transfer-rate column in IEC units."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    from trajectory_replay.units import human_rate

    class RateColumn(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else human_rate(speed), style="progress.data.speed")

    return RateColumn()


def progress_wanted(quiet: bool) -> bool:
    """Show a bar only on a terminal: not with --quiet, nor when stdout or stderr is redirected."""
    return not quiet and sys.stdout.isatty() and sys.stderr.isatty()


@contextmanager
def terminal_progress(quiet: bool = False) -> Iterator[Progress]:
    """A rich bar on stderr when `progress_wanted(quiet)`, else the silent `Progress()`."""
    if not progress_wanted(quiet):
        yield Progress()
        return
    with RichProgress() as bar:
        yield bar


__all__ = ["Progress", "RichProgress", "progress_wanted", "terminal_progress"]
