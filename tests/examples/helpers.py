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
STEPS_PER_ROLLOUT = 6 * 4 // 6   # default rollout size / consumer batch


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """os.environ without any capture or S3 configuration of the developer's shell, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RELAX_REPLAY_", "AWS_", "FSSPEC_", "TRAJECTORY_REPLAY_"))}
    env.update(extra or {})
    return env


@dataclass
class ExampleRun:
    result: dict[str, Any]
    stdout: str
    elapsed: float
    workdir: Path
    out_json: Path


def run_example(workdir: Path, name: str, *extra: str, world_size: int = 2, steps: int = 2,
                env: Mapping[str, str] | None = None, timeout: float = 120) -> ExampleRun:
    """Run the example in its own fresh working directory `workdir/name` (so what it writes can be listed)."""
    cwd = workdir / name
    cwd.mkdir(parents=True)
    out = cwd / f"{name}.json"
    cmd = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--world-size", str(world_size),
           "--seed", "3", "--out-json", str(out), *extra]
    # A cache of the run's own (listed by the tests: a run without capture must leave nothing behind).
    env = {"TRAJECTORY_REPLAY_CACHE_DIR": str(cwd / "cache"), **(env or {})}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=clean_env(env), capture_output=True, text=True, timeout=timeout,
                          check=False)
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
        return (f"trajectory-replay {' '.join(self.args)} -> exit {self.returncode}\n"
                f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}")


def run_cli_many(calls: Sequence[Sequence[str]], env: Mapping[str, str], timeout: float = 120) -> list[CliResult]:
    """`python -m trajectory_replay ARGS` for each of `calls`, a few at a time (they are independent)."""
    def one(args: Sequence[str]) -> CliResult:
        proc = subprocess.run([sys.executable, "-m", "trajectory_replay", *args], cwd=REPO, env=clean_env(env),
                              capture_output=True, text=True, timeout=timeout, check=False)
        return CliResult(tuple(args), proc.returncode, proc.stdout, proc.stderr)

    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        return list(pool.map(one, calls))
