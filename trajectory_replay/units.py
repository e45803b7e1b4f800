"""Sizes as people read them. One unit system everywhere a size is shown: IEC binary units (B, KiB, MiB,
GiB, TiB; powers of 1024). JSON output keeps exact byte counts."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


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


__all__ = ["UNITS", "human_bytes", "human_rate"]
