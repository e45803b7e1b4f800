"""Load benchmark: a full replay on a host whose other cores are busy, against the same replay on a quiet host."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.bench_scale import write_case
from benchmarks.common import REPO_ROOT, Context, Row, byte_compile, fmt_secs, median, run_cli_measured

GROUP = "load"
TITLE = "load: replay beside other processes"
GOAL_PER_BUSY_CORE = 1.3
"""The replay beside busy cores may take this much of its quiet time per core taken from it, at most."""
HOW = f"""\
The 8,192 x 1,024 bundle of the scale benchmarks, on local disk, replayed by `replay PATH --json` in a fresh
process timed as the scale benchmarks do (the command's `main()`, net of the interpreter and the imports).
**quiet**: nothing of this benchmark runs beside it. **busy**: one busy loop (`python -c 'while 1: pass'`, a
process of its own) per core but one of those this process may run on, started just before the replay and ended
just after it. The two alternate, round by round, and each round's busy time is taken against its quiet one (so
that the host's other work, which changes from minute to minute, weighs on both alike); the median of seven rounds'
ratios. Goal: the busy replay takes at most {GOAL_PER_BUSY_CORE}x its quiet time per busy core. The CPU time the
command used (all its threads) is given as well:
threads that wait on each other's descheduled parts spin, and it shows as CPU time however busy the host is. **threads
as before**, for reference: the busy replay with
`TRAJECTORY_REPLAY_THREADS` set to the number of CPUs, which makes replay take every CPU as free whatever the load,
as it did before it followed the CPUs free: its kernels then run on as many threads as torch's default, and a
streamed pass reads ahead on one more. Needs at least two CPUs (one to take). The host runs other work as well, so
"quiet" is only as quiet as the host was: its load average is in the run's header."""

ROUNDS = 7


@contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes that spin on a CPU each, for the length of the `with` block."""
    loops = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@contextmanager
def environment(name: str, value: str | None) -> Iterator[None]:
    """The variable `name` set to `value` (None: unset) for the processes started within the block."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def run(ctx: Context) -> list[Row]:
    from trajectory_replay.cpus import THREADS_ENV, affinity_cpus

    cpus = affinity_cpus()
    taken = cpus - 1
    if taken < 1:
        return [Row(GROUP, "replay beside busy cores", "skipped", "-", None, "one CPU: no core to take")]
    n, tokens = ctx.size(8192, 1024), 1024
    path = ctx.path("load") / "full"
    write_case(path, n, tokens, seed=1)
    byte_compile(REPO_ROOT)
    args = ["replay", str(path), "--json"]
    times: dict[str, list[float]] = {"quiet": [], "busy": [], "before": []}
    used: dict[str, list[float]] = {name: [] for name in times}  # CPU seconds

    def measure(name: str) -> None:
        measured = run_cli_measured("torch", args)
        times[name].append(measured["NET"])
        used[name].append(measured["CPU"])

    with environment(THREADS_ENV, None):
        for _ in range(ctx.reps(ROUNDS)):
            measure("quiet")
            with busy_loops(taken):
                measure("busy")
            with busy_loops(taken), environment(THREADS_ENV, str(cpus)):
                measure("before")
    ratio, before = (median([t / q for t, q in zip(times[name], times["quiet"])]) for name in ("busy", "before"))
    goal = GOAL_PER_BUSY_CORE * taken

    def listed(name: str) -> str:
        return f"{name} " + ", ".join(fmt_secs(t) for t in times[name])

    return [
        Row(
            GROUP,
            f"full replay of {n}x{tokens} beside {taken} busy core(s) of {cpus}, against quiet",
            f"{ratio:.2f}x",
            f"<= {goal:.2f}x",
            ratio <= goal,
            f"medians: quiet {fmt_secs(median(times['quiet']))}, busy {fmt_secs(median(times['busy']))}; "
            f"threads as before, busy: {fmt_secs(median(times['before']))} ({before:.2f}x quiet); CPU time: "
            f"{', '.join(f'{name} {fmt_secs(median(used[name]))}' for name in used)}; rounds: "
            f"{'; '.join(listed(name) for name in times)}",
        )
    ]
