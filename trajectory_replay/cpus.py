"""How many CPUs this process can actually use now: what sizes every pool of CPU work (torch's threads in a
replay, the thread and the process that read ahead of them, a scan's workers).

Three things cap it: the CPUs the process may run on (its affinity), the CPU time its control group may use (a
cgroup quota: a container's `--cpus`), and the other processes that want those CPUs now (the system's load, less
this process's own share of it). A parallel torch operation cut into more parts than there are free CPUs waits on every
call for the part that was descheduled: on a two-core host with the other core busy, replay's kernels on two
threads took several times the CPU of the same kernels on one.

`$TRAJECTORY_REPLAY_THREADS` (a positive number) replaces the estimate. `one_core_for_cpu_work` gives a thread one
core of its own: its pools of CPU work then run on it alone.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trajectory_replay.errors import UsageError

THREADS_ENV = "TRAJECTORY_REPLAY_THREADS"
"""Environment variable that replaces the estimate of the CPUs free (a positive number of threads)."""

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the control groups are mounted (within a container, its own group is the root)."""

PROC = Path("/proc")


def free_cpus(cgroup_root: Path = CGROUP_ROOT, proc: Path = PROC) -> int:
    """The CPUs this process can use now, at least 1: $TRAJECTORY_REPLAY_THREADS if set, else the CPUs it may use
    less the runnable load of the others on them."""
    override = threads_override()
    if override is not None:
        return override
    usable = usable_cpus(cgroup_root)
    return cpus_left(usable, other_load(usable, proc))


def threads_for(default: int) -> int:
    """The threads for CPU work that would otherwise run on `default`: `default` capped by the CPUs free now."""
    return min(default, free_cpus())


def threads_override() -> int | None:
    """$TRAJECTORY_REPLAY_THREADS as a number of threads, None when unset."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise UsageError(
            f"{THREADS_ENV}={text[:40]!r}: expected a positive number of threads (or unset it to follow the CPUs free)"
        )
    return value


def cpus_left(usable: float, others: float) -> int:
    """The CPUs of `usable` that a runnable load of `others` leaves, to the nearest whole one, at least 1."""
    return max(1, math.floor(usable - max(0.0, others) + 0.5))


def usable_cpus(cgroup_root: Path = CGROUP_ROOT) -> float:
    """The CPUs this process may run on (its affinity), capped by its control group's CPU quota."""
    quota = cgroup_quota(cgroup_root)
    return min(float(affinity_cpus()), quota) if quota is not None else float(affinity_cpus())


def affinity_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPUs' worth of time per period that the control group mounted at `root` may use (cgroup v2 `cpu.max`,
    else v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us`); None when there is no quota or nothing can be read."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        fields = v2.split()
        return _ratio(fields[0], fields[1]) if len(fields) == 2 else None
    for group in ("cpu", "cpu,cpuacct"):
        quota, period = _read(root / group / "cpu.cfs_quota_us"), _read(root / group / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return _ratio(quota, period)
    return None


def other_load(usable: float, proc: Path = PROC) -> float:
    """The runnable load of the other processes on the `usable` CPUs: the larger of the last minute's load average
    and the tasks runnable right now (the average lags a minute behind a process that just started), less this
    process's own share of each, spread evenly over the host's CPUs."""
    text = _read(proc / "loadavg")
    if text is None:  # pragma: no cover - not Linux
        return 0.0
    fields = text.split()
    average, runnable = float(fields[0]), int(fields[3].split("/")[0])
    others = max(average - own_average(proc), runnable - own_running(proc), 0.0)
    return others * usable / max(usable, os.cpu_count() or 1)


def own_running(proc: Path = PROC) -> int:
    """This process's threads that are running or runnable now (the caller's among them)."""
    running = 0
    for task in (proc / "self" / "task").glob("*"):
        stat = _read(task / "stat")
        # the state follows the command name, which is in parentheses and may hold anything
        if stat is not None and stat[stat.rfind(")") + 2 :].startswith("R"):
            running += 1
    return max(1, running)


def own_average(proc: Path = PROC) -> float:
    """The CPUs this process has used on average since it started: its share of the load average, for a process
    that has been at work as long as the average reaches back."""
    stat, uptime = _read(proc / "self" / "stat"), _read(proc / "uptime")
    if stat is None or uptime is None:  # pragma: no cover - not Linux
        return 0.0
    # after the command name: the state is field 3, user and system time fields 14 and 15, the start field 22
    fields = stat[stat.rfind(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    alive = float(uptime.split()[0]) - int(fields[19]) / ticks
    return (int(fields[11]) + int(fields[12])) / ticks / alive if alive > 1.0 else 0.0


_ONE_CORE = threading.local()


@contextmanager
def one_core_for_cpu_work() -> Iterator[None]:
    """Within it, the calling thread's pools of CPU work run their items on the thread itself, one after another.

    For a thread given one core of its own (the thread a streamed replay reads on, next to the kernels on the
    others): reading a local file and hashing it are CPU work, and a pool of such workers would only take the
    other threads' cores and contend with them for the interpreter lock. Pools that wait on a remote store still
    fan out."""
    before = getattr(_ONE_CORE, "on", False)
    _ONE_CORE.on = True
    try:
        yield
    finally:
        _ONE_CORE.on = before


def on_one_core() -> bool:
    """True on a thread within `one_core_for_cpu_work`: its pools of CPU work run inline."""
    return getattr(_ONE_CORE, "on", False)


def _ratio(quota: str, period: str) -> float | None:
    """A quota over its period in CPUs; None for no quota ("max", or -1 in v1) or a value that is not a number."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None


__all__ = [
    "THREADS_ENV",
    "affinity_cpus",
    "cgroup_quota",
    "cpus_left",
    "free_cpus",
    "on_one_core",
    "one_core_for_cpu_work",
    "other_load",
    "threads_for",
    "threads_override",
    "usable_cpus",
]
