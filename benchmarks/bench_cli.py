"""Command start-up benchmarks: the commands that do no math, each a fresh process, against a process
that does nothing but `import torch`."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.common import Context, Row, fmt_secs, median

GROUP = "cli"
TITLE = "cli: commands that do no math start without torch"
HOW = """\
A native bundle (the demo's clean GRPO step, written once by `trajectory-replay demo`) is read by
`trajectory-replay inspect`, `validate`, `ls` and `stats`, each in a fresh Python process exactly
as a user runs it (`python -m trajectory_replay ...`, output to /dev/null), interleaved round by
round with a process that runs `import torch` and nothing else, and one that runs `pass` (the
interpreter's own start). Medians of 7 rounds (3 with `--quick`). Goal: `inspect` under 0.5 s.
Each command is also run once with torch made unimportable (`sys.modules["torch"] = None`) and must
exit 0: the proof that it never imports torch rather than merely importing it fast.
"""

INSPECT_GOAL_S = 0.5

_RUN_CLI = "import sys; from trajectory_replay.cli import main; sys.argv[0] = 'trajectory-replay'; main()"
_NO_TORCH = "import sys; sys.modules['torch'] = None; " + _RUN_CLI


def _time(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def run(ctx: Context) -> list[Row]:
    root = ctx.path("cli") / "demo"
    subprocess.run(
        [sys.executable, "-m", "trajectory_replay", "demo", str(root)],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bundle = str(next(p for p in sorted(root.iterdir()) if (p / "COMPLETE").exists()))
    commands = {
        "inspect": ["inspect", bundle],
        "validate": ["validate", bundle],
        "ls": ["ls", str(root)],
        "stats": ["stats", str(root)],
    }
    torch_free = {}
    for name, args in commands.items():
        done = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True)
        torch_free[name] = done.returncode == 0
        if not torch_free[name]:
            ctx.log(f"{name} without torch failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    rounds = ctx.reps(7)
    times: dict[str, list[float]] = {name: [] for name in (*commands, "import torch", "python")}
    env_python = [sys.executable, "-c"]
    for _ in range(rounds):
        times["python"].append(_time([*env_python, "pass"]))
        times["import torch"].append(_time([*env_python, "import torch"]))
        for name, args in commands.items():
            times[name].append(_time([sys.executable, "-m", "trajectory_replay", *args]))
    med = {name: median(values) for name, values in times.items()}
    ctx.log("medians: " + ", ".join(f"{k} {v:.3f}s" for k, v in med.items()))
    rows = []
    for name in commands:
        detail = (
            f"median of {rounds}; `import torch` alone {fmt_secs(med['import torch'])}, bare python "
            f"{fmt_secs(med['python'])}; without torch importable: "
            f"{'exit 0' if torch_free[name] else 'FAILED'}"
        )
        if name == "inspect":
            rows.append(
                Row(
                    GROUP,
                    "inspect of a native bundle (fresh process)",
                    fmt_secs(med[name]),
                    f"<= {INSPECT_GOAL_S} s",
                    med[name] <= INSPECT_GOAL_S and torch_free[name],
                    detail,
                )
            )
        else:
            rows.append(
                Row(GROUP, f"{name} (fresh process)", fmt_secs(med[name]), "no torch import", torch_free[name], detail)
            )
    rows.append(
        Row(
            GROUP,
            "import torch alone (fresh process)",
            fmt_secs(med["import torch"]),
            "-",
            None,
            f"median of {rounds}; os.cpu_count()={os.cpu_count()}",
        )
    )
    return rows
