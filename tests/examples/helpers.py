"""Running examples/tiny_grpo.py and the trajectory-replay CLI as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.py"
SCALARS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss")
SMALL = ("--prompts-per-rollout", "3")
"""The size every example test runs at unless it needs another: 3 prompt groups x 4 samples per rollout, two
consumer batches of 6 (groups still straddle batches and ranks), a third of the example's default work."""
STEPS_PER_ROLLOUT = 3 * 4 // 6  # samples per rollout / consumer batch


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without any capture or S3 configuration of the developer's shell, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RELAX_REPLAY_", "AWS_", "FSSPEC_", "TRAJECTORY_REPLAY_"))
    }
    env.update(extra or {})
    return env


@dataclass
class ExampleRun:
    result: dict[str, Any]
    stdout: str
    elapsed: float
    workdir: Path
    out_json: Path


def run_example(
    workdir: Path,
    name: str,
    *extra: str,
    world_size: int = 2,
    steps: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
) -> ExampleRun:
    """Run the example in its own fresh working directory `workdir/name` (so what it writes can be listed).
    `timeout` catches a hang, not slowness: on a loaded host a run's writer processes, at idle priority, run only
    when a CPU has nothing else to do."""
    cwd = workdir / name
    cwd.mkdir(parents=True)
    out = cwd / f"{name}.json"
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        str(steps),
        "--world-size",
        str(world_size),
        "--seed",
        "3",
        "--out-json",
        str(out),
        *extra,
    ]
    # A cache of the run's own (listed by the tests: a run without capture must leave nothing behind).
    env = {"TRAJECTORY_REPLAY_CACHE_DIR": str(cwd / "cache"), **(env or {})}
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=cwd, env=clean_env(env), capture_output=True, text=True, timeout=timeout, check=False
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return ExampleRun(json.loads(out.read_text(encoding="utf-8")), proc.stdout, elapsed, cwd, out)


@dataclass
class CliResult:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict[str, Any]:
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"not JSON ({exc}): {self}") from None

    def __str__(self) -> str:
        return (
            f"trajectory-replay {' '.join(self.args)} -> exit {self.returncode}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )


CLI_BATCH = r"""
import contextlib, io, json, logging, sys, warnings
from trajectory_replay.cli import main

results = []
for args in json.load(sys.stdin):
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = ["trajectory-replay", *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    for handler in logging.root.handlers[:]:   # the next command logs to its own stderr, as a new process would
        logging.root.removeHandler(handler)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def run_cli_many(
    calls: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float = 300, processes: int = 2
) -> list[CliResult]:
    """`trajectory-replay ARGS` for each of `calls`, through the console entry point `main()` in `processes`
    real processes configured by `env` alone: one torch import per process, not per call. Each call gets its
    own argv, stdout, stderr and exit code; an exception that escapes a command ends its process and fails
    the test with the traceback."""
    calls = [list(c) for c in calls]
    shares = [calls[i::processes] for i in range(processes)]

    def one(share: list[list[str]]) -> list[CliResult]:
        proc = subprocess.run(
            [sys.executable, "-c", CLI_BATCH],
            cwd=REPO,
            env=clean_env(env),
            input=json.dumps(share),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, f"a command escaped the CLI:\n{proc.stderr}"
        return [CliResult(tuple(args), *res) for args, res in zip(share, json.loads(proc.stdout))]

    with ThreadPoolExecutor(max_workers=processes) as pool:
        done = list(pool.map(one, shares))
    return [done[i % processes][i // processes] for i in range(len(calls))]


RUNNER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import tiny_grpo
for argv in json.load(sys.stdin):
    tiny_grpo.main(argv)
"""
"""A fresh process running the example's `main(argv)` for each argv list read from stdin (JSON), one after another."""


def run_examples(workdir: Path, runs: list[list[str]]) -> str:
    """The example's `main(argv)` for each of `runs`, one after another in one fresh process; its stdout.

    Their capture writes in a thread of each rank (TRAJECTORY_REPLAY_CAPTURE_WRITER=thread): what these runs check is
    the bundles, and a writer process per rank and run would start one more interpreter each; `run_example`'s
    runs keep the default writer process."""
    import json
    import subprocess
    import sys

    env = {"TRAJECTORY_REPLAY_CACHE_DIR": str(workdir / "cache"), "TRAJECTORY_REPLAY_CAPTURE_WRITER": "thread"}
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(EXAMPLE.parent)],
        input=json.dumps(runs),
        cwd=workdir,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def replay_capture(root: Path) -> tuple[dict[str, list], dict[str, Any]]:
    """(bundle -> sources, bundle -> ReplayReport) of every bundle a capture directory holds."""
    from trajectory_replay.bundle import open_native
    from trajectory_replay.replay import replay

    bundles = sorted(p.name for p in root.iterdir() if p.name.startswith(("rollout-", "step-")))
    sources = {b: open_native(str(root / b)) for b in bundles}
    return sources, {b: replay(s) for b, s in sources.items()}
