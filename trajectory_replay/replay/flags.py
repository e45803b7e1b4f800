"""The setting the stage table's conditions ask (`bundle.stage_io.Setting`) for a bundle's config: the config, and
the flags of the advantage estimator it names.

A built-in estimator's flags are read from the table's declaration without loading any kernel, so the commands
that run without torch (`validate`, the capture writer process) stay without it for them. Any other estimator's
flags are those of the kernel replay resolves for it (`replay.registry`, honouring the kernel a stage contract
pins), which loads that plugin; an estimator replay cannot resolve has no conditional entry (replay then refuses it,
naming the field). Every module that asks the table (capture's contracts, validate, the plan, the runner, the
stages) gets its setting from here or from the kernels a plan resolved, so they give one answer for a plugin.
"""

from __future__ import annotations

import warnings

from trajectory_replay.bundle.schema import Manifest, RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import BUILTIN_ESTIMATOR_FLAGS, EstimatorFlags, Setting
from trajectory_replay.errors import UnsupportedError

_ESTIMATOR_STAGES = {StageId.REWARD_POST_PROCESS, StageId.ADVANTAGE_ESTIMATE}
"""The stages that compute with the estimator (those whose contracts may pin its kernel)."""


def estimator_flags(config: RecomputeConfig, manifest: Manifest | None = None) -> EstimatorFlags:
    """The flags of the estimator `config` names, as replay would resolve it for the bundle of `manifest`."""
    name = config.advantage_estimator
    pinned = manifest is not None and any(
        c.kernel is not None and c.kernel.name == name for c in manifest.stage_contracts.values()
    )
    if name in BUILTIN_ESTIMATOR_FLAGS and not pinned:
        return BUILTIN_ESTIMATOR_FLAGS[name]
    from trajectory_replay.replay.registry import resolve_kernels  # a plugin: its kernel, and torch, load

    try:
        with warnings.catch_warnings():  # a version mismatch is warned about by the replay that computes with it
            warnings.simplefilter("ignore", RuntimeWarning)
            return resolve_kernels(config, manifest, _ESTIMATOR_STAGES).estimator.flags
    except UnsupportedError:
        return EstimatorFlags()


def setting(config: RecomputeConfig, manifest: Manifest | None = None) -> Setting:
    """The setting the stage table's conditions ask under `config` (for the bundle of `manifest`)."""
    return Setting(config, estimator_flags(config, manifest))


__all__ = ["estimator_flags", "setting"]
