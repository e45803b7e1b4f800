"""Rollout-level and step-level capture to a local store: bundles open and replay with a pass."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.capture.helpers import (
    CONFIG,
    IDS,
    RAW,
    REWARDS,
    capture_step,
    idle_writer,
    loss_scalars,
    microbatch_kwargs,
    rollout_kwargs,
)
from trajectory_replay import capture
from trajectory_replay.bundle import open_native
from trajectory_replay.bundle.markers import COMPLETE, complete_key, rank_key
from trajectory_replay.bundle.schema import StageId
from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR, ENV_ROLLOUTS, ENV_STEPS
from trajectory_replay.errors import TrajectoryReplayError
from trajectory_replay.replay import replay
from trajectory_replay.replay.validate import validate_bundle
from trajectory_replay.store.layout import INFLIGHT_DIR, OBJECTS_DIR

ROLLOUT_STAGES = ["sample", "reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"]


def _replayed(url: str, **storage_options):
    sources = open_native(url, **storage_options)
    report = replay(sources)
    assert report.passed, [(s.stage, s.status, s.message) for s in report.stages]
    assert report.first_divergent_stage is None
    return sources, report


def _all_complete(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root)
        for d, _, files in os.walk(root)
        for f in files
        if f == COMPLETE or f.startswith(f"{COMPLETE}.")
    )


@pytest.mark.parametrize("flat", [False, True])
def test_rollout_bundle_replays(tmp_path, make_manager, flat):
    manager = make_manager(tmp_path)
    assert manager.capture_rollout(120, **rollout_kwargs(flat=flat))
    assert manager.flush(30)
    stats = manager.stats()
    assert stats["enqueued"] == stats["written"] == 1 and stats["errors"] == stats["dropped"] == 0
    assert stats["bytes_enqueued"] > 0 and stats["bytes_in_use"] == 0
    [source], report = _replayed(str(tmp_path / "rollout-120"))
    assert [str(s.stage) for s in report.stages] == ROLLOUT_STAGES
    index = source.full_index()
    assert index.identity.rollout_id == 120 and index.identity.actor_step_id is None
    assert index.identity.weight_lineage.rollout_weight == 6 and index.identity.weight_lineage.actor_weight == 7
    assert [s.sample_id for s in index.samples] == IDS and [s.group_index for s in index.samples] == [0, 0, 1, 1]
    assert [s.loss_mask for s in index.samples] == [[1, 1]] * 4
    assert source.expected == {"reward.raw": {"raw_rewards": RAW}, "reward.post_process": {"rewards": REWARDS}}
    assert set(source.manifest.payloads) == {"old_log_probs", "ref_log_probs", "kl", "advantages", "loss_mask"}
    assert set(source.manifest.stage_contracts) == {StageId(s) for s in ROLLOUT_STAGES}
    assert source.load_payload("kl").tolist() == [-0.25] * 8
    assert index.config.n_samples_per_prompt == 2 and index.config.kl_coef == pytest.approx(0.1)


def test_step_bundle_replays(tmp_path, make_manager):
    manager = make_manager(tmp_path)
    assert capture_step(manager, 120, 3, [[0, 1], [2, 3]], first_mb=7)
    assert manager.flush(30)
    [source], report = _replayed(str(tmp_path / "step-120-3"))
    assert [str(s.stage) for s in report.stages] == ["sample", "loss.policy"]
    index = source.index
    assert index.identity.actor_step_id.rollout_id == 120 and index.identity.actor_step_id.step_id == 3
    assert index.identity.micro_batch_ids == ["mb-0007", "mb-0008"]
    assert [s.micro_batch_id for s in index.samples] == ["mb-0007", "mb-0007", "mb-0008", "mb-0008"]
    assert source.expected == {"loss.policy": loss_scalars(range(4))}
    assert set(source.manifest.payloads) == {"old_log_probs", "log_probs", "entropy", "advantages", "loss_mask"}
    # a micro-batch selection works on the captured ids; a step bundle holds only the cohort-level loss.policy,
    # which a partial selection skips: nothing is compared, so the verdict is unsupported, not pass
    selected = replay([source], batches=["mb-0008"])
    assert selected.status == "unsupported" and "every stage was skipped" not in selected.unsupported_reason
    assert selected.stage("loss.policy").status == "skipped" and selected.stage("sample").status == "pass"


def test_hooks_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "on")
    monkeypatch.setenv(ENV_DIR, f"file://{tmp_path}/run-1")
    monkeypatch.setenv(ENV_STEPS, "5:1")
    monkeypatch.setenv(ENV_ROLLOUTS, "6")
    manager = capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None, writer="thread")
    assert manager is not None and not manager.multi_producer
    assert capture.capture_rollout(5, **rollout_kwargs()) is False  # filtered out
    assert capture.capture_rollout(6, **rollout_kwargs())
    assert capture_step(capture, 5, 0, [[0, 1, 2, 3]]) is False  # filtered out
    assert capture_step(capture, 5, 1, [[0, 1, 2, 3]])
    assert manager.flush(30)
    stats = capture.stats()
    assert stats["written"] == 2 and stats["filtered"] == 3 and stats["errors"] == 0
    assert sorted(p for p in os.listdir(tmp_path / "run-1") if not p.startswith(".")) == [
        "blobs",
        "objects",
        "rollout-6",
        "step-5-1",
    ]
    _replayed(str(tmp_path / "run-1" / "rollout-6"))
    _replayed(str(tmp_path / "run-1" / "step-5-1"))
    assert capture.shutdown(timeout=10)


def test_a_rollout_without_any_kl_needs_neither_reference_log_probs_nor_kl(tmp_path, monkeypatch):
    """A trainer that uses no KL (TRL with beta 0) computes no reference log-probs and no KL: the hook takes the
    rollout without them, and the bundle validates and replays clean (advantage.kl compares nothing)."""
    monkeypatch.setenv(ENV_CAPTURE, "on")
    monkeypatch.setenv(ENV_DIR, f"file://{tmp_path}/run-1")
    capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None, writer="thread")
    kwargs = rollout_kwargs()
    del kwargs["ref_log_probs"], kwargs["kl"]
    kwargs["config"] = CONFIG.model_copy(update={"kl_coef": 0.0})
    assert capture.capture_rollout(7, **kwargs)
    assert capture.shutdown(timeout=10)
    [source], report = _replayed(str(tmp_path / "run-1" / "rollout-7"))
    assert set(source.manifest.payloads) == {"old_log_probs", "advantages", "loss_mask"}
    assert report.stage("advantage.kl").status == "pass"
    assert validate_bundle(str(tmp_path / "run-1" / "rollout-7")).valid
    kwargs["config"] = CONFIG  # a KL in the reward: its `kl` must be recorded
    capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None, writer="thread")
    assert capture.capture_rollout(8, **kwargs)
    assert capture.shutdown(timeout=10)
    assert not replay(open_native(str(tmp_path / "run-1" / "rollout-8"))).passed


def test_two_ranks_write_one_multi_rank_bundle(tmp_path, make_manager):
    # rank 0 has samples 0-2, rank 1 has sample 3: prompt group 1 is split across the ranks
    shards = {0: [0, 1, 2], 1: [3]}
    managers = {r: make_manager(tmp_path, rank=r, expected_ranks=[0, 1]) for r in shards}
    assert managers[1].capture_rollout(9, **rollout_kwargs(shards[1]))
    assert managers[1].flush(30)
    # rank 1 alone landed: no final COMPLETE, the bundle does not exist for replay
    assert _all_complete(tmp_path) == [rank_key("rollout-9", 1)]
    with pytest.raises(TrajectoryReplayError, match="missing ranks"):
        open_native(str(tmp_path / "rollout-9"))
    assert managers[0].capture_rollout(9, **rollout_kwargs(shards[0]))
    for r in shards:
        assert capture_step(managers[r], 9, 0, [shards[r]], first_mb=10 * r)
    for m in managers.values():
        assert m.flush(30) and m.stats()["errors"] == 0
    assert complete_key("rollout-9") in _all_complete(tmp_path)
    sources, report = _replayed(str(tmp_path / "rollout-9"))
    assert [s.rank for s in sources] == [0, 1]
    assert [s.index.samples[-1].sample_id for s in sources] == ["s-2", "s-3"]
    sources, report = _replayed(str(tmp_path / "step-9-0"))
    assert [s.expected["loss.policy"] for s in sources] == [loss_scalars([0, 1, 2]), loss_scalars([3])]
    assert any(s.rank == 1 for s in report.stages if str(s.stage) == "loss.policy")


def test_snapshot_isolation(tmp_path, make_manager):
    manager = make_manager(tmp_path)
    kwargs = rollout_kwargs(flat=True)
    rewards = list(kwargs["rewards"])
    manager.capture_rollout(1, **kwargs)
    kwargs["advantages"].fill_(99.0)  # training reuses its buffers right after the hook
    kwargs["kl"].mul_(5)
    kwargs["rewards"][0] = 1234.0
    kwargs["loss_masks"][0][0] = 0
    mb = microbatch_kwargs([0, 1, 2, 3])
    manager.capture_microbatch(1, 0, "mb-0000", **mb)
    mb["log_probs"].fill_(-7.0)
    mb["sample_ids"][0] = "mutated"
    scalars = loss_scalars(range(4))
    loss = torch.tensor(scalars.pop("loss"))
    manager.capture_step_end(1, 0, loss=loss, config=CONFIG, **scalars)
    loss.fill_(42.0)
    assert manager.flush(30) and manager.stats()["written"] == 2
    [rollout], _ = _replayed(str(tmp_path / "rollout-1"))
    assert rollout.load_payload("advantages").tolist() == [r for r in rewards for _ in range(2)]
    assert rollout.index.samples[0].reward == rewards[0]
    [step], _ = _replayed(str(tmp_path / "step-1-0"))
    assert step.load_payload("log_probs").tolist() == [0.5] * 8
    assert step.index.samples[0].sample_id == "s-0"
    assert step.expected["loss.policy"]["loss"] == pytest.approx(loss_scalars(range(4))["loss"])


def test_repeated_micro_batch_is_ignored(tmp_path, make_manager):
    manager = make_manager(tmp_path)
    assert manager.capture_microbatch(2, 0, "mb-0000", **microbatch_kwargs([0, 1]))
    assert manager.capture_microbatch(2, 0, "mb-0000", **microbatch_kwargs([0, 1])) is False  # e.g. a retry
    assert manager.capture_microbatch(2, 0, "mb-0001", **microbatch_kwargs([2, 3]))
    assert manager.capture_step_end(2, 0, config=CONFIG, **loss_scalars(range(4)))
    assert manager.flush(30)
    assert manager.stats()["ignored_microbatches"] == 1
    [step], _ = _replayed(str(tmp_path / "step-2-0"))
    assert [s.sample_id for s in step.index.samples] == IDS


def test_bad_arguments_are_counted_never_raised(tmp_path, make_manager, caplog):
    manager = make_manager(tmp_path)
    caplog.set_level(logging.WARNING, logger="trajectory_replay.capture")
    bad = rollout_kwargs()
    bad["old_log_probs"] = "not a tensor"
    assert manager.capture_rollout(1, **bad) is False  # fails on the training thread
    short = rollout_kwargs()
    short["rewards"] = short["rewards"][:3]
    assert manager.capture_rollout(2, **short)  # fails on the writer thread
    assert manager.capture_step_end(3, 0, config=CONFIG, **loss_scalars([0])) is False  # no micro-batch
    assert manager.flush(30)
    stats = manager.stats()
    assert stats["errors"] == 3 and stats["written"] == 0
    assert _all_complete(tmp_path) == []
    assert "rollout-2" in caplog.text and "rewards has 3 entries for 4 samples" in caplog.text
    inflight = tmp_path / INFLIGHT_DIR
    assert not inflight.exists() or not os.listdir(inflight)


def test_queue_limits_drop_without_copying(tmp_path, make_manager):
    manager = make_manager(tmp_path, max_queue_bytes=100)  # smaller than one rollout
    assert manager.capture_rollout(1, **rollout_kwargs()) is False
    assert manager.capture_microbatch(1, 0, "mb-0000", **microbatch_kwargs([0, 1, 2, 3])) is False
    assert manager.capture_microbatch(1, 0, "mb-0001", **microbatch_kwargs([0])) is False  # step already dropped
    assert manager.capture_step_end(1, 0, config=CONFIG, **loss_scalars(range(4))) is False
    assert manager.flush(10)
    stats = manager.stats()
    assert stats["dropped"] == 2 and stats["enqueued"] == 0 and stats["errors"] == 0 and stats["bytes_in_use"] == 0
    assert not os.path.exists(tmp_path / "rollout-1")


def test_close_drops_open_steps_and_refuses_more(tmp_path, make_manager):
    manager = make_manager(tmp_path)
    manager.capture_microbatch(1, 0, "mb-0000", **microbatch_kwargs([0, 1]))
    assert manager.close(timeout=10)
    assert manager.capture_rollout(1, **rollout_kwargs()) is False
    stats = manager.stats()
    assert stats["dropped"] == 2 and stats["bytes_in_use"] == 0 and stats["pending_steps"] == 0


def test_slime_adapter(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None, writer="thread")
    kw = rollout_kwargs()
    data = {
        "tokens": [torch.arange(3) for _ in range(4)],
        "response_lengths": kw["response_lengths"],
        "total_lengths": kw["total_lengths"],
        "loss_masks": [torch.ones(2, dtype=torch.int32) for _ in range(4)],
        "rewards": kw["rewards"],
        "raw_reward": kw["raw_rewards"],
        "rollout_log_probs": kw["old_log_probs"],
        "ref_log_probs": kw["ref_log_probs"],
        "advantages": kw["advantages"],
        "kl": kw["kl"],
    }
    # fail closed: no group_index anywhere -> counted, logged, nothing written, nothing raised
    assert capture.capture_slime_rollout(3, data, config=CONFIG) is False
    assert capture.stats()["errors"] == 1
    assert capture.capture_slime_rollout(3, data, config=CONFIG, group_index=[0, 0, 1, 1])
    no_kl = {k: v for k, v in data.items() if k != "kl"}
    assert capture.capture_slime_rollout(4, {**no_kl, "group_index": [0, 0, 1, 1]}, config=CONFIG) is False
    assert capture.capture_slime_rollout(4, {**no_kl, "group_index": [0, 0, 1, 1]}, config=CONFIG, kl=data["kl"])
    assert capture.get_manager().flush(30)
    assert capture.stats()["errors"] == 2 and capture.stats()["written"] == 2
    [source], _ = _replayed(str(tmp_path / "rollout-3"))
    assert [s.sample_id for s in source.index.samples] == [f"s-3-{i}" for i in range(4)]
    _replayed(str(tmp_path / "rollout-4"))


def test_slime_adapter_mapping():
    data = {
        "response_lengths": [2],
        "total_lengths": [3],
        "loss_masks": [[1, 1]],
        "rewards": [0.0],
        "raw_reward": [1.0],
        "log_probs": ["actor"],
        "rollout_log_probs": ["sampler"],
        "advantages": ["a"],
        "kl": ["k"],
        "sample_indices": [17],
        "group_index": [4],
    }
    args = capture.slime_rollout_arguments(5, data)
    assert args["old_log_probs"] == ["actor"] and args["sample_ids"] == ["s-5-17"] and args["group_index"] == [4]
    assert args["raw_rewards"] == [1.0] and args["ref_log_probs"] is None
    positional = {k: v for k, v in data.items() if k != "sample_indices"}
    assert capture.slime_rollout_arguments(5, positional)["sample_ids"] == ["s-5-0"]
    with pytest.raises(ValueError, match="several producer ranks"):
        capture.slime_rollout_arguments(5, positional, multi_producer=True)
    with pytest.raises(ValueError, match="advantages"):
        capture.slime_rollout_arguments(5, {k: v for k, v in data.items() if k != "advantages"})


def test_unfinished_steps_are_bounded(tmp_path, make_manager):
    manager = make_manager(tmp_path, max_pending_steps=1)
    assert manager.capture_microbatch(1, 0, "mb-0000", **microbatch_kwargs([0, 1, 2, 3]))
    assert manager.capture_microbatch(1, 1, "mb-0001", **microbatch_kwargs([0, 1, 2, 3]))  # step 1:0 is dropped
    assert manager.capture_step_end(1, 0, config=CONFIG, **loss_scalars(range(4))) is False
    assert manager.capture_step_end(1, 1, config=CONFIG, **loss_scalars(range(4)))
    assert manager.flush(30)
    stats = manager.stats()
    assert stats["dropped"] == 1 and stats["written"] == 1 and stats["errors"] == 1  # step_end without a step
    assert os.path.exists(tmp_path / complete_key("step-1-1")) and not os.path.exists(tmp_path / "step-1-0")


def test_s3_requests_run_in_a_low_priority_loop(s3_root, make_manager):
    """s3fs runs requests in an event loop thread; capture's is its own and yields the CPU like the writer."""
    import threading

    url, options = s3_root
    manager = make_manager(url, storage_options=options, writer="thread")
    assert capture_step(manager, 5, 0, [[0, 1], [2, 3]])
    assert manager.flush(60) and manager.stats()["errors"] == 0
    [io] = [t for t in threading.enumerate() if t.name == "trajectory-replay-io"]
    assert manager.store.backend.fs.loop is not None and manager.store.backend.fs.loop.is_running()
    assert os.getpriority(os.PRIO_PROCESS, io.native_id) >= 10
    [source], report = _replayed(f"{url}/step-5-0", **options)
    assert report.passed


def test_writer_process_by_default(s3_root, make_manager):
    """By default bundles are written by a child process at lowered priority: none of that work holds
    training's GIL. It writes what the hooks captured, exactly as the thread writer does."""
    url, options = s3_root
    manager, pid = idle_writer(lambda: make_manager(url, storage_options=options, default_writer=True))
    assert manager.writer_mode == "process"
    assert capture_step(manager, 6, 0, [[0, 1], [2, 3]])
    assert manager.capture_rollout(6, **rollout_kwargs())
    assert manager.flush(60) and manager.stats()["written"] == 2 and manager.stats()["errors"] == 0
    child = manager._writer.proc
    assert child.pid == pid and child.poll() is None
    for name in ("step-6-0", "rollout-6"):
        _replayed(f"{url}/{name}", **options)
    assert manager.close(30) and child.poll() is not None  # closing ends the process


def test_writer_process_never_imports_torch_and_writes_what_the_thread_writer_writes(tmp_path, make_manager):
    """The child builds and encodes bundles from raw tensors: torch is never loaded in it, and every payload (the
    micro-batches joined, the loss mask) has the same digest as the thread writer's."""
    managers = {
        "process": idle_writer(lambda: make_manager(tmp_path / "process", writer="process"))[0],
        "thread": make_manager(tmp_path / "thread", writer="thread"),
    }
    for manager in managers.values():
        assert capture_step(manager, 4, 1, [[0, 1], [2, 3]])
        assert manager.capture_rollout(4, **rollout_kwargs(flat=True))
        assert manager.flush(60) and manager.stats()["written"] == 2 and manager.stats()["errors"] == 0
    child = managers["process"]._writer.proc
    with open(f"/proc/{child.pid}/maps", encoding="utf-8") as maps:
        mapped = maps.read()
    assert "libtorch" not in mapped and "blake3" in mapped  # it hashed: it is the process that wrote the bundles
    for name in ("step-4-1", "rollout-4"):
        digests = {}
        for mode in managers:
            [source] = open_native(str(tmp_path / mode / name))
            digests[mode] = {key: spec.digest for key, spec in source.manifest.payloads.items()}
        assert digests["process"] == digests["thread"] and "loss_mask" in digests["thread"], digests


def test_writer_priority_low_is_niced_not_idle(tmp_path, make_manager):
    manager = make_manager(tmp_path / "cap", writer="process", writer_priority="low")
    assert manager.capture_rollout(3, **rollout_kwargs()) and manager.flush(60)
    child = manager._writer.proc
    assert os.sched_getscheduler(child.pid) != os.SCHED_IDLE and os.getpriority(os.PRIO_PROCESS, child.pid) == 10
    _replayed(str(tmp_path / "cap" / "rollout-3"))


def test_writer_process_reports_failures(tmp_path, make_manager, caplog):
    """A record the writer process cannot write is counted and logged in the training process."""
    root = tmp_path / "cap"
    root.mkdir()
    manager, _ = idle_writer(lambda: make_manager(root, writer="process"))
    (root / OBJECTS_DIR).write_text("not a directory")  # every object write fails
    with caplog.at_level(logging.ERROR, logger="trajectory_replay.capture"):
        assert manager.capture_rollout(1, **rollout_kwargs())
        assert manager.flush(60)
    assert manager.stats()["errors"] == 1 and manager.stats()["written"] == 0
    assert any("rollout-1" in r.getMessage() for r in caplog.records)
    assert not (root / complete_key("rollout-1")).exists()
    (root / OBJECTS_DIR).unlink()  # the same process goes on with the next record
    assert manager.capture_rollout(2, **rollout_kwargs()) and manager.flush(60)
    assert manager.stats()["written"] == 1
    _replayed(str(root / "rollout-2"))


def test_writer_choice_is_checked(tmp_path):
    from trajectory_replay.capture import CaptureManager
    from trajectory_replay.store import ObjectStore

    with pytest.raises(ValueError, match="writer must be one of"):
        CaptureManager(tmp_path, writer="fork", start=False)
    with pytest.raises(ValueError, match="writer='process' needs a path or URL"):
        CaptureManager(tmp_path, writer="process", store=ObjectStore.open(str(tmp_path)), start=False)
    with pytest.raises(ValueError, match="writer_priority must be one of idle, low"):
        CaptureManager(tmp_path, writer_priority="high", start=False)
    assert CaptureManager("memory://w", start=False).writer_mode == "thread"
    assert CaptureManager(tmp_path, start=False).writer_mode == "process"


def _threads_scheduling(pid: int) -> set[tuple[int, int]]:
    """(policy, nice) of every thread of process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add((os.sched_getscheduler(int(tid)), os.getpriority(os.PRIO_PROCESS, int(tid))))
        except ProcessLookupError:
            continue
    return out


def test_a_waited_for_writer_runs_normally_and_goes_back_to_idle(tmp_path, make_manager):
    """While the program waits (flush, close) the writer process gets normal scheduling where that is permitted
    (here: as root), every thread of it; when the flush returns, every thread is idle again."""
    manager = make_manager(tmp_path / "cap", writer="process")
    assert manager.capture_rollout(3, **rollout_kwargs()) and manager.flush(120)
    writer = manager._writer
    pid = writer.proc.pid
    assert _threads_scheduling(pid) == {(os.SCHED_IDLE, 10)} or _threads_scheduling(pid) == {(os.SCHED_IDLE, 0)}
    raised = writer.hurry()
    assert raised == (os.geteuid() == 0), "root may raise a priority"
    if raised:
        assert _threads_scheduling(pid) == {(os.SCHED_OTHER, 0)}
    writer.relax()
    assert {policy for policy, _ in _threads_scheduling(pid)} == {os.SCHED_IDLE}
    _replayed(str(tmp_path / "cap" / "rollout-3"))
