"""`Word`, the base of every enumeration whose members are words the package writes: a stage's name, a bundle's
state, a command's status.

A member is a `str` equal to its word, so it serializes to JSON as the word and compares equal to it; `str()`,
f-strings and `format()` give the word on every supported Python (3.10 has no `enum.StrEnum`, and the versions
differ on how a `str`-mixed enum formats).
"""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """An enumeration of words (see the module docstring)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


__all__ = ["Word"]
