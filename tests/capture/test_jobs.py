"""The typed job the manager hands its writer: it survives the pipe to the writer process unchanged, it refuses
fields that are not what they claim to be, and the capture modules import one another one way only."""

from __future__ import annotations

import ast
import dataclasses
import io
import pickle
from pathlib import Path

import pytest

from tests.capture.helpers import CONFIG, loss_scalars, microbatch_kwargs, rollout_kwargs
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.markers import COMPLETE, rank_key
from trajectory_replay.capture import worker
from trajectory_replay.capture.commit import BundleJob, commit_bundle
from trajectory_replay.capture.records import Columns, MicroBatch, Provenance, RolloutRecord, StepRecord
from trajectory_replay.capture.snapshot import Snapshot
from trajectory_replay.replay import replay
from trajectory_replay.store import ObjectStore

COLUMNS = ("sample_ids", "group_index", "response_lengths", "total_lengths", "loss_masks", "raw_rewards", "rewards")


def _rollout_record(rollout_id: int = 4) -> RolloutRecord:
    kwargs, snap = rollout_kwargs(), Snapshot()
    columns = Columns.take(snap, **{k: kwargs[k] for k in COLUMNS})
    payloads = {k: snap.flat(kwargs[k], k) for k in ("old_log_probs", "ref_log_probs", "kl", "advantages")}
    return RolloutRecord(rollout_id, columns, payloads, CONFIG, kwargs["weight_lineage"], Provenance())


def _step_record(rollout_id: int = 4, step_id: int = 1) -> StepRecord:
    snap, micro_batches = Snapshot(), []
    for j, positions in enumerate([[0, 1], [2, 3]]):
        kwargs = microbatch_kwargs(positions)
        columns = Columns.take(snap, **{k: kwargs[k] for k in COLUMNS})
        payloads = {k: snap.flat(kwargs[k], k) for k in ("old_log_probs", "log_probs", "entropy", "advantages")}
        micro_batches.append(MicroBatch(f"mb-{j:04d}", columns, payloads))
    return StepRecord(rollout_id, step_id, tuple(micro_batches), loss_scalars(range(4)), CONFIG, None, Provenance())


def _through_the_pipe(job: BundleJob) -> BundleJob:
    """The job as the writer process receives it (the worker's framing: tensors as raw bytes)."""
    pipe = io.BytesIO()
    worker.send(pipe, worker.Request(1, job))
    pipe.seek(0)
    seq, received = worker.receive(pipe)
    assert seq == 1
    return received


@pytest.mark.parametrize("make_record", [_rollout_record, _step_record], ids=["rollout", "step"])
def test_a_job_survives_the_pipe_and_commits_the_same_bundle(tmp_path, make_record):
    job = BundleJob(str(tmp_path / "sent"), make_record())
    received = _through_the_pipe(job)
    assert type(received) is BundleJob and type(received.record) is type(job.record)
    assert (received.capture_dir, received.rank, received.expected_ranks) == (job.capture_dir, 0, (0,))
    assert pickle.loads(pickle.dumps(received)).bundle_id == job.bundle_id  # plain pickle too

    # the job committed here and its copy committed elsewhere make the same bundle
    there = dataclasses.replace(received, capture_dir=str(tmp_path / "received"))
    urls = [commit_bundle(ObjectStore.open(j.capture_dir), j) for j in (job, there)]
    assert urls == [f"{tmp_path / root}/{job.bundle_id}" for root in ("sent", "received")]
    [sent], [got] = (open_native(url) for url in urls)
    assert sent.manifest == got.manifest and sent.full_index() == got.full_index() and sent.expected == got.expected
    assert replay([got]).passed


def test_a_job_of_one_rank_of_two_lands_only_its_shard(tmp_path):
    root = tmp_path / "cap"
    job = _through_the_pipe(BundleJob(str(root), _step_record(7, 2), rank=1, expected_ranks=(0, 1)))
    assert (job.rank, job.expected_ranks, job.multi_producer) == (1, (0, 1), True)
    assert commit_bundle(ObjectStore.open(str(root)), job).endswith("/step-7-2")
    assert sorted(
        p.relative_to(root).as_posix() for p in (root / "step-7-2").iterdir() if p.name.startswith(COMPLETE)
    ) == [rank_key("step-7-2", 1)]


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(capture_dir=None), TypeError, "BundleJob.capture_dir: expected str, got NoneType"),
        (dict(capture_dir=" "), ValueError, "BundleJob.capture_dir is empty"),
        (
            dict(record=("rollout", (4,))),
            TypeError,
            "BundleJob.record: expected RolloutRecord or StepRecord, got tuple",
        ),
        (dict(rank=True), TypeError, "BundleJob.rank: expected int, got bool"),
        (dict(rank="0"), TypeError, "BundleJob.rank: expected int, got str"),
        (dict(rank=2, expected_ranks=(0, 1)), ValueError, r"BundleJob.rank: 2 is not among expected ranks \[0, 1\]"),
        (dict(expected_ranks=[0, 1]), TypeError, "BundleJob.expected_ranks: expected tuple, got list"),
        (
            dict(expected_ranks=()),
            ValueError,
            r"BundleJob.expected_ranks: expected increasing non-negative ints, got \(\)",
        ),
        (dict(expected_ranks=(1, 0)), ValueError, "BundleJob.expected_ranks: expected increasing"),
        (dict(expected_ranks=(0, 0)), ValueError, "BundleJob.expected_ranks: expected increasing"),
        (dict(expected_ranks=(-1, 0)), ValueError, "BundleJob.expected_ranks: expected increasing non-negative"),
        (dict(expected_ranks=(0, 1.0)), ValueError, "BundleJob.expected_ranks: expected increasing non-negative ints"),
    ],
)
def test_a_job_rejects_bad_fields(tmp_path, change, error, message):
    fields = dict(capture_dir=str(tmp_path), record=_rollout_record(), rank=0, expected_ranks=(0,)) | change
    with pytest.raises(error, match=message) as caught:
        BundleJob(**fields)
    assert "\n" not in str(caught.value)


def test_records_reject_bad_fields_and_nothing_changes_them():
    good = _rollout_record()
    with pytest.raises(TypeError, match="RolloutRecord.rollout_id: expected int, got str"):
        dataclasses.replace(good, rollout_id="4")
    with pytest.raises(TypeError, match="RolloutRecord.columns: expected Columns, got dict"):
        dataclasses.replace(good, columns={})
    with pytest.raises(TypeError, match="RolloutRecord.provenance: expected Provenance, got NoneType"):
        dataclasses.replace(good, provenance=None)
    step = _step_record()
    with pytest.raises(TypeError, match="StepRecord.micro_batches: expected tuple, got list"):
        dataclasses.replace(step, micro_batches=list(step.micro_batches))
    with pytest.raises(TypeError, match=r"StepRecord.micro_batches\[1\]: expected MicroBatch, got dict"):
        dataclasses.replace(step, micro_batches=(step.micro_batches[0], {}))
    with pytest.raises(TypeError, match="StepRecord.step_id: expected int, got bool"):
        dataclasses.replace(step, step_id=False)
    job = BundleJob("/tmp/x", good)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.rank = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.rollout_id = 5  # type: ignore[misc]


def _capture_imports(path: Path) -> set[str]:
    """The capture modules `path` imports, at any depth of the file (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "trajectory_replay.capture":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("trajectory_replay.capture."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("trajectory_replay.capture."))
    return found


def test_capture_modules_import_one_way():
    package = Path(worker.__file__).parent
    modules = {p.stem: p for p in package.glob("*.py") if p.stem != "__init__"}
    graph = {name: _capture_imports(path) & set(modules) for name, path in modules.items()}

    def cycle_from(name: str, trail: tuple[str, ...]) -> tuple[str, ...]:
        if name in trail:
            return trail[trail.index(name) :] + (name,)
        for dep in sorted(graph[name]):
            found = cycle_from(dep, trail + (name,))
            if found:
                return found
        return ()

    cycles = [c for c in (cycle_from(name, ()) for name in sorted(graph)) if c]
    assert not cycles, " -> ".join(cycles[0])
