"""`scan --engine ray` on a local 2-CPU Ray (started once for the module): the same summary as the local engine,
and a task whose worker dies retried by Ray, then reported."""

from __future__ import annotations

import pytest

from tests.ops.scan_helpers import CLEAN, DIVERGED, check_summary, cli_json, populate
from tests.ops.scan_workers import DyingReplayer
from trajectory_replay.ops.scan import scan_store

ray = pytest.importorskip("ray")  # the test extra installs it: CI always runs these


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("scan-ray") / "store")
    populate(root)
    return root


def _outcomes(report) -> list[tuple]:
    return [
        (v.name, v.anchor, v.status, v.first_divergent_stage, v.sample_id, v.field, v.missing_ranks)
        for v in report.verdicts
    ]


def test_ray_engine_gives_the_local_summary(cluster, store):
    code, summary = cli_json("scan", store, "--engine", "ray")  # the CLI uses the cluster this process joined
    assert code == 1 and summary["engine"] == "ray"
    check_summary(summary)
    assert (summary["replayed"], summary["cached"]) == (len(CLEAN) + len(DIVERGED) + 1, 0)
    by_ray = scan_store(store, engine="ray", force=True)
    by_local = scan_store(store, engine="local", workers=2, force=True)
    assert _outcomes(by_ray) == _outcomes(by_local)
    assert by_ray.exit_code == by_local.exit_code == 1
    again = scan_store(store, engine="ray")
    assert (again.replayed, again.cached) == (1, len(CLEAN) + len(DIVERGED))  # the invalid one only


def test_ray_task_whose_worker_dies_is_retried_then_reported(cluster, store):
    report = scan_store(store, engine="ray", force=True, replayer=DyingReplayer)  # dies on s-1-1
    by_name = {v.name: v for v in report.verdicts}
    dead = by_name["s-1-1"]
    assert dead.status == "error" and dead.attempts == 2, dead
    assert "worker died" in dead.detail and "tried 2 times" in dead.detail, dead.detail
    assert dead.anchor == "step 1:1"
    assert by_name["s-1-0"].status == "pass" and by_name["s-2-1"].status == "diverged"
    assert report.counts["error"] == 1 and report.exit_code == 1
