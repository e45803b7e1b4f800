"""End to end: the tiny GRPO example captures to the real S3 server; the CLI validates and replays every bundle.

One captured run per case, made once for the module (the two cases side by side), reused by every assertion:
W=2 data-parallel ranks, 2 rollouts of 3 prompt groups x 4 samples streamed as 2 actor steps of 6 samples each
(groups straddle steps and ranks), so 2 rollout-level and 4 step-level bundles, each a 2-rank bundle. The PR #65
case captures 1 rollout. The example and the CLI run in real subprocesses that reach S3 through the standard
AWS_* variables only; the CLI's five calls per bundle share two processes (`run_cli_many`), so torch is imported
twice, not per call.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.examples.helpers import (
    SCALARS,
    SMALL,
    STEPS_PER_ROLLOUT,
    CliResult,
    ExampleRun,
    run_cli_many,
    run_example,
)
from trajectory_replay.store.layout import OBJECTS_DIR, REFS_DIR, is_bundle_dir

ROLLOUTS = 2


def bundle_names(rollouts: int) -> tuple[list[str], list[str]]:
    return (
        [f"rollout-{k}" for k in range(rollouts)],
        [f"step-{k}-{s}" for k in range(rollouts) for s in range(STEPS_PER_ROLLOUT)],
    )


ROLLOUT_BUNDLES, STEP_BUNDLES = bundle_names(ROLLOUTS)
PR65_ROLLOUT_BUNDLES, PR65_STEP_BUNDLES = bundle_names(1)


def _selector(bundle: str) -> list[str]:
    parts = bundle.split("-")
    return ["--rollout", parts[1]] if parts[0] == "rollout" else ["--step", f"{parts[1]}:{parts[2]}"]


@dataclass
class Captured:
    run: ExampleRun
    root: str  # s3://bucket/prefix
    children: list[str]  # names directly under the root
    validate: dict[str, CliResult]  # bundle -> `validate ROOT/BUNDLE`
    by_path: dict[str, CliResult]  # bundle -> `replay ROOT/BUNDLE --json`
    by_dir: dict[str, CliResult]  # bundle -> `replay ROOT --step R:S | --rollout R --json`
    storage_options: dict[str, Any]
    by_rank: dict[tuple[str, int], CliResult]  # (bundle, r) -> `replay ROOT/BUNDLE/rank-r --json`


@pytest.fixture(scope="module")
def s3_capture_env(s3_server, s3_bucket, tmp_path_factory) -> tuple[str, dict[str, str]]:
    """A fresh prefix of the session's bucket ("bucket/prefix"), and the environment a user would set:
    AWS_* for the server, a private read cache."""
    cache = tmp_path_factory.mktemp("replay-cache")
    return f"{s3_bucket}/capture-{uuid.uuid4().hex[:12]}", {
        **s3_server.env(),
        "TRAJECTORY_REPLAY_CACHE_DIR": str(cache),
    }


def _capture(
    s3_server,
    env: dict[str, str],
    workdir: Path,
    name: str,
    root: str,
    *extra: str,
    run_env: dict[str, str],
    rollouts: int = ROLLOUTS,
) -> Captured:
    import s3fs

    run = run_example(workdir, name, *SMALL, *extra, steps=rollouts, env={**env, **run_env})
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options())
    children = sorted(Path(p).name for p in fs.ls(root.removeprefix("s3://"), detail=False))
    rollout_bundles, step_bundles = bundle_names(rollouts)
    bundles = rollout_bundles + step_bundles
    calls = (
        [["validate", f"{root}/{b}"] for b in bundles]
        + [["replay", f"{root}/{b}", "--json"] for b in bundles]
        + [["replay", root, *_selector(b), "--json"] for b in bundles]
        + [["replay", f"{root}/{b}/rank-{r}", "--json"] for b in bundles for r in (0, 1)]
    )
    results = run_cli_many(calls, env)
    n = len(bundles)
    return Captured(
        run,
        root,
        children,
        dict(zip(bundles, results[:n])),
        dict(zip(bundles, results[n : 2 * n])),
        dict(zip(bundles, results[2 * n : 3 * n])),
        s3_server.storage_options(),
        dict(zip([(b, r) for b in bundles for r in (0, 1)], results[3 * n :])),
    )


@pytest.fixture(scope="module")
def captures(s3_server, s3_capture_env, tmp_path_factory) -> dict[str, Captured]:
    """Both captures of this module, made side by side (each is a chain of processes that seldom keeps both
    cores busy): "run", capture switched on by the environment variables alone, and "pr65", the canonical bug
    captured through the --capture-dir shortcut."""
    bucket, env = s3_capture_env
    run_root, pr65_root = f"s3://{bucket}/run", f"s3://{bucket}/pr65"
    run_dir, pr65_dir = tmp_path_factory.mktemp("capture"), tmp_path_factory.mktemp("capture-pr65")
    with ThreadPoolExecutor(max_workers=2) as pool:
        run = pool.submit(
            _capture,
            s3_server,
            env,
            run_dir,
            "run",
            run_root,
            run_env={"TRAJECTORY_REPLAY_CAPTURE": "1", "TRAJECTORY_REPLAY_CAPTURE_DIR": run_root},
        )
        pr65 = pool.submit(
            _capture,
            s3_server,
            env,
            pr65_dir,
            "pr65",
            pr65_root,
            "--fault",
            "pr65",
            "--capture-dir",
            pr65_root,
            run_env={},
            rollouts=1,
        )
        return {"run": run.result(), "pr65": pr65.result()}


@pytest.fixture(scope="module")
def captured(captures) -> Captured:
    """Capture switched on by the environment variables alone."""
    return captures["run"]


@pytest.fixture(scope="module")
def captured_pr65(captures) -> Captured:
    """The canonical bug, captured through the --capture-dir shortcut."""
    return captures["pr65"]


@pytest.fixture(scope="module")
def uncaptured(baseline) -> ExampleRun:
    """The same run as `captured` (SMALL, W=2, 2 rollouts), with no capture variables at all: the session's
    capture-off run."""
    return baseline


# ---- the capture run -------------------------------------------------------------------------------------


def test_every_rank_flushed_every_bundle_before_exit(captured) -> None:
    cap = captured.run.result["capture"]
    assert cap["threads"] == 2 and "capture_threads=2 capture_flushed=True" in captured.run.stdout
    for rank_info in cap["ranks"]:
        stats = rank_info["stats"]
        assert rank_info["enabled"] and rank_info["flushed"], rank_info
        assert stats["written"] == len(ROLLOUT_BUNDLES) + len(STEP_BUNDLES), stats
        assert stats["errors"] == stats["dropped"] == stats["filtered"] == stats["queued_records"] == 0, stats


def test_capture_root_holds_only_bundles_objects_blobs_and_dot_names(captured) -> None:
    bundles = [c for c in captured.children if is_bundle_dir(c)]
    assert sorted(bundles) == sorted(ROLLOUT_BUNDLES + STEP_BUNDLES)
    assert {OBJECTS_DIR, REFS_DIR} <= set(captured.children)


@pytest.mark.parametrize("bundle", ROLLOUT_BUNDLES + STEP_BUNDLES)
def test_bundle_validates_and_replays_by_url_and_through_the_capture_dir(captured, bundle) -> None:
    valid = captured.validate[bundle]
    assert valid.returncode == 0 and "valid" in valid.stdout, valid
    by_path, by_dir = captured.by_path[bundle], captured.by_dir[bundle]
    for res in (by_path, by_dir):
        assert res.returncode == 0, res
        report = res.json()
        assert report["bundle_id"] == bundle and report["passed"] is True, res
        assert report["first_divergent_stage"] is None
    if bundle.startswith("rollout-"):
        assert by_path.json() == by_dir.json()
    else:  # --step through the capture directory: the step chained to the rollout bundle that produced it
        chained, alone = by_dir.json(), by_path.json()
        # one schema: the chain's object has every key of the step's own, describing the whole chain
        assert {k: chained[k] for k in alone if k not in ("stages", "compared")} == {
            k: v for k, v in alone.items() if k not in ("stages", "compared")
        }
        assert [s for s in chained["stages"] if s["bundle"] == bundle and s["stage"] != "link"] == alone["stages"]
        assert chained["compared"] > alone["compared"]
        assert [e["bundle"] for e in chained["chain"]] == [f"rollout-{bundle.split('-')[1]}", bundle]
        assert chained["link"]["status"] == "pass" and chained["first_divergence"] is None
    stages = [(s["stage"], s["rank"], s["status"]) for s in by_path.json()["stages"]]
    # the generator's log-probs and policy versions contract rollout.mismatch, checked per rank shard
    mismatch = [("sample", None, "pass"), ("rollout.mismatch", 0, "pass"), ("rollout.mismatch", 1, "pass")]
    if bundle.startswith("rollout-"):
        # rank shards with disjoint samples: the group-level stages see their union
        assert stages == mismatch + [
            (st, None, "pass") for st in ("reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate")
        ]
    else:
        assert stages == mismatch + [("loss.policy", 0, "pass"), ("loss.policy", 1, "pass")]
    for r in (0, 1):
        # one rank by its URL: its prompt groups (split across ranks) are completed from the other rank
        res = captured.by_rank[(bundle, r)]
        assert res.returncode == 0 and res.json()["passed"] is True, res
        ranked = [(s["stage"], s["rank"], s["status"]) for s in res.json()["stages"]]
        assert ranked == [s for s in stages if s[1] in (None, r)]


def test_bundles_are_two_rank_shards_with_weight_lineage(captured) -> None:
    from trajectory_replay.bundle import open_sources

    for bundle in ("rollout-0", "rollout-1", "step-0-1", "step-1-0"):
        sources = open_sources(f"{captured.root}/{bundle}", **captured.storage_options)
        assert [s.rank for s in sources] == [0, 1]
        ids = [{r.sample_id for r in s.index.samples} for s in sources]
        assert ids[0] and ids[1] and not ids[0] & ids[1]  # data-parallel shards: disjoint samples
        k = int(bundle.split("-")[1])
        for s in sources:
            lineage = s.index.identity.weight_lineage
            # rollout k was generated by version max(k-1, 0) and consumed by the live version k
            assert (lineage.rollout_weight, lineage.actor_weight) == (max(k - 1, 0), k)
            assert s.index.identity.rank.dp == 2
    groups = [
        {r.group_index for r in s.index.samples}
        for s in open_sources(f"{captured.root}/rollout-1", **captured.storage_options)
    ]
    assert groups[0] & groups[1], "prompt groups are split across the ranks' shards"


def test_capture_does_not_change_numerics(captured, uncaptured) -> None:
    """Bit-identical reported losses and final weights with capture on (S3) and off (no variables)."""
    assert len(captured.run.result["steps"]) == ROLLOUTS * STEPS_PER_ROLLOUT
    assert captured.run.result["steps"] == uncaptured.result["steps"]
    assert captured.run.result["param_checksum"] == uncaptured.result["param_checksum"]
    assert captured.run.result["split_across_ranks"] > 0 and captured.run.result["split_across_batches"] > 0
    off = uncaptured.result["capture"]
    assert off["threads"] == 0 and not any(r["enabled"] for r in off["ranks"])
    assert sorted(p.name for p in uncaptured.workdir.iterdir()) == [uncaptured.out_json.name]


# ---- the PR #65 fault ------------------------------------------------------------------------------------


def test_pr65_fault_changes_the_losses(captured_pr65, uncaptured) -> None:
    faulty, base = captured_pr65.run.result, uncaptured.result
    assert faulty["fault"] == "pr65"
    n = STEPS_PER_ROLLOUT  # the first rollout: same seeded samples, different reward normalization
    assert [r["mean_raw_reward"] for r in faulty["steps"]] == [r["mean_raw_reward"] for r in base["steps"][:n]]
    assert [[r[k] for k in SCALARS] for r in faulty["steps"]] != [[r[k] for k in SCALARS] for r in base["steps"][:n]]
    assert faulty["steps"][0]["pg_loss"] != base["steps"][0]["pg_loss"]


@pytest.mark.parametrize("bundle", PR65_ROLLOUT_BUNDLES)
def test_pr65_rollout_replay_names_reward_post_process(captured_pr65, bundle) -> None:
    assert captured_pr65.validate[bundle].returncode == 0, captured_pr65.validate[bundle]
    for res in (captured_pr65.by_path[bundle], captured_pr65.by_dir[bundle]):
        assert res.returncode == 1, res
        report = res.json()
        assert report["bundle_id"] == bundle and report["passed"] is False
        assert report["first_divergent_stage"] == "reward.post_process"
        status = {s["stage"]: s["status"] for s in report["stages"]}
        assert status == {
            "sample": "pass",
            "rollout.mismatch": "pass",
            "reward.raw": "pass",
            "reward.post_process": "fail",
            "advantage.kl": "pass",
            "advantage.estimate": "fail",
        }
        post = next(s for s in report["stages"] if s["stage"] == "reward.post_process")
        assert post["mismatch_count"] > 0 and post["divergences"][0]["field"]
    for r in (0, 1):
        res = captured_pr65.by_rank[(bundle, r)]
        assert res.returncode == 1 and res.json()["first_divergent_stage"] == "reward.post_process", res


def test_pr65_step_bundles_validate_and_replay(captured_pr65) -> None:
    """The loss was computed from the (wrong) advantages it was given: each step-level bundle alone is consistent.
    Replayed through the capture directory by --step, with the rollout-level bundle that produced its samples,
    the first divergence is named where it starts: reward.post_process of that rollout bundle, not the loss."""
    assert "capture_threads=2 capture_flushed=True" in captured_pr65.run.stdout
    bundles = [c for c in captured_pr65.children if is_bundle_dir(c)]
    assert sorted(bundles) == sorted(PR65_ROLLOUT_BUNDLES + PR65_STEP_BUNDLES)
    for bundle in PR65_STEP_BUNDLES:
        assert captured_pr65.validate[bundle].returncode == 0, captured_pr65.validate[bundle]
        alone = captured_pr65.by_path[bundle]
        assert alone.returncode == 0 and alone.json()["bundle_id"] == bundle and alone.json()["passed"], alone
        chained = captured_pr65.by_dir[bundle]
        assert chained.returncode == 1, chained
        report = chained.json()
        first = report["first_divergence"]
        assert (first["bundle"], first["stage"]) == ("rollout-0", "reward.post_process"), report
        assert [e["bundle"] for e in report["chain"]] == ["rollout-0", bundle]
        assert report["stages"][-1]["stage"] == "loss.policy" and report["stages"][-1]["status"] == "pass"
