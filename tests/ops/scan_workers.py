"""Replayers for the scan tests, which the workers of a scan import by name: ones whose worker dies on a chosen
bundle (every time, or once), one that is slow; and the CLI whose scans replay with one of them. Nothing here
imports torch."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from trajectory_replay.ops.scan import Replayer


class DyingReplayer(Replayer):
    """Leaves with exit code 17 as it is about to replay bundle DIE_ON, as a worker killed mid-replay would."""

    DIE_ON = "s-1-1"

    def replay_one(self, name: str) -> dict[str, Any]:
        if name == self.DIE_ON:
            os._exit(17)
        return super().replay_one(name)


class DiesOnceReplayer(DyingReplayer):
    """Dies as DyingReplayer does, the first time only: it leaves a file next to the store root (a local path) as
    it goes, and replays the bundle when the file is there."""

    def replay_one(self, name: str) -> dict[str, Any]:
        if name == self.DIE_ON:
            try:
                os.close(os.open(f"{self.url}.died-{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return Replayer.replay_one(self, name)
        return super().replay_one(name)


class SlowReplayer(Replayer):
    """Sleeps SECONDS before each bundle (a scan long enough to be interrupted mid-run)."""

    SECONDS = 0.4

    def replay_one(self, name: str) -> dict[str, Any]:
        time.sleep(self.SECONDS)
        return super().replay_one(name)


def slow_cli() -> None:
    """The `trajectory-replay` command, whose scans replay with SlowReplayer."""
    import trajectory_replay.ops.scan as scan
    from trajectory_replay.cli import main

    scan.scan_store = functools.partial(scan.scan_store, replayer=SlowReplayer)
    main()
