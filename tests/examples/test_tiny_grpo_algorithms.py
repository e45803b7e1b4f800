"""End to end beyond GRPO: the tiny example trains with every advantage estimator (and several policy losses and
loss aggregations), captures, and every bundle it writes replays clean; --fault pr65 with a group estimator is
caught at reward.post_process.

The example computes with its own code, so a pass means replay reproduces an independent implementation. The
single-rank runs share two Python processes (`main(argv)` one after another: torch is imported once per process),
beside a third process for the two-rank gae run; the bundles are replayed in this process.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.examples.helpers import EXAMPLE, SMALL, STEPS_PER_ROLLOUT, replay_capture, run_examples

ROLLOUTS = 2
CASES: dict[str, tuple[str, ...]] = {
    "grpo": ("--std-norm", "--policy-loss", "gspo"),
    "dr_grpo": ("--estimator", "dr_grpo", "--loss-agg-mode", "token_mean"),
    "rloo": ("--estimator", "rloo", "--loss-agg-mode", "seq_mean_token_mean"),
    "reinforce_plus_plus": (
        "--estimator",
        "reinforce_plus_plus",
        "--kl-in-reward",
        "--gamma",
        "0.9",
        "--loss-agg-mode",
        "seq_mean_token_sum",
        "--policy-loss",
        "cispo",
    ),
    "reinforce_plus_plus_baseline": (
        "--estimator",
        "reinforce_plus_plus_baseline",
        "--loss-agg-mode",
        "seq_mean_token_sum_norm",
        "--kl-loss-coef",
        "0.1",
    ),
    "gae": ("--estimator", "gae", "--gamma", "0.9", "--lam", "0.95", "--kl-in-reward", "--loss-agg-mode", "token_mean"),
}
WORLD = {"gae": 2}
"""Two data-parallel ranks for gae: whitening and the value loss across rank shards. The others run one rank."""
PR65 = ("--estimator", "rloo", "--fault", "pr65")
ROLLOUT_STAGES = ["sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"]


@dataclass
class Run:
    root: Path  # the capture directory
    result: dict[str, Any]  # --out-json
    reports: dict[str, Any]  # bundle -> ReplayReport
    sources: dict[str, list]  # bundle -> its sources (one per rank)


def _argv(workdir: Path, name: str, extra: tuple[str, ...], steps: int = ROLLOUTS) -> list[str]:
    return [
        "--steps",
        str(steps),
        "--world-size",
        str(WORLD.get(name, 1)),
        "--seed",
        "3",
        *SMALL,
        "--capture-dir",
        str(workdir / name / "cap"),
        "--out-json",
        str(workdir / f"{name}.json"),
        *extra,
    ]


def _run_many(workdir: Path, runs: list[list[str]]) -> str:
    """The example's `main(argv)` for each of `runs`, one after another in one fresh process; its stdout."""
    return run_examples(workdir, runs)


def _replayed(workdir: Path, name: str) -> Run:
    root = workdir / name / "cap"
    sources, reports = replay_capture(root)
    result = json.loads((workdir / f"{name}.json").read_text(encoding="utf-8"))
    return Run(root, result, reports, sources)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """Every case of CASES (2 rollouts) and the PR #65 fault under rloo (1 rollout), captured and replayed."""
    workdir = tmp_path_factory.mktemp("algorithms")
    single = [_argv(workdir, n, extra) for n, extra in CASES.items() if n not in WORLD]
    single.append(_argv(workdir, "pr65", PR65, steps=1))
    multi = [_argv(workdir, n, CASES[n]) for n in WORLD]
    # three processes side by side: each run waits on its capture writer's start and flush
    shares = [multi, single[: len(single) // 2], single[len(single) // 2 :]]
    with ThreadPoolExecutor(max_workers=len(shares)) as pool:
        outputs = list(pool.map(lambda share: _run_many(workdir, share), shares))
    assert all(out.count("capture_flushed=True") == len(share) for out, share in zip(outputs, shares))
    return {name: _replayed(workdir, name) for name in [*CASES, "pr65"]}


def _stages(report) -> list[tuple[str, Any, str]]:
    return [(str(s.stage), s.rank, s.status) for s in report.stages]


@pytest.mark.parametrize("name", list(CASES))
def test_every_bundle_of_the_run_replays_clean(runs, name) -> None:
    run = runs[name]
    rollouts = [f"rollout-{k}" for k in range(ROLLOUTS)]
    steps = [f"step-{k}-{s}" for k in range(ROLLOUTS) for s in range(STEPS_PER_ROLLOUT)]
    assert sorted(run.reports) == sorted(rollouts + steps)
    world = WORLD.get(name, 1)
    ranks = list(range(world)) if world > 1 else [None]
    losses = ["loss.policy"] + (["loss.value"] if name == "gae" else [])
    # the generator's log-probs and policy versions contract rollout.mismatch in every bundle, one per rank
    mismatch = [("sample", None, "pass")] + [("rollout.mismatch", r, "pass") for r in ranks]
    for bundle, report in run.reports.items():
        assert report.passed and report.first_divergent_stage is None, (bundle, _stages(report))
        if bundle in rollouts:
            # the whole rollout, every rank's shard: the cohort the whitening estimators whiten over
            assert _stages(report) == mismatch + [(s, None, "pass") for s in ROLLOUT_STAGES[1:]], bundle
        else:
            assert _stages(report) == mismatch + [(s, r, "pass") for s in losses for r in ranks]
    config = run.sources["rollout-0"][0].index.config
    assert config.advantage_estimator == name
    assert run.result["config"]["advantage_estimator"] == name


def test_the_recorded_config_holds_what_each_aggregation_needs(runs) -> None:
    """token_mean and the seq-mean modes record the step's global denominator; the norm mode its scale factor."""
    for name, expected in (
        ("dr_grpo", "tokens"),
        ("gae", "tokens"),
        ("rloo", "sequences"),
        ("reinforce_plus_plus", "sequences"),
    ):
        for bundle, sources in runs[name].sources.items():
            config = sources[0].index.config
            if bundle.startswith("rollout-"):
                assert config.loss_denominator is None, (name, bundle)
                continue
            # every rank's shard of the step: the example's masks leave no sequence without a loss token
            count = (
                sum(float(s.load_payload("loss_mask").sum()) for s in sources)
                if expected == "tokens"
                else sum(len(s.index.samples) for s in sources)
            )
            assert config.loss_denominator == count, (name, bundle)
    norm = runs["reinforce_plus_plus_baseline"].sources["step-0-0"][0].index.config
    assert norm.loss_agg_mode == "seq_mean_token_sum_norm" and norm.loss_scale_factor == 5.0  # 4 digits + EOS
    rfpp = runs["reinforce_plus_plus"].sources["rollout-1"][0].index.config
    assert (rfpp.gamma, rfpp.kl_in_reward, rfpp.policy_loss) == (0.9, True, "cispo")
    assert runs["grpo"].sources["step-1-1"][0].index.config.policy_loss == "gspo"


def test_gae_carries_values_returns_and_the_value_loss(runs) -> None:
    run = runs["gae"]
    for bundle, sources in run.sources.items():
        names = set(sources[0].manifest.payloads)
        assert {"values", "returns"} <= names, bundle
        if bundle.startswith("step-"):
            assert "vpreds" in names and set(sources[1].expected["loss.value"]) == {"vf_loss", "vf_clipfrac"}
    estimate = next(s for s in run.reports["rollout-1"].stages if str(s.stage) == "advantage.estimate")
    assert "returns" in estimate.message
    config = run.sources["rollout-0"][0].index.config
    assert (config.gamma, config.lam, config.kl_in_reward) == (0.9, 0.95, True)
    assert all(float.fromhex(rec["vf_loss"]) > 0 for rec in run.result["steps"])


def test_kl_loss_is_reported_and_replayed(runs) -> None:
    run = runs["reinforce_plus_plus_baseline"]
    kl = [float.fromhex(rec["kl_loss"]) for rec in run.result["steps"]]
    assert kl[0] == 0 and all(x > 0 for x in kl[1:])  # the first step's live policy is the reference
    for rec in run.result["steps"]:
        v = {k: float.fromhex(rec[k]) for k in ("loss", "pg_loss", "entropy_loss", "kl_loss")}
        assert v["loss"] == pytest.approx(v["pg_loss"] - 0.01 * v["entropy_loss"] + 0.1 * v["kl_loss"], abs=1e-6)
    step = run.sources["step-1-1"][0]
    assert "ref_log_probs" in step.manifest.payloads and "kl_loss" in step.expected["loss.policy"]
    policy = next(s for s in run.reports["step-1-1"].stages if str(s.stage) == "loss.policy")
    assert "kl_loss matches" in policy.message


def test_pr65_under_rloo_is_caught_at_reward_post_process(runs) -> None:
    run = runs["pr65"]
    report = run.reports["rollout-0"]
    assert not report.passed and report.first_divergent_stage == "reward.post_process", _stages(report)
    assert run.sources["rollout-0"][0].index.config.advantage_estimator == "rloo"
    # the loss was computed from the advantages it was given: the step-level bundles are consistent
    assert all(run.reports[f"step-0-{s}"].passed for s in range(STEPS_PER_ROLLOUT))
    # through the capture directory, each step is replayed with rollout-0, where the error starts
    from typer.testing import CliRunner

    from trajectory_replay.cli import app

    for s in range(STEPS_PER_ROLLOUT):
        result = CliRunner().invoke(app, ["replay", str(run.root), "--step", f"0:{s}", "--json"])
        first = json.loads(result.stdout)["first_divergence"]
        assert result.exit_code == 1 and (first["bundle"], first["stage"]) == ("rollout-0", "reward.post_process")


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--fault", "pr65", "--estimator", "gae"), "--fault pr65 normalizes rewards per consumer batch"),
        (("--kl-in-reward",), "--kl-in-reward needs --estimator reinforce_plus_plus or gae, not grpo"),
        (("--std-norm", "--estimator", "rloo"), "--std-norm applies to --estimator grpo only, not rloo"),
    ],
)
def test_settings_that_do_not_go_together_are_one_line_errors(argv, message, capsys) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import tiny_grpo
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    with pytest.raises(SystemExit) as exc:
        tiny_grpo.parse_args(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
