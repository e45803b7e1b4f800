"""Capture policies and the flight recorder: parsing, every:N, the spool and its bounds, every trigger, promotion
(only missing objects, the trigger in the manifest), two ranks in two processes, and a killed training process."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.capture.helpers import CONFIG, capture_step, loss_scalars, microbatch_kwargs, rollout_kwargs
from trajectory_replay import capture
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle.reader import open_native
from trajectory_replay.bundle.schema import TriggerRecord
from trajectory_replay.bundle.status import COMPLETE_STATUS, scan_bundles
from trajectory_replay.capture import CaptureConfigError, load_config
from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR, ENV_POLICY, ENV_SPOOL, ENV_STEPS
from trajectory_replay.capture.recorder import Recorder, RecorderSettings, TriggerSettings, promote
from trajectory_replay.ops.gc import collect_garbage
from trajectory_replay.store import ObjectStore

REPO = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {ENV_CAPTURE: "1", ENV_DIR: str(tmp_path / "store"), ENV_SPOOL: str(tmp_path / "spool"), **extra}


def _names(root: Path) -> list[str]:
    return sorted(s.name for s in scan_bundles(open_backend(str(root))) if s.status == COMPLETE_STATUS)


def _markers(root: Path) -> dict[str, dict]:
    folder = root / ".recorder"
    return {p.name: json.loads(p.read_text()) for p in folder.iterdir()} if folder.exists() else {}


def _spool_steps(spool: Path) -> list[str]:
    return [n for n in _names(spool) if n.startswith("step-")]


def _run(manager, rollouts: int, steps: int, on_step=None) -> None:
    for r in range(rollouts):
        manager.capture_rollout(r, **rollout_kwargs())
        for s in range(steps):
            if on_step is None or not on_step(manager, r, s):
                capture_step(manager, r, s, [[0, 1], [2, 3]])
    assert manager.flush(120)


# ---- policies --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, kind, shown",
    [
        ("", "all", "all"),
        ("all", "all", "all"),
        ("every:3", "every", "every:3"),
        ("every=2", "every", "every:2"),
        ("steps=1:0,2:3", "steps", "steps=1:0,2:3"),
        ("recorder:8", "recorder", "recorder:8,after=0,max_bytes=8589934592"),
        ("recorder:4,after=2,max_bytes=64M", "recorder", "recorder:4,after=2,max_bytes=67108864"),
        (" Recorder=2 , max_bytes=1024 ", "recorder", "recorder:2,after=0,max_bytes=1024"),
    ],
)
def test_policy_values(tmp_path, value, kind, shown):
    config = load_config(_env(tmp_path, **{ENV_POLICY: value}))
    assert config.policy.kind == kind and str(config.policy) == shown
    assert config.spool == str(tmp_path / "spool")


@pytest.mark.parametrize(
    "value, says",
    [
        ("every:0", "N >= 1"),
        ("every", "expected all"),
        ("recorder:0", "K >= 1"),
        ("recorder:x", "'x' is not a non-negative integer"),
        ("recorder:8,before=2", "unknown recorder option 'before=2'"),
        ("recorder:8,max_bytes=lots", "max_bytes 'lots' is not a size"),
        ("steps=", "names no step"),
        ("sometimes", "expected all"),
    ],
)
def test_bad_policy_is_one_line_naming_the_variable(tmp_path, value, says):
    with pytest.raises(CaptureConfigError) as err:
        load_config(_env(tmp_path, **{ENV_POLICY: value}))
    message = str(err.value)
    assert message.startswith(f"{ENV_POLICY}={value!r}: ") and says in message and "\n" not in message


def test_spool_must_be_local(tmp_path):
    with pytest.raises(CaptureConfigError, match=f"{ENV_SPOOL}='s3://b/spool': the spool is a local directory"):
        load_config(_env(tmp_path, **{ENV_SPOOL: "s3://b/spool"}))


def test_the_steps_variable_keeps_working_beside_a_policy(tmp_path):
    assert load_config(_env(tmp_path, **{ENV_STEPS: "1:2"})).steps == {(1, 2)}
    assert load_config(_env(tmp_path, **{ENV_STEPS: "1:2", ENV_POLICY: "steps=1:2"})).steps == {(1, 2)}
    with pytest.raises(CaptureConfigError, match="disagree"):
        load_config(_env(tmp_path, **{ENV_STEPS: "1:2", ENV_POLICY: "steps=1:3"}))
    with pytest.raises(CaptureConfigError, match="a step filter goes with the policy all or steps="):
        load_config(_env(tmp_path, **{ENV_STEPS: "1:2", ENV_POLICY: "recorder:4"}))


def test_without_a_spool_set_each_store_gets_its_own(tmp_path):
    """Two jobs on one host that capture into different stores never share (and clear) a spool; a relaunch of a
    job into the same store finds the spool its predecessor left."""
    from trajectory_replay.capture.config import DEFAULT_SPOOL
    from trajectory_replay.capture.manager import CaptureManager

    spools = []
    for store in ("a", "b", "a"):
        manager = CaptureManager(str(tmp_path / store), policy="recorder:2", writer="thread")
        assert manager.recorder is not None
        spools.append(manager.recorder.spool)
        manager.close(10)
    assert spools[0] != spools[1] and spools[0] == spools[2]
    assert all(os.path.dirname(os.path.dirname(s)) == DEFAULT_SPOOL and s.endswith("rank-0") for s in spools)
    for spool in set(spools):
        shutil.rmtree(os.path.dirname(spool), ignore_errors=True)


def test_the_integration_passes_a_policy_and_the_environment_wins(tmp_path):
    manager = capture.maybe_enable(0, True, [0], environ=_env(tmp_path), policy="every:2", writer="thread")
    assert manager is not None and str(manager.policy) == "every:2"
    capture.shutdown(10)
    env = _env(tmp_path, **{ENV_POLICY: "recorder:3"})
    manager = capture.maybe_enable(0, True, [0], environ=env, policy="every:2", writer="thread")
    assert manager is not None and manager.recorder is not None and manager.recorder.keep == 3
    assert manager.recorder.spool == str(tmp_path / "spool" / "rank-0")
    capture.shutdown(10)
    with pytest.raises(CaptureConfigError, match="policy='every:0': every:N needs N >= 1"):
        capture.maybe_enable(0, True, [0], environ=_env(tmp_path), policy="every:0")


def test_every_n_keeps_every_nth_step(tmp_path, make_manager):
    manager = make_manager(tmp_path / "store", policy="every:3")
    _run(manager, 2, 4)
    steps = [n for n in _names(tmp_path / "store") if n.startswith("step-")]
    assert steps == ["step-0-0", "step-0-3", "step-1-2"]  # the 1st, 4th and 7th of 8 steps
    assert manager.stats()["filtered"] > 0


def test_trigger_is_refused_under_another_policy(tmp_path, make_manager):
    capture.set_manager(make_manager(tmp_path / "store"))
    assert capture.trigger("why") is False


# ---- the recorder ------------------------------------------------------------------------------------------------
def _recorder(make_manager, tmp_path, policy: str, **options):
    return make_manager(tmp_path / "store", policy=policy, spool=tmp_path / "spool", **options)


def test_a_trigger_keeps_k_steps_up_to_it_and_m_after(tmp_path, make_manager):
    manager = _recorder(make_manager, tmp_path, "recorder:3,after=2")

    def user(m, r, s):
        if (r, s) == (2, 1):
            m.trigger("look at this step")  # fires at the next step this rank ends: step-2-1
        return False

    _run(manager, 5, 2, user)
    assert _names(tmp_path / "store") == [
        "rollout-1",
        "rollout-2",
        "rollout-3",
        "step-1-1",
        "step-2-0",
        "step-2-1",
        "step-3-0",
        "step-3-1",
    ]
    for name in _names(tmp_path / "store"):
        trigger = open_native(f"{tmp_path}/store/{name}")[0].manifest.trigger
        assert trigger == TriggerRecord(name="user", value="look at this step", step="step-2-1", rank=0)
    assert _markers(tmp_path / "store") == {"step-2-1": {**trigger.model_dump(mode="json")}}
    # the spool holds the last K steps and the rollout-level bundles they name
    assert _spool_steps(tmp_path / "spool" / "rank-0") == ["step-3-1", "step-4-0", "step-4-1"]


def test_a_bundle_captured_without_a_trigger_has_none(tmp_path, make_manager):
    manager = make_manager(tmp_path / "store")
    _run(manager, 1, 1)
    assert open_native(f"{tmp_path}/store/step-0-0")[0].manifest.trigger is None
    raw = (tmp_path / "store").rglob("objects/*/*")
    assert not any(b'"trigger"' in p.read_bytes() for p in raw if p.is_file())  # the optional field is left out


def test_the_spool_stays_under_its_bytes(tmp_path, make_manager):
    bound = 48 << 10
    manager = _recorder(make_manager, tmp_path, f"recorder:100,max_bytes={bound}")
    spool = tmp_path / "spool" / "rank-0"
    peak = 0
    for r in range(12):
        manager.capture_rollout(r, **rollout_kwargs())
        for s in range(3):
            big = {**microbatch_kwargs([0, 1, 2, 3])}
            big["log_probs"] = torch.randn(8) + r * 10 + s  # a payload of its own in every step
            manager.capture_microbatch(r, s, "mb-0", **big)
            manager.capture_step_end(r, s, config=CONFIG, **loss_scalars([0, 1, 2, 3]))
            assert manager.flush(60)
            size = sum(p.stat().st_size for p in spool.rglob("*") if p.is_file())
            peak = max(peak, size)
    assert peak <= bound
    assert 1 < len(_spool_steps(spool)) < 36  # evicted by bytes, not by the 100 steps of K


def _step_with(manager, r: int, s: int, *, grad_norm=None, **changes) -> None:
    mb = microbatch_kwargs([0, 1, 2, 3])
    scalars = loss_scalars([0, 1, 2, 3])
    for key, value in changes.items():
        (mb if key in mb else scalars)[key] = value
    manager.capture_microbatch(r, s, "mb-0", **mb)
    manager.capture_step_end(r, s, config=CONFIG, grad_norm=grad_norm, **scalars)


@pytest.mark.parametrize(
    "case, name",
    [
        ("nan loss", "nan_loss"),
        ("inf grad norm", "nan_grad_norm"),
        ("nan payload", "nan_payload"),
        ("loss spike", "loss_spike"),
        ("grad norm spike", "grad_norm_spike"),
        ("mismatch", "mismatch_kl_k3"),
        ("reward collapse", "reward_collapse"),
    ],
)
def test_each_trigger_fires_once_on_its_condition(tmp_path, make_manager, case, name):
    manager = _recorder(make_manager, tmp_path, "recorder:2", triggers=TriggerSettings(spike_min_steps=4))
    for r in range(8):
        fault = r >= 6
        rollout = rollout_kwargs()
        if case == "mismatch" and fault:
            rollout["mismatch_metrics"] = {"kl_k3": 0.9}
            rollout["rollout_log_probs"] = rollout["old_log_probs"]
        if case == "reward collapse" and fault:
            rollout["raw_rewards"] = [1.0, 1.0, 2.0, 2.0]
        manager.capture_rollout(r, **rollout)
        noise = 0.01 * math.sin(r)
        changes: dict = {"loss": -0.5 + noise}
        grad = 1.0 + noise
        if fault:
            if case == "nan loss":
                changes["loss"] = float("nan")
            elif case == "inf grad norm":
                grad = math.inf
            elif case == "nan payload":
                changes["log_probs"] = torch.tensor([0.5] * 7 + [float("nan")])
            elif case == "loss spike":
                changes["loss"] = 5.0
            elif case == "grad norm spike":
                grad = 100.0
        _step_with(manager, r, 0, grad_norm=grad, **changes)
    assert manager.flush(60)
    markers = _markers(tmp_path / "store")
    # a condition that holds step after step (steps 6 and 7) fires once; a rollout's trigger is at its next step
    assert [m["name"] for m in markers.values()] == [name]
    assert list(markers) == ["step-6-0"]
    assert _names(tmp_path / "store") == ["rollout-5", "rollout-6", "step-5-0", "step-6-0"]


def test_promotion_sends_only_what_the_store_lacks(tmp_path, make_manager):
    manager = make_manager(tmp_path / "spool", policy="all")
    _run(manager, 1, 2)  # two steps of the same payloads but the log-probs' micro-batch ids
    store = ObjectStore.open(str(tmp_path / "store"))
    spool = open_backend(str(tmp_path / "spool"))
    trigger = TriggerRecord(name="user", value="x", step="step-0-1")
    first = promote(spool, store, "step-0-0", trigger, 0, [0])
    second = promote(spool, store, "step-0-1", trigger, 0, [0])
    assert first.objects_copied > 0 and first.objects_skipped == 0
    assert second.objects_skipped > 0 and second.objects_copied < first.objects_copied
    again = promote(spool, store, "step-0-1", trigger, 0, [0])
    assert again.objects_copied == 0 and again.markers_written == 0
    assert _names(tmp_path / "store") == ["step-0-0", "step-0-1"]


# ---- processes ---------------------------------------------------------------------------------------------------
RANK_SCRIPT = """
import os, sys, time
sys.path.insert(0, {repo!r})
from tests.capture.helpers import capture_step, rollout_kwargs
from trajectory_replay.capture.manager import CaptureManager

rank, world, root, steps, fire_at = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
manager = CaptureManager(root + "/store", rank=rank, expected_ranks=list(range(world)), policy="recorder:3",
                         spool=root + "/spool", atexit_timeout=None, run_id="run-1")
manager.capture_rollout(0, **rollout_kwargs([2 * rank, 2 * rank + 1]))
for s in range(steps):
    if fire_at == f"{{rank}}:{{s}}":
        manager.trigger("rank %d saw something" % rank)
    capture_step(manager, 0, s, [[2 * rank, 2 * rank + 1]])
    assert manager.flush(120)
    open(f"{{root}}/done-{{rank}}-{{s}}", "w").close()
    if world > 1:  # in step with the other rank, as a collective would keep them
        while not os.path.exists(f"{{root}}/done-{{1 - rank}}-{{s}}"):
            time.sleep(0.01)
print("steps done", flush=True)
manager.close(120)
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK_SCRIPT.format(repo=str(REPO)))
    return path


def test_a_trigger_on_one_rank_promotes_the_same_steps_on_every_rank(tmp_path):
    script = _script(tmp_path)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), "2", str(tmp_path), "7", "1:3"]) for r in range(2)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    states = {s.name: s for s in scan_bundles(open_backend(str(tmp_path / "store")))}
    assert sorted(states) == ["rollout-0", "step-0-1", "step-0-2", "step-0-3"]
    assert all(s.status == COMPLETE_STATUS and s.expected_ranks == [0, 1] for s in states.values())
    assert _markers(tmp_path / "store")["step-0-3"]["rank"] == 1
    for rank in (0, 1):
        (reader,) = open_native(f"{tmp_path}/store/step-0-2/rank-{rank}")
        assert reader.manifest.trigger is not None and reader.manifest.trigger.step == "step-0-3"


def test_a_killed_process_leaves_no_partial_bundle_and_a_spool_gc_cleans(tmp_path):
    script = _script(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, str(script), "0", "1", str(tmp_path), "100000", "0:40"], stdout=subprocess.PIPE
    )
    try:
        while not list((tmp_path / "store").glob("*/COMPLETE")):  # killed while it promotes (or a little later)
            assert proc.poll() is None, "the training process ended before its trigger"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # every bundle in the store is complete: a promotion cut short left objects no marker names
    states = scan_bundles(open_backend(str(tmp_path / "store")))
    assert states and all(s.status == COMPLETE_STATUS for s in states)
    assert list(_markers(tmp_path / "store")) == ["step-0-40"]
    spool = tmp_path / "spool" / "rank-0"
    kept = _spool_steps(spool)
    assert 1 <= len(kept) <= 3  # the spool's bound held to the end
    assert collect_garbage(str(spool), grace=0).failures() == []
    assert _spool_steps(spool) == kept  # a spool is a store: gc keeps its complete bundles, removes the rest
    # a recorder starting on that spool (the next launch) clears it
    Recorder(RecorderSettings(spool=str(spool), keep=3), ObjectStore.open(str(tmp_path / "store")))
    assert _names(spool) == [] and not any(p.is_file() for p in (spool / "objects").rglob("*"))


def test_a_promotion_that_fails_is_counted_and_the_recorder_goes_on(tmp_path, make_manager):
    other = make_manager(tmp_path / "store")
    other.capture_rollout(0, **rollout_kwargs())
    other.capture_microbatch(0, 0, "mb-0", **microbatch_kwargs([0, 1, 2, 3]))
    other.capture_step_end(0, 0, config=CONFIG, **{**loss_scalars([0, 1, 2, 3]), "loss": 123.0})
    assert other.flush(60)
    manager = _recorder(make_manager, tmp_path, "recorder:2")

    def user(m, r, s):
        if (r, s) == (0, 1):
            m.trigger("keep")
        return False

    _run(manager, 1, 3, user)  # the trigger is at step-0-1: step-0-0 (taken by another bundle) and step-0-1
    assert manager.stats()["errors"] == 0
    counts = manager._writer.recorder.counts
    # step-0-1, and rollout-0, which was there already with the same documents; step-0-0 failed
    assert counts["promotion_errors"] == 1 and counts["promoted"] == 2
    store = {s.name: s for s in scan_bundles(open_backend(str(tmp_path / "store")))}
    assert sorted(store) == ["rollout-0", "step-0-0", "step-0-1"]
    assert open_native(f"{tmp_path}/store/step-0-0")[0].manifest.trigger is None  # the other bundle, untouched
