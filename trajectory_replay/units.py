"""Sizes and report lines as people read them. One unit system everywhere a size is shown: IEC binary units (B,
KiB, MiB, GiB, TiB; powers of 1024). JSON output keeps exact byte counts. A human report fits the terminal it is
shown on: long lines wrap under their value column, table cells too wide for theirs end in an ellipsis."""

from __future__ import annotations

import shutil
import sys
import textwrap

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
MIN_WIDTH = 40
"""Narrower terminals get reports this wide: below it no table column is readable anyway."""


def human_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB ('696 B')."""
    value = float(n)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in UNITS[1:]:
        value /= 1024
        if abs(round(value, 1)) < 1024 or unit == UNITS[-1]:  # never '1024.0 KiB'
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def human_rate(bytes_per_second: float) -> str:
    """A transfer rate in the same units: '12.3 MiB/s'."""
    return f"{human_bytes(bytes_per_second)}/s"


def report_width() -> int | None:
    """The columns a human report may fill on the terminal it is shown on (COLUMNS, else the terminal's own width);
    None (no limit) when stdout is not a terminal, so that piped text keeps whole lines for the tools reading it."""
    try:
        if not sys.stdout.isatty():
            return None
    except (AttributeError, ValueError):  # a closed or replaced stdout
        return None
    return max(shutil.get_terminal_size().columns, MIN_WIDTH)


def clip(text: str, width: int | None) -> str:
    """`text` cut to `width` characters, the last an ellipsis; whole when it fits or `width` is None."""
    if width is None or len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + "…"


def fit(line: str, width: int | None, indent: int) -> list[str]:
    """`line` as lines of at most `width` characters, continuations indented by `indent` (under the value column
    of a `label  value` line); a word longer than a line is cut. One line when it fits or `width` is None."""
    if width is None or len(line) <= width:
        return [line]
    return textwrap.wrap(line, width, subsequent_indent=" " * min(indent, width // 2), break_on_hyphens=False)


__all__ = ["MIN_WIDTH", "UNITS", "clip", "fit", "human_bytes", "human_rate", "report_width"]
