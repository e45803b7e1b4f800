"""Offline replay: kernels, stages and capability matrix, selection, comparison, the runner and the report.

Pure computation over the tensors a `ReplaySource` hands over; nothing here knows about storage.
"""

from trajectory_replay.replay.compare import Tolerances, resolve_tolerance
from trajectory_replay.replay.fixtures import CanonicalCase, canonical_case
from trajectory_replay.replay.report import Divergence, ReplayReport, StageResult
from trajectory_replay.replay.runner import PARTIAL_SELECTION, replay
from trajectory_replay.replay.selection import Closure, Selection, group_id, resolve_selection
from trajectory_replay.replay.source import ReplaySource
from trajectory_replay.replay.stages import STAGES, PlannedStage, Stage, check_topology, plan_stages

__all__ = [
    "CanonicalCase", "Closure", "Divergence", "PARTIAL_SELECTION", "PlannedStage", "ReplayReport", "ReplaySource",
    "STAGES", "Selection", "Stage", "StageResult", "Tolerances", "canonical_case", "check_topology", "group_id",
    "plan_stages", "replay", "resolve_selection", "resolve_tolerance",
]
