"""Operations over a whole store root that understand bundles: ls, cp, gc, fsck, stats, import, export.

Each is a function returning a small report (`to_dict()`); the CLI prints it as text or JSON.
`walk` is the one enumeration of bundles, markers and reachable objects they all share.
"""

from trajectory_replay.ops.cp import CopyReport, copy_bundles
from trajectory_replay.ops.export import ExportReport, export_bundle
from trajectory_replay.ops.fsck import FsckReport, check_store
from trajectory_replay.ops.gc import GcReport, collect_garbage, parse_duration
from trajectory_replay.ops.importer import import_v1
from trajectory_replay.ops.ls import ListReport, list_bundles
from trajectory_replay.ops.stats import StoreStats, store_stats

__all__ = [
    "CopyReport",
    "ExportReport",
    "FsckReport",
    "GcReport",
    "ListReport",
    "StoreStats",
    "check_store",
    "collect_garbage",
    "copy_bundles",
    "export_bundle",
    "import_v1",
    "list_bundles",
    "parse_duration",
    "store_stats",
]
