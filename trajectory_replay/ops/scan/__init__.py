"""`scan`: replay every complete bundle of a store root and summarize, resumably.

`verdicts` (a bundle's outcome, its key and format in the store, when a stored one is trusted), `replayer` (the
worker side: one bundle replayed and judged), `engine` (what the engines share: the job, the tries, the contract),
`local` (the local engine: a pool of worker processes), `ray_engine` (the Ray engine: one task per bundle),
`progress` (the bar), `report` (what a scan found) and `driver` (`scan_store`: lists, reuses verdicts, picks the
engine, keeps verdicts).

This package re-exports the names the CLI and the Python API use.
"""

from trajectory_replay.ops.scan.driver import ENGINES, check_engine, check_workers, scan_store
from trajectory_replay.ops.scan.engine import ATTEMPTS
from trajectory_replay.ops.scan.progress import RichScanProgress, ScanProgress
from trajectory_replay.ops.scan.replayer import Replayer
from trajectory_replay.ops.scan.report import ScanReport
from trajectory_replay.ops.scan.verdicts import (
    CACHEABLE,
    REPLAY_VERSION,
    SCAN_SEMANTICS,
    VERDICT_STATUSES,
    VERDICTS_DIR,
    ScanOptions,
    Verdict,
    bundle_digest,
    verdict_key,
)

__all__ = [
    "ATTEMPTS",
    "CACHEABLE",
    "ENGINES",
    "REPLAY_VERSION",
    "Replayer",
    "RichScanProgress",
    "SCAN_SEMANTICS",
    "ScanOptions",
    "ScanProgress",
    "ScanReport",
    "VERDICTS_DIR",
    "VERDICT_STATUSES",
    "Verdict",
    "bundle_digest",
    "check_engine",
    "check_workers",
    "scan_store",
    "verdict_key",
]
