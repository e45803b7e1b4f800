"""The kernels replay can recompute with, by name: the built-in ones and those other packages register.

A config names its estimator (`advantage_estimator`), its policy loss (`policy_loss`) and its loss
aggregation (`loss_agg_mode`); `resolve_kernels` turns those names into kernels, or raises an
UnsupportedError naming the field. A framework installed beside trajectory-replay may add kernels
under the entry-point group `trajectory_replay.kernels`: each entry point's name is the kernel's name
and its object an `EstimatorKernel`, `PolicyLossKernel` or `AggregationKernel`. A stage contract that
names a kernel (`StageContract.kernel`: name and package) is replayed with exactly that package's
kernel, and fails with "kernel X from package Y is not installed" when it is absent.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

import torch

from trajectory_replay.bundle.schema import KernelRef, Manifest, RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import BUILTIN_ESTIMATOR_FLAGS, EstimatorFlags
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import estimators, losses

ENTRY_POINT_GROUP = "trajectory_replay.kernels"
BUILTIN_PACKAGE = "trajectory-replay"


@dataclass(frozen=True)
class EstimatorKernel:
    """An advantage estimator: reward post-processing and per-token advantages (and returns)."""

    name: str
    post_process: Callable[[estimators.RewardInputs], torch.Tensor]
    advantages: Callable[[estimators.AdvantageInputs], estimators.AdvantageOutputs]
    grouped: bool = True
    """Post-processing reads prompt groups: every sample needs a group_index (and group sizes are checked)."""
    needs_values: bool = False
    """Advantages read the `values` payload (and produce returns)."""
    whitened: bool = False
    """Advantages are whitened over the whole cohort: not recomputable on part of it."""
    reads_kl: bool = False
    """With kl_in_reward (and kl_coef != 0) the token rewards take the reward-side KL (`AdvantageInputs.kl`)."""

    @property
    def flags(self) -> EstimatorFlags:
        """What the stage table asks of it (`bundle.stage_io`)."""
        return EstimatorFlags(needs_values=self.needs_values, reads_kl=self.reads_kl)


def _builtin_estimator(
    name: str,
    post_process: Callable[[estimators.RewardInputs], torch.Tensor],
    advantages: Callable[[estimators.AdvantageInputs], estimators.AdvantageOutputs],
    grouped: bool = True,
    whitened: bool = False,
) -> EstimatorKernel:
    """A built-in estimator, with the flags the stage table declares for it."""
    flags = BUILTIN_ESTIMATOR_FLAGS[name]
    return EstimatorKernel(
        name,
        post_process,
        advantages,
        grouped=grouped,
        needs_values=flags.needs_values,
        whitened=whitened,
        reads_kl=flags.reads_kl,
    )


@dataclass(frozen=True)
class PolicyLossKernel:
    """A policy loss: its per-token terms over a block of whole samples."""

    name: str
    tokens: Callable[[losses.PolicyInputs], losses.PolicyLossTokens]


@dataclass(frozen=True)
class AggregationKernel:
    """A loss aggregation: per-sample weights on the masked sums, from the token counts T_i (float64)."""

    name: str
    weights: Callable[[torch.Tensor, RecomputeConfig], torch.Tensor]


Kernel = EstimatorKernel | PolicyLossKernel | AggregationKernel

BUILTIN: dict[str, Kernel] = {
    k.name: k
    for k in (
        _builtin_estimator("grpo", estimators.grpo_rewards, estimators.outcome_advantages),
        _builtin_estimator("dr_grpo", estimators.mean_baseline_rewards, estimators.outcome_advantages),
        _builtin_estimator("rloo", estimators.rloo_rewards, estimators.outcome_advantages),
        _builtin_estimator(
            "reinforce_plus_plus",
            estimators.raw_rewards,
            estimators.reinforce_plus_plus_advantages,
            grouped=False,
            whitened=True,
        ),
        _builtin_estimator(
            "reinforce_plus_plus_baseline",
            estimators.mean_baseline_rewards,
            estimators.reinforce_plus_plus_baseline_advantages,
            whitened=True,
        ),
        _builtin_estimator("gae", estimators.raw_rewards, estimators.gae_advantages, grouped=False, whitened=True),
        PolicyLossKernel("ppo_clip", losses.ppo_clip_tokens),
        PolicyLossKernel("gspo", losses.gspo_tokens),
        PolicyLossKernel("cispo", losses.cispo_tokens),
        AggregationKernel("sum_of_sample_means", losses.sum_of_sample_means_weights),
        AggregationKernel("token_mean", losses.token_mean_weights),
        AggregationKernel("seq_mean_token_mean", losses.seq_mean_token_mean_weights),
        AggregationKernel("seq_mean_token_sum", losses.seq_mean_token_sum_weights),
        AggregationKernel("seq_mean_token_sum_norm", losses.seq_mean_token_sum_norm_weights),
        AggregationKernel("seq_mean_token_sum_scaled", losses.seq_mean_token_sum_scaled_weights),
        AggregationKernel("token_sum", losses.token_sum_weights),
    )
}

_FIELDS: dict[type, str] = {
    EstimatorKernel: "advantage_estimator",
    PolicyLossKernel: "policy_loss",
    AggregationKernel: "loss_agg_mode",
}
"""The config field that names a kernel of each kind."""


@dataclass(frozen=True)
class Installed:
    """A kernel another package registered, and that package (with why it does not load, if it does not)."""

    kernel: Kernel | None
    package: str
    version: str | None = None
    broken: str | None = None


def installed_kernels() -> dict[str, list[Installed]]:
    """Every kernel registered under the entry-point group, by name (a name several packages register lists each).

    An entry point that does not load, or loads something that is not a kernel of its own name, is listed with
    the reason (`broken`) and never used: a broken plugin must not stop replay of bundles that do not use it, and
    a bundle that pins it is told why it cannot be replayed.
    """
    found: dict[str, list[Installed]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        package = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else None
        try:
            kernel = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import error of a third-party plugin
            found.setdefault(ep.name, []).append(Installed(None, package, version, f"{type(exc).__name__}: {exc}"))
            continue
        if not (isinstance(kernel, (EstimatorKernel, PolicyLossKernel, AggregationKernel)) and kernel.name == ep.name):
            found.setdefault(ep.name, []).append(
                Installed(None, package, version, f"entry point {ep.value} is not a kernel named {ep.name}")
            )
            continue
        found.setdefault(ep.name, []).append(Installed(kernel, package, version))
    return found


@dataclass(frozen=True)
class Kernels:
    """The kernels one replay computes with."""

    estimator: EstimatorKernel
    policy_loss: PolicyLossKernel
    aggregation: AggregationKernel


# the stages whose computation uses each kind of kernel (a contract's `kernel` applies to the kinds of its stage)
_STAGE_KINDS: dict[StageId, tuple[type, ...]] = {
    StageId.REWARD_POST_PROCESS: (EstimatorKernel,),
    StageId.ADVANTAGE_ESTIMATE: (EstimatorKernel,),
    StageId.LOSS_POLICY: (PolicyLossKernel, AggregationKernel),
    StageId.LOSS_VALUE: (AggregationKernel,),
}


def resolve_kernels(
    config: RecomputeConfig, manifest: Manifest | None = None, stages: set[StageId] | None = None
) -> Kernels:
    """The kernels `config` names for the stages that will run (`stages`; None: all), honouring the kernels the
    manifest's stage contracts name. UnsupportedError naming the field for an unknown name, and "kernel X from
    package Y is not installed" for a contract naming a kernel that is not."""
    pinned = _pinned(manifest, stages)
    plugins: dict[str, list[Installed]] | None = None
    chosen: dict[type, Kernel] = {}
    for kind, field in _FIELDS.items():
        name = getattr(config, field)
        used = stages is None or any(kind in _STAGE_KINDS.get(s, ()) for s in stages)
        ref = pinned.get(name)
        if ref is not None and ref.package != BUILTIN_PACKAGE:
            plugins = installed_kernels() if plugins is None else plugins
            kernel = _pinned_kernel(
                ref, [i for i in plugins.get(name, []) if _same_package(i.package, ref.package)], field, used
            )
        elif name in BUILTIN:
            kernel = BUILTIN[name]
        else:
            plugins = installed_kernels() if plugins is None else plugins
            kernel = next((i.kernel for i in plugins.get(name, []) if i.kernel is not None), None)
        if kernel is not None and not isinstance(kernel, kind):
            kernel = None
        if kernel is None:
            if used:
                known = ", ".join(k for k, v in BUILTIN.items() if isinstance(v, kind))
                raise UnsupportedError(f"unsupported {field} {name!r}: replay knows {known}")
            kernel = BUILTIN[getattr(RecomputeConfig(), field)]  # not used by any stage that runs
        chosen[kind] = kernel
    return Kernels(chosen[EstimatorKernel], chosen[PolicyLossKernel], chosen[AggregationKernel])  # type: ignore[arg-type]


def _pinned_kernel(ref: KernelRef, match: list[Installed], field: str, used: bool) -> Kernel | None:
    """The installed kernel a contract pins; UnsupportedError when it is needed and absent or does not load. A
    version other than the pinned one is used with a warning: it may compute differently."""
    if not match:
        if used:
            raise UnsupportedError(
                f"kernel {ref.name} from package {ref.package} is not installed "
                f"(named by the bundle's stage contract; {field}={ref.name!r})"
            )
        return None
    found = match[0]
    if found.kernel is None:
        if used:
            raise UnsupportedError(
                f"kernel {ref.name} from package {ref.package} is installed but does not load: {found.broken}"
            )
        return None
    if used and ref.version is not None and found.version != ref.version:
        warnings.warn(
            f"kernel {ref.name}: the bundle was produced with {ref.package} {ref.version}, "
            f"replaying with {found.version}",
            RuntimeWarning,
            stacklevel=3,
        )
    return found.kernel


def _pinned(manifest: Manifest | None, stages: set[StageId] | None) -> dict[str, KernelRef]:
    """The kernels the contracts of the running stages name, by kernel name."""
    if manifest is None:
        return {}
    return {
        c.kernel.name: c.kernel
        for s, c in manifest.stage_contracts.items()
        if c.kernel is not None and (stages is None or s in stages)
    }


def _same_package(a: str, b: str) -> bool:
    """Distribution names compare normalized (PEP 503: case, and runs of -, _ and . alike)."""
    import re

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    return norm(a) == norm(b)


__all__ = [
    "AggregationKernel",
    "BUILTIN",
    "BUILTIN_PACKAGE",
    "ENTRY_POINT_GROUP",
    "EstimatorKernel",
    "Installed",
    "Kernel",
    "Kernels",
    "PolicyLossKernel",
    "installed_kernels",
    "resolve_kernels",
]
