"""Training-side capture: environment configuration, the capture manager and the hooks (see docs/capture.md).

Off by default; switched on by RELAX_REPLAY_CAPTURE=1 and RELAX_REPLAY_CAPTURE_DIR. The training thread only
snapshots and enqueues; a background thread writes bundles to the content-addressed store.
"""

from trajectory_replay.capture.config import CaptureConfig, CaptureConfigError, load_config
from trajectory_replay.capture.hooks import (
    capture_microbatch, capture_rollout, capture_slime_rollout, capture_step_end, disable, get_manager, maybe_enable,
    maybe_enable_for_actor, set_manager, shutdown, slime_rollout_arguments, stats,
)
from trajectory_replay.capture.manager import CaptureManager
from trajectory_replay.capture.records import rollout_bundle_id, step_bundle_id

__all__ = [
    "CaptureConfig", "CaptureConfigError", "CaptureManager", "capture_microbatch", "capture_rollout",
    "capture_slime_rollout", "capture_step_end", "disable", "get_manager", "load_config", "maybe_enable",
    "maybe_enable_for_actor", "rollout_bundle_id", "set_manager", "shutdown", "slime_rollout_arguments", "stats",
    "step_bundle_id",
]
