"""Verdicts: the one status every command ends with, the exit code that follows from it, and the one-line error.

Owns
- `Status`, the top-level `status` of every `--json` object (README, "Commands"): pass, diverged, invalid,
  incomplete, unsupported, selection, usage, io. Its members are strings, so they serialize to JSON as the word
  and compare equal to it.
- `exit_code`, the one mapping from a status to the process's exit code, with its two documented exceptions.
- `error_status`, the status and exit code of an error (the package's own exceptions, `OSError`, the storage
  libraries', a missing PyTorch, an interrupt).
- `Outcome`, what every report a command prints has: its `status`, the `exit_code` that follows from it, and the
  `error` line a failed report is summarized by.
- `one_line`, how any message becomes the one line an error is said in.

A bottom-layer module: it imports nothing of the package but its exceptions, and no third-party library.
"""

from __future__ import annotations

from typing import Any, ClassVar

from trajectory_replay.errors import (
    BackendError,
    IncompleteBundleError,
    SelectionError,
    TrajectoryReplayError,
    UnsupportedError,
    UsageError,
)
from trajectory_replay.words import Word


class Status(Word):
    """The verdict of a command, the top-level `status` of its `--json` object."""

    PASS = "pass"
    """Everything asked was checked and held: the values matched, the bundle or store is sound."""
    DIVERGED = "diverged"
    """A replay, chain or conventions search found a value that differs; diff found two captures different."""
    INVALID = "invalid"
    """A bundle or store that is damaged or does not parse; fsck or cp that left a problem."""
    INCOMPLETE = "incomplete"
    """A bundle whose COMPLETE is missing; also an interrupted run."""
    UNSUPPORTED = "unsupported"
    """An algorithm or topology replay does not do, or a run that compared no value (never `pass`)."""
    SELECTION = "selection"
    """A path, selection, `--step`, `--critic` or `--rollout` that matches nothing, or several; a directory that
    is no bundle."""
    USAGE = "usage"
    """A malformed command line."""
    IO = "io"
    """Storage or a Ray cluster unreachable, credentials, permissions."""


EXIT_CODES: dict[Status, int] = {
    status: 0 if status is Status.PASS else 2 if status is Status.USAGE else 1 for status in Status
}
"""The exit code of each status: 0 pass, 2 a malformed command line, 1 every other verdict."""

INTERRUPTED_EXIT = 130
"""The exit code of a run interrupted by the user (128 + SIGINT, as a shell reports it)."""


def exit_code(status: Status | str, *, interrupted: bool = False, explains_incomplete: bool = False) -> int:
    """The process's exit code for `status`: `EXIT_CODES`, with the two exceptions below.

    - `interrupted`: a run stopped by Ctrl-C has status incomplete (it did not finish) but exits 130, the code a
      shell gives an interrupted program, so a script can tell an interrupt from an incomplete bundle.
    - `explains_incomplete`: a command whose job is to describe a bundle as it is (`inspect`) did that job for an
      incomplete bundle too; its status says incomplete and it exits 0, as the README documents.
    """
    status = Status(status)
    if interrupted:
        return INTERRUPTED_EXIT
    if explains_incomplete and status is Status.INCOMPLETE:
        return 0
    return EXIT_CODES[status]


STORAGE_LIBRARIES = frozenset({"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "urllib3"})
"""Packages whose own exceptions mean the storage could not be reached or refused us."""


def missing_torch(exc: BaseException) -> bool:
    """True for the ImportError of a host without PyTorch, which only the commands that do math need."""
    return isinstance(exc, ImportError) and (getattr(exc, "name", None) or "").split(".")[0] == "torch"


def _error_verdict(exc: BaseException) -> Status:
    if isinstance(exc, UsageError):
        return Status.USAGE
    if isinstance(exc, KeyboardInterrupt):
        return Status.INCOMPLETE
    if isinstance(exc, SelectionError):  # also a path that is not there, or is not a bundle
        return Status.SELECTION
    if isinstance(exc, UnsupportedError) or missing_torch(exc):
        return Status.UNSUPPORTED
    if isinstance(exc, IncompleteBundleError):
        return Status.INCOMPLETE
    if isinstance(exc, BackendError) or (isinstance(exc, OSError) and not isinstance(exc, TrajectoryReplayError)):
        return Status.IO
    if isinstance(exc, TrajectoryReplayError):
        return Status.INVALID
    if type(exc).__module__.split(".")[0] in STORAGE_LIBRARIES:
        return Status.IO
    return Status.INVALID


def error_status(exc: BaseException) -> tuple[Status, int]:
    """The status and the exit code of an error: the one place both are decided for every exception.

    A command line the parser refuses never gets here: the CLI reports it as `Status.USAGE` while parsing."""
    status = _error_verdict(exc)
    return status, exit_code(status, interrupted=isinstance(exc, KeyboardInterrupt))


QUOTE_LIMIT = 200
"""The most characters of a text taken from input (a document's field, a parser's or the system's message) that a
message quotes."""


def one_line(text: Any, limit: int | None = None) -> str:
    """`text` as one line, for a message: its lines stripped, the empty ones dropped, the others joined with '; '
    (a validation error, a server's reply); cut to `limit` characters, the last an ellipsis, when one is given."""
    line = "; ".join(part.strip() for part in str(text).splitlines() if part.strip())
    return line if limit is None or len(line) <= limit else line[: limit - 1] + "…"


class Outcome:
    """What every report a command prints has: one `status`, the `exit_code` that follows from it, and the `error`
    line a report that failed is summarized by (on stderr too where it is a `reason`).

    A report class defines `status`, and where it applies `reason` (why nothing was checked: said as the error on
    stderr, as for an error) or `failures` (the problems it found: its own report lists them, the `--json` error
    summarizes them), `to_dict` and `render_text`."""

    explains_incomplete: ClassVar[bool] = False
    """True for a report whose job is to describe an incomplete bundle (see `exit_code`)."""
    finite_json: ClassVar[bool] = False
    """True for a report whose `to_dict` renders non-finite numbers as strings: its JSON is then printed strictly,
    and a stray NaN is a bug, not output."""

    @property
    def status(self) -> Status:
        raise NotImplementedError

    @property
    def exit_code(self) -> int:
        """The exit code of `status` (`exit_code`, the one mapping)."""
        return exit_code(self.status, explains_incomplete=self.explains_incomplete)

    @property
    def reason(self) -> str | None:
        """Why the report checked nothing, one line, or None."""
        return None

    def failures(self) -> list[str]:
        """The problems the report found, one line each; empty when there are none."""
        return []

    @property
    def error(self) -> str | None:
        """The one line a failure is summarized by: the `reason`, else the first failure and how many more; None
        when there is nothing to say."""
        if self.reason:
            return self.reason
        failures = self.failures()
        if not failures:
            return None
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return one_line(failures[0]) + more

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def render_text(self) -> str:
        raise NotImplementedError


__all__ = [
    "EXIT_CODES",
    "INTERRUPTED_EXIT",
    "Outcome",
    "QUOTE_LIMIT",
    "STORAGE_LIBRARIES",
    "Status",
    "error_status",
    "exit_code",
    "missing_torch",
    "one_line",
]
