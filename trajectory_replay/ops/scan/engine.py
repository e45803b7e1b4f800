"""What the engines of `scan` share: the job their workers get, the tries a bundle has, and the contract.

An engine (`local`: a pool of worker processes on this machine, `local.py`; `ray`: one task per bundle on a Ray
cluster, `ray_engine.py`) is given a `ScanJob` and bundle names and answers one verdict per name through
`on_verdict`, as each comes: the dict of `Replayer.replay_one` (with `attempts`, the tries it took), or, for a
bundle whose worker died or failed on every try, `given_up`'s. A bundle is never silently dropped. A worker that
cannot use the store (`StorageUnavailableError`) ends the scan with the store's error: that says nothing about any
bundle, and the next bundles would meet it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trajectory_replay.ops.scan.replayer import Replayer
from trajectory_replay.ops.scan.verdicts import ERROR, ScanOptions, Verdict

ATTEMPTS = 2
"""Tries per bundle when its worker dies or its task fails: the first, and one retry on a fresh worker."""

OnVerdict = Callable[[dict[str, Any]], None]
"""Receives each verdict an engine reaches (called from the engine's thread, one verdict at a time)."""


@dataclass(frozen=True)
class ScanJob:
    """What every worker of one scan gets: the store's URL and storage options, the replay options, and the class
    that replays (`Replayer` or a subclass, importable by the workers: it travels by name)."""

    url: str
    storage_options: dict[str, Any]
    options: ScanOptions
    replayer: type[Replayer] = Replayer

    def open(self) -> Replayer:
        """The worker's replayer for this job (opens the store)."""
        return self.replayer(self.url, self.storage_options, self.options)

    @property
    def identity(self) -> tuple:
        """Equal for jobs whose replayers are interchangeable (a worker keeps one replayer per identity)."""
        return self.url, repr(sorted(self.storage_options.items())), self.options, self.replayer


class Engine(Protocol):
    """Replays bundles in workers of its own."""

    def run(self, job: ScanJob, names: Sequence[str], on_verdict: OnVerdict) -> float:
        """Replay `names` (see the module docstring); return the seconds the engine took to start."""
        ...


def given_up(name: str, reason: str, attempts: int) -> dict[str, Any]:
    """The verdict of a bundle whose worker died or failed on each of its `attempts` tries: `error`, with why."""
    return Verdict(name, ERROR, detail=f"{reason} (tried {attempts} times)", attempts=attempts).to_dict()


__all__ = ["ATTEMPTS", "Engine", "OnVerdict", "ScanJob", "given_up"]
