"""Kernels another package registers: a real distribution (tests/kernel_plugin) installed by pip, found through
its entry points, and pinned by the bundle's stage contracts."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.replay.cases import GROUPS, LENGTHS, MASKS, RAW, twelve_case
from tests.replay.conftest import source_of
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.schema import KernelRef, StageId
from trajectory_replay.cli import app
from trajectory_replay.errors import UnsupportedError
from trajectory_replay.replay import replay
from trajectory_replay.replay.fixtures import CanonicalCase
from trajectory_replay.replay.registry import installed_kernels, resolve_kernels

PLUGIN_SOURCE = Path(__file__).resolve().parents[1] / "kernel_plugin"
PACKAGE, MODULE, VERSION = "acme-rl-kernels", "acme_rl_kernels", "0.3.1"
NOT_INSTALLED = f"kernel acme_grpo from package {PACKAGE} is not installed"
PINNED_STAGES = {
    StageId.REWARD_POST_PROCESS: "acme_grpo",
    StageId.ADVANTAGE_ESTIMATE: "acme_grpo",
    StageId.LOSS_POLICY: "acme_token_sum",
}


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """The directory pip installed acme-rl-kernels into (built from a copy: a build leaves files in its source)."""
    root = tmp_path_factory.mktemp("acme")
    source, site = root / "src", root / "site"
    shutil.copytree(PLUGIN_SOURCE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--quiet",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[trajectory_replay.kernels]" in (site / f"{MODULE}-{VERSION}.dist-info" / "entry_points.txt").read_text()
    return site


def _forget_plugin() -> None:
    """Drop the plugin's modules, so a later test cannot reach it through sys.modules."""
    for name in [m for m in sys.modules if m == MODULE or m.startswith(f"{MODULE}.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture
def acme_installed(plugin_site):
    """acme-rl-kernels importable (its site directory on sys.path) for one test only."""
    sys.path.insert(0, str(plugin_site))
    importlib.invalidate_caches()
    yield plugin_site
    sys.path.remove(str(plugin_site))
    _forget_plugin()


@pytest.fixture
def acme_absent():
    """acme-rl-kernels is not importable here (as on a machine without it)."""
    _forget_plugin()
    assert importlib.util.find_spec(MODULE) is None
    return None


def group_baseline(raw: list[float], groups: list[int]) -> list[float]:
    """r - the mean of r over the sample's group, one group at a time."""
    means = {g: sum(r for r, h in zip(raw, groups) if h == g) / groups.count(g) for g in set(groups)}
    return [r - means[g] for r, g in zip(raw, groups)]


def token_sum_loss(rewards: list[float], payloads: dict[str, torch.Tensor], cfg: dict) -> dict[str, float]:
    """The loss.policy scalars of ppo_clip (dual clip) as plain sums over every masked token, in float64."""
    adv = torch.tensor([rewards[i] for i, n in enumerate(LENGTHS) for _ in range(n)], dtype=torch.float64)
    mask = torch.tensor([m for ms in MASKS for m in ms], dtype=torch.float64)
    old, cur = payloads["old_log_probs"].double(), payloads["log_probs"].double()
    ratio = torch.exp(cur - old)
    unclipped, clipped = -ratio * adv, -ratio.clamp(1 - cfg["eps_clip"], 1 + cfg["eps_clip_high"]) * adv
    pg = torch.maximum(unclipped, clipped)
    pg = torch.where(adv < 0, torch.minimum(-cfg["eps_clip_c"] * adv, pg), pg)
    out = {
        "pg_loss": float((pg * mask).sum()),
        "pg_clipfrac": float(((clipped > unclipped) * mask).sum()),
        "ppo_kl": float(((old - cur) * mask).sum()),
        "entropy_loss": float((payloads["entropy"] * mask).sum()),
    }
    out["loss"] = out["pg_loss"] - cfg["entropy_coef"] * out["entropy_loss"]
    return out


def acme_case(produced: list[float] | None = None, package: str = PACKAGE, **config) -> CanonicalCase:
    """The 12-sample case as an acme trainer records it: acme_grpo rewards (or `produced`), acme_token_sum loss,
    its stage contracts pinning those kernels to `package`; `config` overrides the recorded config."""
    manifest, index, expected, payloads = twelve_case()
    rewards = produced or [2.0 * r for r in group_baseline(RAW, GROUPS)]
    cfg = {**index.config.model_dump(), "advantage_estimator": "acme_grpo", "loss_agg_mode": "acme_token_sum", **config}
    contracts = {
        s: c.model_copy(update={"kernel": KernelRef(name=PINNED_STAGES[s], package=package, version=VERSION)})
        if s in PINNED_STAGES
        else c
        for s, c in manifest.stage_contracts.items()
    }
    records = [r.model_copy(update={"reward": rewards[i]}) for i, r in enumerate(index.samples)]
    expected = {
        **expected,
        "reward.post_process": {"rewards": rewards},
        "loss.policy": token_sum_loss(rewards, payloads, cfg),
    }
    payloads = {**payloads, "advantages": torch.tensor([rewards[i] for i, n in enumerate(LENGTHS) for _ in range(n)])}
    return CanonicalCase(
        manifest.model_copy(update={"stage_contracts": contracts}),
        index.model_copy(update={"samples": records, "config": index.config.model_validate(cfg)}),
        expected,
        payloads,
    )


def unpinned(case: CanonicalCase) -> CanonicalCase:
    """`case` with stage contracts that name no kernel."""
    return case._replace(
        manifest=case.manifest.model_copy(update={"stage_contracts": twelve_case().manifest.stage_contracts})
    )


def write_bundle(case: CanonicalCase, path: Path) -> str:
    """`case` as a bundle on local disk; its path."""
    BundleWriter(str(path), case.manifest, case.index, case.expected).finalize(payloads=case.payloads)
    return str(path)


def test_the_installed_distribution_registers_its_kernels_and_lists_the_broken_one_with_why(acme_installed):
    found = installed_kernels()
    assert [(i.kernel.name, i.package) for i in found["acme_grpo"]] == [("acme_grpo", PACKAGE)]
    assert [(i.kernel.name, i.package) for i in found["acme_token_sum"]] == [("acme_token_sum", PACKAGE)]
    [broken] = found["acme_broken"]  # its module does not import: never used, but the reason is kept
    assert broken.kernel is None and "ModuleNotFoundError" in broken.broken


def test_a_bundle_pinning_plugin_kernels_replays_with_them_and_passes(acme_installed):
    report = replay([source_of(acme_case())])
    assert report.passed, report.render_text()
    ran = {s.stage: s.status for s in report.stages}
    assert ran == {s.value: "pass" for s in twelve_case().manifest.stage_contracts}
    # the doubled baseline is the plugin's: no built-in estimator reproduces it
    builtin = unpinned(acme_case(advantage_estimator="dr_grpo", loss_agg_mode="token_mean"))
    assert replay([source_of(builtin)]).first_divergent_stage == "reward.post_process"


def test_the_plugin_estimator_does_not_hide_a_fault(acme_installed):
    # the producer baselined against the whole batch instead of each prompt group
    batch_mean = sum(RAW) / len(RAW)
    produced = [2.0 * (r - batch_mean) for r in RAW]
    report = replay([source_of(acme_case(produced))])
    assert report.first_divergent_stage == "reward.post_process"
    first = report.stage("reward.post_process").divergences[0]
    right = 2.0 * group_baseline(RAW, GROUPS)[0]
    assert (first.sample_id, first.expected, first.actual) == (
        "q-0",
        pytest.approx(produced[0]),
        pytest.approx(right, rel=1e-6),
    )


def test_a_missing_plugin_fails_naming_kernel_and_package(acme_absent):
    with pytest.raises(UnsupportedError) as err:
        replay([source_of(acme_case())])
    assert str(err.value).startswith(NOT_INSTALLED)
    assert "\n" not in str(err.value)


def test_the_kernel_of_exactly_the_named_package_is_used(acme_installed):
    # acme_grpo is installed, but from acme-rl-kernels, not from the package the contract names
    with pytest.raises(UnsupportedError, match="^kernel acme_grpo from package verl-kernels is not installed"):
        replay([source_of(acme_case(package="verl-kernels"))])
    # distribution names compare normalized
    assert replay([source_of(acme_case(package="Acme_RL.Kernels"))]).passed


@pytest.fixture(scope="module")
def acme_bundle(tmp_path_factory) -> str:
    """The acme case written to local disk."""
    return write_bundle(acme_case(), tmp_path_factory.mktemp("bundles") / "b-acme")


def test_cli_replay_without_the_plugin_is_one_line_exit_1(acme_bundle, acme_absent):
    result = CliRunner().invoke(app, ["replay", acme_bundle])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trajectory-replay: error: {NOT_INSTALLED}"), result.stderr
    assert "Traceback" not in result.output
    as_json = CliRunner().invoke(app, ["replay", acme_bundle, "--json"])
    assert as_json.exit_code == 1
    doc = json.loads(as_json.stdout)
    assert doc["status"] == "unsupported" and doc["error"].startswith(NOT_INSTALLED)


def test_cli_replay_with_the_plugin_passes(acme_bundle, acme_installed):
    result = CliRunner().invoke(app, ["replay", acme_bundle])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("bundle b-twelve — first divergent stage: none")


@pytest.mark.parametrize("installed", [False, True])
def test_an_unknown_estimator_without_a_pinned_kernel_is_unsupported(installed, request):
    request.getfixturevalue("acme_installed" if installed else "acme_absent")
    with pytest.raises(UnsupportedError, match="^unsupported advantage_estimator 'nope_grpo': replay knows grpo"):
        replay([source_of(unpinned(acme_case(advantage_estimator="nope_grpo")))])


def test_a_broken_entry_point_is_an_unknown_kernel_not_a_crash(acme_installed):
    with pytest.raises(UnsupportedError, match="^unsupported advantage_estimator 'acme_broken'"):
        replay([source_of(unpinned(acme_case(advantage_estimator="acme_broken")))])


def test_a_broken_entry_point_does_not_stop_other_bundles(acme_installed):
    assert replay([source_of(twelve_case())]).passed  # built-in kernels only
    assert replay([source_of(acme_case())]).passed  # the package's working kernels beside its broken one
    assert resolve_kernels(acme_case().index.config, acme_case().manifest).estimator.name == "acme_grpo"


def test_stages_that_use_no_pinned_kernel_replay_without_the_package(acme_absent):
    report = replay([source_of(acme_case())], stages=["reward.raw"])
    assert report.passed and {s.stage for s in report.stages} == {"sample", "reward.raw"}


def test_a_pinned_kernel_that_does_not_load_says_so_rather_than_not_installed(acme_installed):
    manifest, index, expected, payloads = acme_case()
    contracts = {
        s: c.model_copy(update={"kernel": KernelRef(name="acme_broken", package=PACKAGE)})
        if s in PINNED_STAGES and PINNED_STAGES[s] == "acme_grpo"
        else c
        for s, c in manifest.stage_contracts.items()
    }
    broken = CanonicalCase(
        manifest.model_copy(update={"stage_contracts": contracts}),
        index.model_copy(update={"config": index.config.model_copy(update={"advantage_estimator": "acme_broken"})}),
        expected,
        payloads,
    )
    with pytest.raises(
        UnsupportedError,
        match="^kernel acme_broken from package acme-rl-kernels is installed but does not load: ModuleNotFoundError",
    ):
        replay([source_of(broken)])


def test_a_pinned_kernel_of_another_version_replays_with_a_warning(acme_installed):
    manifest, index, expected, payloads = acme_case()
    contracts = {
        s: c.model_copy(update={"kernel": c.kernel.model_copy(update={"version": "0.1.0"})})
        if c.kernel is not None
        else c
        for s, c in manifest.stage_contracts.items()
    }
    older = CanonicalCase(manifest.model_copy(update={"stage_contracts": contracts}), index, expected, payloads)
    with pytest.warns(RuntimeWarning, match=f"produced with {PACKAGE} 0.1.0, replaying with {VERSION}"):
        assert replay([source_of(older)]).passed
