"""The CPUs free: affinity, control group quotas (v2 and v1) and the load of other processes, read from real files
laid out as Linux lays them out, and $TRAJECTORY_REPLAY_THREADS."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.bundle.helpers import write_canonical
from trajectory_replay.cli import app
from trajectory_replay.cpus import (
    THREADS_ENV,
    affinity_cpus,
    cgroup_quota,
    cpus_left,
    free_cpus,
    other_load,
    threads_for,
    usable_cpus,
)
from trajectory_replay.errors import UsageError


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _proc(root: Path, loadavg: str, running: int = 1, cpu_seconds: float = 0.0, alive: float = 100.0) -> Path:
    """A /proc of a process with `running` threads running, `cpu_seconds` of CPU used over the `alive` seconds
    since it started, on a host whose /proc/loadavg reads `loadavg`."""
    ticks = os.sysconf("SC_CLK_TCK")
    _write(root / "loadavg", loadavg)
    _write(root / "uptime", f"{1000.0 + alive:.2f} 1800.00")
    used = round(cpu_seconds * ticks)
    # fields 3.. after "(comm)": state, 10 fields, utime, stime, 6 fields, starttime (field 22)
    fields = ["R", *["0"] * 10, str(used), "0", *["0"] * 6, str(1000 * ticks), "0"]
    _write(root / "self" / "stat", f"4242 (python (a) b) {' '.join(fields)}")
    for i in range(running + 2):  # and two threads asleep
        _write(root / "self" / "task" / str(4242 + i) / "stat", f"{4242 + i} (python) {'R' if i < running else 'S'} 1")
    return root


def test_a_v2_quota_is_its_cpus_and_max_is_none(tmp_path):
    _write(tmp_path / "cpu.max", "150000 100000")
    assert cgroup_quota(tmp_path) == 1.5
    _write(tmp_path / "cpu.max", "max 100000")
    assert cgroup_quota(tmp_path) is None


@pytest.mark.parametrize("group", ["cpu", "cpu,cpuacct"])
def test_a_v1_quota_is_its_quota_over_its_period_and_minus_one_is_none(tmp_path, group):
    _write(tmp_path / group / "cpu.cfs_quota_us", "50000")
    _write(tmp_path / group / "cpu.cfs_period_us", "100000")
    assert cgroup_quota(tmp_path) == 0.5
    _write(tmp_path / group / "cpu.cfs_quota_us", "-1")
    assert cgroup_quota(tmp_path) is None


def test_no_cgroup_files_or_unreadable_ones_mean_no_quota(tmp_path):
    assert cgroup_quota(tmp_path) is None
    _write(tmp_path / "cpu.max", "lots")
    assert cgroup_quota(tmp_path) is None


def test_usable_cpus_are_the_affinity_capped_by_the_quota(tmp_path):
    assert affinity_cpus() == len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity_cpus()  # no quota
    _write(tmp_path / "cpu.max", "50000 100000")
    assert usable_cpus(tmp_path) == 0.5
    _write(tmp_path / "cpu.max", f"{(affinity_cpus() + 3) * 100000} 100000")
    assert usable_cpus(tmp_path) == affinity_cpus()  # a quota above the CPUs it may run on


def test_cpus_left_round_to_the_nearest_and_never_below_one():
    assert cpus_left(2, 0.2) == 2
    assert cpus_left(2, 0.9) == 1
    assert cpus_left(2, 7.0) == 1
    assert cpus_left(8, 2.6) == 5
    assert cpus_left(0.5, 0.0) == 1


def test_the_load_of_others_is_the_average_or_the_runnable_now_less_our_own(tmp_path):
    host = os.cpu_count()
    # the last minute's average: 3 runnable, none of it this process's (it just started)
    assert other_load(host, _proc(tmp_path / "a", "3.00 2.00 1.00 1/300 99")) == pytest.approx(3.0)
    # the same average, of which this process used one CPU all along: two are others'
    assert other_load(host, _proc(tmp_path / "b", "3.00 2.00 1.00 1/300 99", cpu_seconds=100)) == pytest.approx(2.0)
    # the average lags behind two busy loops just started: the tasks runnable now, less ours, say so
    assert other_load(host, _proc(tmp_path / "c", "0.10 0.10 0.10 4/300 99", running=2)) == pytest.approx(2.0)
    # others' load is spread over all the host's CPUs: two per CPU, of which one CPU is ours
    assert other_load(1, _proc(tmp_path / "d", f"{2.0 * host} 1.00 1.00 1/300 99")) == pytest.approx(2.0)


def test_free_cpus_follow_the_load_of_others(tmp_path):
    _write(tmp_path / "cg" / "cpu.max", "200000 100000")
    usable = min(2, affinity_cpus())
    share = usable / max(usable, os.cpu_count())  # of the host's load, what falls on the CPUs we may use
    assert free_cpus(tmp_path / "cg", _proc(tmp_path / "quiet", "0.00 0.00 0.00 1/300 99")) == usable
    busy = f"{7.0 / share:.2f} 7.00 7.00 8/300 99"
    assert free_cpus(tmp_path / "cg", _proc(tmp_path / "busy", busy)) == 1
    one_busy_core = f"{1.0 / share:.2f} 1.00 1.00 2/300 99"
    assert free_cpus(tmp_path / "cg", _proc(tmp_path / "one", one_busy_core)) == max(1, usable - 1)


def test_the_real_host_gives_an_answer_within_its_cpus():
    assert 1 <= free_cpus() <= affinity_cpus()
    assert 1 <= threads_for(1000) <= affinity_cpus() and threads_for(1) == 1


def test_the_environment_replaces_the_estimate(tmp_path, monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    busy = _proc(tmp_path, "50.00 50.00 50.00 60/300 99")
    assert free_cpus(tmp_path, busy) == 3 and threads_for(8) == 3 and threads_for(2) == 2
    for wrong in ("0", "-2", "two"):
        monkeypatch.setenv(THREADS_ENV, wrong)
        with pytest.raises(UsageError, match=f"{THREADS_ENV}='{wrong}': expected a positive number of threads"):
            threads_for(2)


def test_a_wrong_thread_count_is_one_line_and_exit_2(tmp_path):
    bundle = write_canonical(str(tmp_path / "store"))
    result = CliRunner().invoke(app, ["replay", bundle], env={THREADS_ENV: "many"})
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.strip() == (
        f"trajectory-replay: error: {THREADS_ENV}='many': expected a positive number "
        "of threads (or unset it to follow the CPUs free)"
    ), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
