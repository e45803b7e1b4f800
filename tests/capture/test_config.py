"""Environment configuration: parsing, every bad value (a clear error naming the variable), off by default."""

from __future__ import annotations

import os
import threading

import pytest

from tests.capture.helpers import microbatch_kwargs, rollout_kwargs
from trajectory_replay import capture
from trajectory_replay.capture import CaptureConfigError, load_config
from trajectory_replay.capture.config import ENV_CAPTURE, ENV_DIR, ENV_ROLLOUTS, ENV_STEPS, ENV_WRITER, OLDER_NAMES
from trajectory_replay.errors import TrajectoryReplayError


def test_off_by_default():
    config = load_config({})
    assert not config.enabled and config.capture_dir is None


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_switch_on(value):
    config = load_config({ENV_CAPTURE: value, ENV_DIR: "/tmp/x"})
    assert config.enabled and config.capture_dir == "/tmp/x"
    assert config.steps is None and config.rollouts is None
    assert config.wants_step(3, 4) and config.wants_rollout(9)


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF", ""])
def test_switch_off_ignores_the_rest(value):
    # while off, the other variables are not read: a bad one cannot break a run that does not capture
    config = load_config({ENV_CAPTURE: value, ENV_STEPS: "garbage", ENV_DIR: "ftp://nope"})
    assert not config.enabled


def test_filters():
    config = load_config(
        {ENV_CAPTURE: "1", ENV_DIR: "s3://bucket/run-42", ENV_STEPS: "1:0, 2:3,2:3", ENV_ROLLOUTS: "4,5"}
    )
    assert config.capture_dir == "s3://bucket/run-42"
    assert config.steps == {(1, 0), (2, 3)} and config.rollouts == {4, 5}
    assert config.wants_step(2, 3) and not config.wants_step(3, 2)
    assert config.wants_rollout(5) and not config.wants_rollout(6)


def test_empty_filters_mean_no_filter():
    config = load_config({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: " ", ENV_ROLLOUTS: ""})
    assert config.steps is None and config.rollouts is None


@pytest.mark.parametrize(
    "env, variable, shown",
    [
        ({ENV_CAPTURE: "2"}, ENV_CAPTURE, "'2'"),
        ({ENV_CAPTURE: "enable"}, ENV_CAPTURE, "'enable'"),
        ({ENV_CAPTURE: "1"}, ENV_DIR, "not set"),
        ({ENV_CAPTURE: "1", ENV_DIR: "  "}, ENV_DIR, "not set"),
        ({ENV_CAPTURE: "1", ENV_DIR: "ftp://host/x"}, ENV_DIR, "'ftp://host/x'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "s3://"}, ENV_DIR, "'s3://'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "3"}, ENV_STEPS, "'3'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "1:2:3"}, ENV_STEPS, "'1:2:3'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "a:1"}, ENV_STEPS, "'a:1'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "1:-1"}, ENV_STEPS, "'1:-1'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "1:1,,2:2"}, ENV_STEPS, "'1:1,,2:2'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "1:"}, ENV_STEPS, "'1:'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "1:²"}, ENV_STEPS, "'1:²'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_ROLLOUTS: "x"}, ENV_ROLLOUTS, "'x'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_ROLLOUTS: "1,-2"}, ENV_ROLLOUTS, "'1,-2'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_ROLLOUTS: "1.5"}, ENV_ROLLOUTS, "'1.5'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_ROLLOUTS: "1,"}, ENV_ROLLOUTS, "'1,'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_ROLLOUTS: "1:2"}, ENV_ROLLOUTS, "'1:2'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", ENV_WRITER: "fork"}, ENV_WRITER, "'fork'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "memory://run", ENV_WRITER: "process"}, ENV_WRITER, "'process'"),
    ],
)
def test_bad_values_name_the_variable(env, variable, shown):
    with pytest.raises(CaptureConfigError) as info:
        load_config(env)
    message = str(info.value)
    assert variable in message and shown in message and "\n" not in message
    assert isinstance(info.value, TrajectoryReplayError)


OLD_CAPTURE, OLD_DIR, OLD_STEPS, OLD_ROLLOUTS, OLD_WRITER = (
    OLDER_NAMES[name] for name in (ENV_CAPTURE, ENV_DIR, ENV_STEPS, ENV_ROLLOUTS, ENV_WRITER)
)


def test_the_names_are_trajectory_replays_and_the_older_tools_names_are_still_read():
    assert ENV_CAPTURE == "TRAJECTORY_REPLAY_CAPTURE" and ENV_DIR == "TRAJECTORY_REPLAY_CAPTURE_DIR"
    assert (OLD_CAPTURE, OLD_DIR, OLD_STEPS, OLD_ROLLOUTS, OLD_WRITER) == (
        "RELAX_REPLAY_CAPTURE",
        "RELAX_REPLAY_CAPTURE_DIR",
        "RELAX_REPLAY_CAPTURE_STEPS",
        "RELAX_REPLAY_CAPTURE_ROLLOUTS",
        "RELAX_REPLAY_CAPTURE_WRITER",
    )
    config = load_config(
        {OLD_CAPTURE: "1", OLD_DIR: "s3://bucket/run-7", OLD_STEPS: "1:0", OLD_ROLLOUTS: "4", OLD_WRITER: "thread"}
    )
    assert (config.enabled, config.capture_dir, config.steps, config.rollouts, config.writer) == (
        True,
        "s3://bucket/run-7",
        {(1, 0)},
        {4},
        "thread",
    )
    assert (config.dir_variable, config.writer_variable) == (OLD_DIR, OLD_WRITER)
    mixed = load_config({ENV_CAPTURE: "1", OLD_DIR: "d", ENV_STEPS: "2:3"})
    assert (mixed.capture_dir, mixed.steps, mixed.dir_variable) == ("d", {(2, 3)}, OLD_DIR)
    assert not load_config({OLD_CAPTURE: "0", OLD_STEPS: "garbage"}).enabled


@pytest.mark.parametrize(
    "env, variable, shown",
    [
        ({OLD_CAPTURE: "2"}, OLD_CAPTURE, "'2'"),
        ({OLD_CAPTURE: "1"}, ENV_DIR, f"required when {OLD_CAPTURE} is on"),
        ({ENV_CAPTURE: "1", OLD_DIR: "ftp://host/x"}, OLD_DIR, "'ftp://host/x'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", OLD_STEPS: "3"}, OLD_STEPS, "'3'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "d", OLD_ROLLOUTS: "x"}, OLD_ROLLOUTS, "'x'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "memory://run", OLD_WRITER: "process"}, OLD_WRITER, "'process'"),
    ],
)
def test_a_bad_value_under_an_older_name_is_named_as_it_was_set(env, variable, shown):
    with pytest.raises(CaptureConfigError) as info:
        load_config(env)
    assert str(info.value).startswith(variable) and shown in str(info.value) and "\n" not in str(info.value)


def test_both_names_set_to_the_same_meaning_is_that_setting():
    config = load_config(
        {
            ENV_CAPTURE: "1",
            OLD_CAPTURE: " yes",
            ENV_DIR: "d",
            OLD_DIR: "d ",
            ENV_STEPS: "1:0,2:0",
            OLD_STEPS: "2:0, 1:0",
            ENV_WRITER: "thread",
            OLD_WRITER: "THREAD",
            OLD_ROLLOUTS: "",
        }
    )
    assert (config.enabled, config.capture_dir, config.steps, config.rollouts, config.writer) == (
        True,
        "d",
        {(1, 0), (2, 0)},
        None,
        "thread",
    )
    assert (config.dir_variable, config.writer_variable) == (ENV_DIR, ENV_WRITER)


@pytest.mark.parametrize(
    "env, new, old",
    [
        ({ENV_CAPTURE: "1", OLD_CAPTURE: "0", ENV_DIR: "d"}, f"{ENV_CAPTURE}='1'", f"{OLD_CAPTURE}='0'"),
        ({ENV_CAPTURE: "off", OLD_CAPTURE: "on"}, f"{ENV_CAPTURE}='off'", f"{OLD_CAPTURE}='on'"),
        ({ENV_CAPTURE: "1", ENV_DIR: "a", OLD_DIR: "b"}, f"{ENV_DIR}='a'", f"{OLD_DIR}='b'"),
        (
            {ENV_CAPTURE: "1", ENV_DIR: "d", ENV_STEPS: "1:0", OLD_STEPS: "1:1"},
            f"{ENV_STEPS}='1:0'",
            f"{OLD_STEPS}='1:1'",
        ),
        (
            {ENV_CAPTURE: "1", ENV_DIR: "d", ENV_ROLLOUTS: "1", OLD_ROLLOUTS: "2"},
            f"{ENV_ROLLOUTS}='1'",
            f"{OLD_ROLLOUTS}='2'",
        ),
        (
            {ENV_CAPTURE: "1", ENV_DIR: "d", ENV_WRITER: "auto", OLD_WRITER: "thread"},
            f"{ENV_WRITER}='auto'",
            f"{OLD_WRITER}='thread'",
        ),
    ],
)
def test_both_names_set_to_different_values_is_a_config_error_naming_both(env, new, old):
    with pytest.raises(CaptureConfigError) as info:
        load_config(env)
    message = str(info.value)
    assert message.startswith(f"{new} and {old} disagree: set one of them") and "\n" not in message


def test_disagreeing_names_stop_capture_at_startup_and_start_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "new"))
    monkeypatch.setenv(OLD_DIR, str(tmp_path / "old"))
    before = threading.active_count()
    with pytest.raises(CaptureConfigError, match=f"{ENV_DIR}=.* and {OLD_DIR}=.* disagree"):
        capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None)
    assert capture.get_manager() is None and threading.active_count() == before and os.listdir(tmp_path) == []


def test_a_store_that_cannot_open_names_the_directory_variable_as_it_was_set(monkeypatch):
    monkeypatch.setenv(OLD_CAPTURE, "1")
    monkeypatch.setenv(OLD_DIR, "s3://ab/x")  # a bucket name needs 3+ characters
    with pytest.raises(CaptureConfigError, match=f"^{OLD_DIR}="):
        capture.maybe_enable_for_actor(0, True, [0])
    assert capture.get_manager() is None


def test_maybe_enable_raises_config_errors_at_startup(monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "maybe")
    with pytest.raises(CaptureConfigError, match=ENV_CAPTURE):
        capture.maybe_enable_for_actor(0, True, [0])
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, "s3://ab/x")  # a bucket name needs 3+ characters
    with pytest.raises(CaptureConfigError, match=ENV_DIR):
        capture.maybe_enable_for_actor(0, True, [0])
    assert capture.get_manager() is None


def test_capture_off_starts_nothing_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cap"))  # a directory is named, but the switch is off
    before = threading.active_count()
    assert capture.maybe_enable_for_actor(0, True, [0]) is None
    assert capture.get_manager() is None and capture.stats() is None
    assert capture.capture_rollout(1, **rollout_kwargs()) is None
    assert capture.capture_microbatch(1, 0, "mb-0000", **microbatch_kwargs([0, 1])) is None
    assert capture.capture_step_end(1, 0, loss=0, pg_loss=0, entropy_loss=0, pg_clipfrac=0, ppo_kl=0, config={}) is None
    assert capture.capture_slime_rollout(1, {}, config={}) is None
    assert threading.active_count() == before
    assert not (tmp_path / "cap").exists() and os.listdir(tmp_path) == []


def test_non_producer_ranks_stay_silent(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cap"))
    before = threading.active_count()
    assert capture.maybe_enable_for_actor(3, False, [0, 1]) is None
    assert capture.get_manager() is None
    assert threading.active_count() == before
    assert not (tmp_path / "cap").exists()


def test_writer_from_the_environment():
    on = {ENV_CAPTURE: "1", ENV_DIR: "d"}
    assert load_config(on).writer is None and load_config({**on, ENV_WRITER: " "}).writer is None
    assert load_config({**on, ENV_WRITER: " Thread"}).writer == "thread"
    assert load_config({ENV_WRITER: "fork"}).writer is None  # capture off: not read


def test_producer_rank_starts_one_writer(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "yes")
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cap"))
    monkeypatch.setenv(ENV_WRITER, "thread")
    before = threading.active_count()
    manager = capture.maybe_enable_for_actor(1, True, [0, 1], atexit_timeout=None)
    assert manager is capture.get_manager() and manager.running and manager.writer_mode == "thread"
    assert manager.multi_producer and manager.rank == 1 and manager.expected_ranks == [0, 1]
    assert threading.active_count() == before + 1
    assert capture.shutdown(timeout=10)
    assert capture.get_manager() is None and not manager.running
    assert threading.active_count() == before


def test_a_writer_the_program_passes_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cap"))
    monkeypatch.setenv(ENV_WRITER, "process")
    manager = capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None, writer="thread")
    assert manager.writer_mode == "thread"
    assert capture.shutdown(timeout=10)


def test_a_writer_process_from_the_environment_with_a_store_object_is_a_config_error(tmp_path, monkeypatch):
    from trajectory_replay.store import ObjectStore

    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "cap"))
    monkeypatch.setenv(ENV_WRITER, "process")
    with pytest.raises(CaptureConfigError, match=ENV_WRITER):
        capture.maybe_enable_for_actor(0, True, [0], atexit_timeout=None, store=ObjectStore.open(str(tmp_path / "cap")))
    assert capture.get_manager() is None


def test_rank_must_be_expected(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CAPTURE, "1")
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    with pytest.raises(ValueError, match="expected_ranks"):
        capture.maybe_enable_for_actor(2, True, [0, 1])
