"""Training-side capture: environment configuration, the capture manager and the hooks (see docs/capture.md).

Off by default; switched on by TRAJECTORY_REPLAY_CAPTURE=1 and TRAJECTORY_REPLAY_CAPTURE_DIR. The training thread only
snapshots and enqueues; a background thread writes bundles to the content-addressed store.
"""

import importlib
from typing import Any

_EXPORTS = {
    "CaptureConfig": "config",
    "CaptureConfigError": "config",
    "load_config": "config",
    "capture_microbatch": "hooks",
    "capture_rollout": "hooks",
    "capture_slime_rollout": "hooks",
    "capture_step_end": "hooks",
    "disable": "hooks",
    "get_manager": "hooks",
    "maybe_enable": "hooks",
    "maybe_enable_for_actor": "hooks",
    "set_manager": "hooks",
    "shutdown": "hooks",
    "slime_rollout_arguments": "hooks",
    "stats": "hooks",
    "trigger": "hooks",
    "CapturePolicy": "config",
    "TriggerSettings": "recorder",
    "CaptureManager": "manager",
    "rollout_bundle_id": "records",
    "step_bundle_id": "records",
}
"""Each public name and its module, imported on first use: the capture writer process imports this package's
record and commit modules, which must not pull in torch through the hooks."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = [
    "CaptureConfig",
    "CaptureConfigError",
    "CaptureManager",
    "capture_microbatch",
    "capture_rollout",
    "capture_slime_rollout",
    "capture_step_end",
    "disable",
    "get_manager",
    "load_config",
    "maybe_enable",
    "maybe_enable_for_actor",
    "rollout_bundle_id",
    "set_manager",
    "shutdown",
    "slime_rollout_arguments",
    "stats",
    "step_bundle_id",
    "trigger",
    "CapturePolicy",
    "TriggerSettings",
]
