"""The stage table (`bundle.stage_io.STAGE_IO`) walked for every registered kernel and for plugin estimators that
read values or the reward-side KL: capture writes, and declares in its contracts, exactly what replay reads, and
validate, the plan, the read-ahead and the release of payloads give the same answer for each of them."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest
import torch

from tests.replay.cases import GROUPS, LENGTHS, MASKS, RAW
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.bundle.schema import RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import (
    BUILTIN_ESTIMATOR_FLAGS,
    LOSS_MASK,
    RECORDED_PAYLOADS,
    STAGE_IO,
    EstimatorFlags,
    Setting,
    payloads_of,
)
from trajectory_replay.capture import hooks
from trajectory_replay.capture.records import (
    Columns,
    MicroBatch,
    Provenance,
    RolloutRecord,
    StepRecord,
    bundle_payloads,
)
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import flags
from trajectory_replay.replay.cohort import PayloadCache
from trajectory_replay.replay.plan import plan_replay, plan_stages
from trajectory_replay.replay.registry import BUILTIN, EstimatorKernel, resolve_kernels
from trajectory_replay.replay.runner import _PassRunner, _release
from trajectory_replay.replay.stages import STAGES
from trajectory_replay.replay.validate import validate_sources

PLUGIN_MODULE = "acme_flag_kernels"
PLUGINS = {"acme_values": EstimatorFlags(needs_values=True), "acme_kl": EstimatorFlags(reads_kl=True)}
"""The plugin estimators the test distribution registers, with the flags they declare."""

PLUGIN_CODE = """
from trajectory_replay.replay import estimators
from trajectory_replay.replay.registry import EstimatorKernel

ACME_VALUES = EstimatorKernel("acme_values", estimators.raw_rewards, estimators.gae_advantages, grouped=False,
                              needs_values=True, whitened=True)
ACME_KL = EstimatorKernel("acme_kl", estimators.raw_rewards, estimators.reinforce_plus_plus_advantages,
                          grouped=False, whitened=True, reads_kl=True)
"""


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    """A distribution installed on sys.path (its dist-info and entry points, as pip lays them out) registering the
    plugin estimators."""
    site = tmp_path_factory.mktemp("site")
    (site / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_CODE)
    info = site / "acme_flag_kernels-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-flag-kernels\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[trajectory_replay.kernels]\nacme_values = acme_flag_kernels:ACME_VALUES\n"
        "acme_kl = acme_flag_kernels:ACME_KL\n"
    )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield site
    sys.path.remove(str(site))
    sys.modules.pop(PLUGIN_MODULE, None)
    importlib.invalidate_caches()


def _kernel_configs() -> list[tuple[str, dict]]:
    """(kernel name, config fields that select it) for every built-in kernel and every plugin estimator."""
    out = []
    for name, kernel in BUILTIN.items():
        field = {
            "EstimatorKernel": "advantage_estimator",
            "PolicyLossKernel": "policy_loss",
            "AggregationKernel": "loss_agg_mode",
        }[type(kernel).__name__]
        scaled = name in ("seq_mean_token_sum_norm", "seq_mean_token_sum_scaled")
        out.append((name, {field: name, **({"loss_scale_factor": 8} if scaled else {})}))
    return out + [(name, {"advantage_estimator": name}) for name in PLUGINS]


KERNELS = _kernel_configs()
SETTINGS = [  # every conditional entry of the table turned off, then on
    {"kl_coef": 0.0},
    {"kl_coef": 0.05, "kl_in_reward": True, "kl_loss_coef": 0.1, "rollout_is": "token", "entropy_coef": 0.01},
    {"kl_coef": 0.05, "kl_in_reward": True, "kl_in_score": True},
]


def _config(fields: dict, extra: dict) -> RecomputeConfig:
    return RecomputeConfig(n_samples_per_prompt=4, **{**fields, **extra})


def _tokens(seed: int) -> torch.Tensor:
    return torch.rand(sum(LENGTHS), generator=torch.Generator().manual_seed(seed)) - 0.5


def _columns() -> Columns:
    n = len(RAW)
    return Columns(
        sample_ids=[f"s-{i}" for i in range(n)],
        group_index=GROUPS,
        response_lengths=LENGTHS,
        total_lengths=[x + 2 for x in LENGTHS],
        loss_masks=MASKS,
        raw_rewards=RAW,
        rewards=RAW,
        policy_versions=[3] * n,
    )


def _hook_payloads(hook) -> list[str]:
    """The payloads a capture hook takes by name: its tensor arguments."""
    columns = {
        "sample_ids",
        "group_index",
        "response_lengths",
        "total_lengths",
        "loss_masks",
        "raw_rewards",
        "rewards",
        "micro_batch_ids",
        "policy_versions",
    }
    skip = columns | {
        "rollout_id",
        "step_id",
        "micro_batch_id",
        "config",
        "weight_lineage",
        "mismatch_metrics",
        "payloads",
    }
    return [p for p in inspect.signature(hook).parameters if p not in skip]


def _capture(config: RecomputeConfig, leave_out: str = ""):
    """The rollout- and step-level bundles capture builds when every hook argument is given (but `leave_out`)."""
    provenance = Provenance()
    rollout = {name: _tokens(i) for i, name in enumerate(_hook_payloads(hooks.capture_rollout)) if name != leave_out}
    step = {name: _tokens(i) for i, name in enumerate(_hook_payloads(hooks.capture_microbatch)) if name != leave_out}
    scalars = {name: 0.5 for name in STAGE_IO[StageId.LOSS_POLICY].outputs + STAGE_IO[StageId.LOSS_VALUE].outputs}
    return (
        RolloutRecord(1, _columns(), rollout, config, None, provenance).build(),
        StepRecord(1, 0, (MicroBatch("mb-0", _columns(), step),), scalars, config, None, provenance).build(),
    )


def _written(tmp_path: Path, parts) -> list:
    """The sources of the bundle the writer made of `parts`."""
    path = tmp_path / parts.manifest.bundle_id
    BundleWriter(str(path), parts.manifest, parts.index, parts.expected).finalize(payloads=parts.payloads)
    return open_sources(str(path))


def _replay_setting(config: RecomputeConfig) -> Setting:
    """What replay computes with: the config, and the flags of the estimator kernel it resolves."""
    return Setting(config, resolve_kernels(config).estimator.flags)


def test_built_in_estimators_take_their_flags_from_the_table():
    estimators = {name: k for name, k in BUILTIN.items() if isinstance(k, EstimatorKernel)}
    assert set(estimators) == set(BUILTIN_ESTIMATOR_FLAGS)
    for name, kernel in estimators.items():
        assert kernel.flags == BUILTIN_ESTIMATOR_FLAGS[name], name


def test_a_plugin_estimators_flags_are_its_kernels(plugins):
    for name, declared in PLUGINS.items():
        config = _config({"advantage_estimator": name}, {})
        assert resolve_kernels(config).estimator.flags == declared
        assert flags.estimator_flags(config) == declared


@pytest.mark.parametrize("extra", SETTINGS, ids=["off", "on", "kl-in-score"])
@pytest.mark.parametrize("kernel,fields", KERNELS, ids=[name for name, _ in KERNELS])
def test_capture_writes_and_declares_what_replay_reads(plugins, tmp_path, kernel, fields, extra):
    config = _config(fields, extra)
    setting = _replay_setting(config)
    for parts in _capture(config):
        contracts = parts.manifest.stage_contracts
        for stage, contract in contracts.items():
            io = STAGE_IO[stage]
            assert contract.inputs == list(io.declared_inputs(setting)), (stage, contract.inputs)
            assert contract.expected_outputs == list(io.outputs_for(setting)), stage
            for name in io.needed_payloads(setting):  # every payload the stage needs is written
                assert name == LOSS_MASK or name in parts.payloads, (stage, name)
        # and nothing that no contracted stage reads
        assert set(parts.payloads) <= set(payloads_of(list(contracts))), parts.manifest.bundle_id
        sources = _written(tmp_path, parts)
        specs = sources[0].manifest.payloads
        recorded = RECORDED_PAYLOADS | {o for c in contracts.values() for o in c.expected_outputs}
        assert {n for n, s in specs.items() if s.role == "expected"} == set(specs) & recorded
        assert validate_sources(str(tmp_path), sources).problems == []
        plan = plan_replay(sources)
        assert plan.setting == setting
        running = [p for p in plan.stages if p.action == "run"]
        reads = {n for p in running for n in STAGE_IO[p.stage.id].payloads_read_under(setting)}
        run = _PassRunner(plan, None, None)
        assert run._block_payloads(plan.passes[0]) == reads


@pytest.mark.parametrize("kernel,fields", KERNELS, ids=[name for name, _ in KERNELS])
def test_a_missing_payload_the_estimator_reads_is_found_by_validate_and_the_plan(plugins, tmp_path, kernel, fields):
    config = _config(fields, {})
    needs_values = _replay_setting(config).estimator.needs_values
    rollout, _ = _capture(config, leave_out="values")
    sources = _written(tmp_path, rollout)
    problems = validate_sources(str(tmp_path), sources).problems
    assert any("advantage.estimate needs payload 'values'" in p for p in problems) == needs_values, problems
    if needs_values:
        with pytest.raises(
            UnsupportedError, match=f"advantage_estimator={config.advantage_estimator} needs payload 'values'"
        ):
            plan_replay(sources)
    else:
        plan_replay(sources)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_the_entropy_is_needed_only_with_an_entropy_term(tmp_path, entropy_coef):
    config = _config({"entropy_coef": entropy_coef}, {})
    _, step = _capture(config, leave_out="entropy")
    assert "entropy" not in step.payloads
    problems = validate_sources(str(tmp_path), _written(tmp_path, step)).problems
    assert any("loss.policy needs payload 'entropy'" in p for p in problems) == (entropy_coef != 0), problems
    _, with_entropy = _capture(config)
    assert "entropy" in with_entropy.payloads  # written whenever given


@pytest.mark.parametrize("kernel,fields", KERNELS, ids=[name for name, _ in KERNELS])
def test_the_reward_side_kl_is_planned_and_kept_for_an_estimator_that_reads_it(plugins, kernel, fields):
    config = _config(fields, SETTINGS[1])
    setting = _replay_setting(config)
    rollout, step = _capture(config)
    reads_kl = setting.estimator.reads_kl
    # the plan: asking for advantage.estimate brings advantage.kl along only when the estimator takes its KL
    planned = {p.stage.id for p in plan_stages(rollout.manifest, ["advantage.estimate"], config)}
    assert (StageId.ADVANTAGE_KL in planned) == reads_kl
    # the release after advantage.kl: its `kl` stays for advantage.estimate only then, and the values only when
    # the estimator reads them
    cache = PayloadCache()
    cache._loaded = {(0, name, None): torch.zeros(1) for name in rollout.payloads}
    _release({}, cache, [STAGES[StageId.ADVANTAGE_ESTIMATE]], setting)
    kept = {name for _, name, _ in cache._loaded}
    assert ("kl" in kept) == reads_kl
    assert ("values" in kept) == ("returns" in kept) == setting.estimator.needs_values
    assert set(step.payloads) <= set(bundle_payloads("step"))


@pytest.mark.parametrize("kernel,fields", KERNELS, ids=[name for name, _ in KERNELS])
def test_with_the_kl_in_the_score_post_processing_reads_the_kl_of_an_estimator_without_token_rewards(
    plugins, tmp_path, kernel, fields
):
    config = _config(fields, SETTINGS[2])
    setting = _replay_setting(config)
    reads = STAGE_IO[StageId.REWARD_POST_PROCESS].needed_payloads(setting)
    assert reads == (() if setting.estimator.reads_kl else ("kl", LOSS_MASK))
    rollout, _ = _capture(config, leave_out="kl")
    problems = validate_sources(str(tmp_path), _written(tmp_path, rollout)).problems
    assert any("reward.post_process needs payload 'kl'" in p for p in problems) == (not setting.estimator.reads_kl)
