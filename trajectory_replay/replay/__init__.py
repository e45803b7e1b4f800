"""Offline replay: kernels, stages, the plan, selection, comparison, the runner, the report, and validate.

Pure computation over the tensors a `ReplaySource` hands over; nothing here knows about storage. The
names below are imported on first use, so `replay.validate` (which checks native bundles without torch)
can be imported without pulling in the torch-based modules.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CanonicalCase": "fixtures",
    "canonical_case": "fixtures",
    "Closure": "selection",
    "Selection": "selection",
    "group_id": "selection",
    "resolve_selection": "selection",
    "Divergence": "report",
    "ReplayReport": "report",
    "StageResult": "report",
    "PARTIAL_SELECTION": "plan",
    "PlannedStage": "plan",
    "ReplayPlan": "plan",
    "check_topology": "plan",
    "plan_replay": "plan",
    "plan_stages": "plan",
    "ReplaySource": "source",
    "STAGES": "stages",
    "Stage": "stages",
    "Tolerances": "compare",
    "resolve_tolerance": "compare",
    "execute": "runner",
    "replay": "runner",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_EXPORTS)
