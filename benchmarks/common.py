"""Shared helpers of the benchmark suite: rows, timing, the run context (work dir, S3 server), the table
and docs/benchmarks.md.

A benchmark group is a module `benchmarks/bench_<group>.py` exposing `run(ctx) -> list[Row]`, and
optionally `TITLE` (a heading) and `HOW` (a short "how measured" paragraph, Markdown) for the docs.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.metadata
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `tests.s3server` lives beside the package, not inside it
    sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20
KiB = 1 << 10


class Row(NamedTuple):
    """One measured figure: `passed` is True/False against `goal`, None when informational or skipped."""

    group: str
    name: str
    value: str
    goal: str
    passed: bool | None
    detail: str = ""

    @property
    def status(self) -> str:
        if self.passed is True:
            return "PASS"
        if self.passed is False:
            return "FAIL"
        return "ERROR" if self.value == "error" else ("SKIP" if self.value == "skipped" else "-")


# ---- commands in fresh processes -----------------------------------------------------------------
_NET = r"""
import sys, time
def _peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
imports, args = sys.argv[1], sys.argv[2:]
if imports == "torch":
    import torch
import trajectory_replay.cli
net, cpu, code = 0.0, 0.0, 0
if args:
    sys.argv = ["trajectory-replay", *args]
    started, used = time.perf_counter(), time.process_time()
    try:
        trajectory_replay.cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    net, cpu = time.perf_counter() - started, time.process_time() - used
sys.stderr.write(f"\nNET={net}\nCPU={cpu}\nPEAK_RSS={_peak()}\nFROM={trajectory_replay.cli.__file__}\n")
sys.exit(code)
"""
"""One fresh process: import torch (when `imports` is "torch") and the CLI, then run the CLI's `main()` on the
arguments (none: imports only) and report its own time and the process's peak RSS."""


def run_cli_net(imports: str, args: list[str], tree: str | None = None) -> tuple[float, int]:
    """(seconds of the command's `main()`, net of the interpreter and the imports; peak RSS bytes) of one fresh
    process that imports `imports` ("torch" or "cli") and runs the CLI with `args` (none: the imports alone), with
    the package of the source tree `tree` (default: this one): see `run_cli_measured`."""
    measured = run_cli_measured(imports, args, tree)
    return measured["NET"], int(measured["PEAK_RSS"])


def run_cli_measured(imports: str, args: list[str], tree: str | None = None) -> dict[str, float]:
    """What one fresh process that imports `imports` and runs the CLI with `args` reports: NET, the seconds of the
    command's `main()`; CPU, the CPU seconds of all the process's threads in it; PEAK_RSS, its peak RSS bytes.

    The process runs in a directory of its own: `python -c` puts its working directory first on the import path,
    so run from a source tree it would import that tree's package whatever PYTHONPATH says. It reports the file
    it imported the CLI from, and that must lie in `tree`."""
    root = Path(tree or REPO_ROOT).resolve()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory(prefix="bench-cli-") as cwd:
        out = subprocess.run(
            [sys.executable, "-c", _NET, imports, *args],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {out.stderr[-800:]}")
    found = Path(out.stderr.rsplit("FROM=", 1)[1].strip()).resolve()
    if not found.is_relative_to(root):
        raise RuntimeError(f"the process meant to run the tree at {root} imported {found}")
    return {name: float(out.stderr.rsplit(f"{name}=", 1)[1].split()[0]) for name in ("NET", "CPU", "PEAK_RSS")}


def byte_compile(root: Path) -> None:
    """Byte-compile the package under `root`, as an installed package is: where PYTHONDONTWRITEBYTECODE is set,
    each process would otherwise compile it again, and that time would be counted as the command's."""
    import compileall

    compileall.compile_dir(str(root / "trajectory_replay"), quiet=1)


# ---- formatting -----------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / MiB / seconds:.0f} MiB/s" if seconds > 0 else "inf"


def fmt_secs(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


# ---- timing ---------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(wall seconds, result) of one call, after a garbage collection so it does not land inside."""
    gc.collect()
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def settle() -> None:
    """Flush dirty pages (so one measurement's writeback does not land in the next) and collect garbage."""
    gc.collect()
    if hasattr(os, "sync"):
        os.sync()


# ---- context --------------------------------------------------------------------------------------
class Context:
    """What a benchmark group gets: sizes for this mode, a scratch directory, a lazily started S3 server."""

    def __init__(
        self, *, quick: bool = False, workdir: str | None = None, repeats: int | None = None, verbose: bool = True
    ) -> None:
        self.quick = quick
        self.explicit_repeats = repeats
        self.repeats = repeats or (1 if quick else 3)
        self.verbose = verbose
        base = Path(workdir) if workdir else None
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        self.workdir = Path(tempfile.mkdtemp(prefix="trbench-", dir=base))
        self._s3 = None
        self.s3_used = False
        self.notes: list[str] = []
        self.load_at_start = _load()

    def size(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def reps(self, full: int) -> int:
        """Repetitions of a timing: --repeats when given, else 1 in quick mode, else `full`."""
        return self.explicit_repeats or (1 if self.quick else full)

    def path(self, name: str) -> Path:
        """A fresh directory under the scratch dir (unique per call)."""
        p = self.workdir / f"{name}-{uuid.uuid4().hex[:8]}"
        p.mkdir(parents=True)
        return p

    def log(self, message: str) -> None:
        if self.verbose:
            print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    # ---- S3 ----
    def s3(self):
        """The S3 server (SeaweedFS via tests.s3server, or TRAJECTORY_REPLAY_S3_ENDPOINT), started on first use."""
        if self._s3 is None:
            from tests.s3server import start_server

            self.log("starting the S3 server")
            self._s3 = start_server(self.workdir / "seaweedfs")
            self.s3_used = True
        return self._s3

    def s3_options(self) -> dict:
        return self.s3().storage_options()

    def s3_bucket(self) -> str:
        """A new empty bucket on the S3 server; returns its name."""
        import s3fs

        name = f"trbench-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.s3_options())
        fs.mkdir(name)
        return name

    def s3_description(self) -> str:
        if self._s3 is None:
            return ""
        if os.environ.get("TRAJECTORY_REPLAY_S3_ENDPOINT"):
            return f"external S3 endpoint {os.environ['TRAJECTORY_REPLAY_S3_ENDPOINT']}"
        version = "SeaweedFS"
        try:
            from tests.s3server import weed_binary

            out = subprocess.run(
                [weed_binary(), "version"], check=False, capture_output=True, text=True, timeout=20
            ).stdout
            found = re.search(r"version\b.*?\b(\d+\.\d+(?:\.\d+)?)\b", out)  # "version 8000GB 4.48 pypi ..."
            if found:
                version = f"SeaweedFS {found.group(1)}"
        except (OSError, RuntimeError, subprocess.SubprocessError, IndexError):
            version = "SeaweedFS (version unknown)"
        return f"{version} on loopback (`weed server`, data on the same disk)"

    def close(self) -> None:
        try:
            if self._s3 is not None:
                self.log("stopping the S3 server")
                self._s3.stop()
        finally:
            self._s3 = None
            shutil.rmtree(self.workdir, ignore_errors=True)


# ---- machine and versions -------------------------------------------------------------------------
def _cpu_model() -> str:
    """The CPU model, with the widest SIMD it has (what BLAKE3 hashing speed depends on)."""
    model, simd = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
                break
    except OSError:
        pass
    return f"{model}, {simd}" if simd else model


def _ram() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return fmt_bytes(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return "unknown"


def _fs_type(path: Path) -> str:
    try:
        best = ("", "?", "?")
        target = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, fstype, dev)
        return f"{best[1]} on {best[2]}"
    except OSError:
        return "unknown"


def _load() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"
    except OSError:
        return "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git() -> str:
    try:

        def git(*args: str) -> str:
            # --no-optional-locks: never touch the index (others may be committing meanwhile)
            return subprocess.run(
                ["git", "--no-optional-locks", *args],
                check=False,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()

        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return f"{head}{' (with uncommitted changes)' if dirty else ''}" if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(ctx: Context) -> list[tuple[str, str]]:
    info = [
        ("Date", _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")),
        ("Machine", f"{os.cpu_count()} CPUs ({_cpu_model()}), {_ram()} RAM, {platform.system()} {platform.release()}"),
        ("Scratch disk", f"{_fs_type(ctx.workdir)} ({ctx.workdir.parent})"),
        ("Python", platform.python_version()),
        (
            "Packages",
            ", ".join(f"{d} {_version(d)}" for d in ("torch", "fsspec", "s3fs", "blake3", "trajectory-replay")),
        ),
        ("Commit", _git()),
        (
            "Load average",
            (
                f"{ctx.load_at_start} at the start, {_load()} at the end (1 / 5 / 15 min; "
                "other work on the machine adds noise)"
            ),
        ),
        (
            "Mode",
            "quick (smoke sizes, one run each; not the figures to quote)"
            if ctx.quick
            else "full (best of interleaved repetitions, see below)",
        ),
    ]
    if ctx.s3_used:
        info.insert(3, ("S3 server", ctx.s3_description()))
    return info


# ---- output ---------------------------------------------------------------------------------------
COLUMNS = ("Group", "Benchmark", "Measured", "Goal", "Result", "Detail")


def _cells(row: Row) -> list[str]:
    return [row.group, row.name, row.value, row.goal, row.status, row.detail]


def print_table(rows: Sequence[Row], title: str = "trajectory-replay benchmarks") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for col in COLUMNS:
        table.add_column(col, overflow="fold", max_width=60 if col == "Detail" else None)
    styles = {"PASS": "green", "FAIL": "bold red", "ERROR": "bold red", "SKIP": "yellow"}
    for row in rows:
        cells = _cells(row)
        style = styles.get(row.status)
        if style:
            cells[4] = f"[{style}]{cells[4]}[/{style}]"
        table.add_row(*cells)
    Console(width=max(160, shutil.get_terminal_size((160, 24)).columns)).print(table)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = _cells(row)
        cells[4] = f"**{cells[4]}**" if row.passed is False else cells[4]
        lines.append("| " + " | ".join(_md(c) for c in cells) + " |")
    return "\n".join(lines)


def write_docs(
    path: Path,
    ctx: Context,
    rows: Sequence[Row],
    sections: Sequence[tuple[str, str, str]],
    command: str,
    *,
    refresh: bool = False,
    groups: Sequence[str] = (),
) -> None:
    """Rewrite the benchmark page: header (machine, versions, the run), the table, then one "how measured"
    paragraph per group (`sections` = (group, title, text)).

    `refresh`: only the groups just run are replaced; the other groups' rows and paragraphs are kept from the
    page as it is, and the header says which run (commit, date, load) each group's figures come from. `groups`
    gives the order of groups on the page."""
    info = dict(machine_info(ctx))
    run = Run(info["Commit"], info["Date"], info["Load average"], info["Mode"], command, info["Machine"])
    runs = [(run, [g for g, _, _ in sections])]
    if refresh and path.exists():
        kept_runs, kept_rows, kept_sections = parse_docs(path.read_text())
        fresh = {g for g, _, _ in sections}
        for earlier, names in kept_runs:
            names = [n for n in names if n not in fresh]
            if names:
                runs.append((earlier, names))
        order = {g: i for i, g in enumerate(groups)}
        rows = sorted(
            [r for r in kept_rows if r.group not in fresh] + list(rows), key=lambda r: order.get(r.group, len(order))
        )  # stable: each group's rows keep their order
        sections = sorted(
            [s for s in kept_sections if s[0] not in fresh] + list(sections), key=lambda s: order.get(s[0], len(order))
        )
    out = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks`; do not edit by hand (rerun it, or `--only GROUPS --refresh` to "
        "replace some groups' figures).",
        "",
    ]
    for key, value in info.items():
        if key not in ("Date", "Commit", "Load average", "Mode", "Machine"):
            out.append(f"- **{key}:** {value}")
    out.append("- **Runs** (each group's figures come from one of them):")
    for earlier, names in sorted(runs, key=lambda r: r[0].date):
        out.append(f"  - {', '.join(f'`{n}`' for n in names)}: {earlier.line()}")
    passed = sum(r.passed is True for r in rows)
    failed = sum(r.passed is False for r in rows)
    out += ["", f"{passed} goals met, {failed} missed.", "", markdown_table(rows), "", "## How measured", ""]
    for group, title, text in sections:
        out += [f"<!-- group: {group} -->", f"### {title or group}", "", text.strip(), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out).rstrip() + "\n")


class Run(NamedTuple):
    """Where one run's figures come from."""

    commit: str
    date: str
    load: str
    mode: str
    command: str
    machine: str

    def line(self) -> str:
        """The run as one line of the page (semicolons separate its fields, so none is left inside one)."""
        fields = [self.commit, self.date, self.machine, self.load]
        commit, date, machine, load = (f.replace(";", ",") for f in fields)
        return f"`{self.command}` at commit {commit}; {date}; machine {machine}; load average {load}; mode {self.mode}"


_RUN_LINE = re.compile(
    r"  - (?P<groups>`[^`]+`(?:, `[^`]+`)*): `(?P<command>[^`]*)` at commit (?P<commit>[^;]+); "
    r"(?P<date>[^;]+); machine (?P<machine>[^;]+); load average (?P<load>[^;]*); mode (?P<mode>.*)"
)


def parse_docs(text: str) -> tuple[list[tuple[Run, list[str]]], list[Row], list[tuple[str, str, str]]]:
    """The runs, rows and "how measured" paragraphs of a page `write_docs` wrote (also one written before pages
    said which run each group came from: its header's single run then covers every group of its table)."""
    lines = text.splitlines()
    header = {m.group(1): m.group(2) for m in (re.fullmatch(r"- \*\*([^*]+):\*\* (.*)", ln) for ln in lines) if m}
    rows = []
    for ln in lines:
        if not ln.startswith("| ") or ln.startswith("| Group |"):
            continue
        cells = [c.replace("\\|", "|") for c in re.split(r" (?<!\\)\| ", ln[2:-2])]
        if len(cells) != len(COLUMNS):
            continue
        group, name, value, goal, result, detail = cells
        result = result.strip("*")
        rows.append(
            Row(group, name, value, goal, True if result == "PASS" else False if result == "FAIL" else None, detail)
        )
    runs: list[tuple[Run, list[str]]] = []
    for ln in lines:
        m = _RUN_LINE.fullmatch(ln)
        if m:
            run = Run(m["commit"], m["date"], m["load"], m["mode"], m["command"], m["machine"])
            runs.append((run, re.findall(r"`([^`]+)`", m["groups"])))
    if not runs and "Commit" in header:
        command = re.search(r"Generated by `([^`]+)`", text)
        groups = list(dict.fromkeys(r.group for r in rows))
        runs.append(
            (
                Run(
                    header["Commit"],
                    header.get("Date", "?"),
                    header.get("Load average", "?"),
                    header.get("Mode", "?"),
                    command[1] if command else "python -m benchmarks",
                    header.get("Machine", "?"),
                ),
                groups,
            )
        )
    sections: list[tuple[str, str, str]] = []
    body = text.split("## How measured", 1)[1] if "## How measured" in text else ""
    for chunk in re.split(r"\n(?=(?:<!-- group: [^>]+ -->\n)?### )", body):
        m = re.match(r"\s*(?:<!-- group: (?P<group>[^>]+) -->\n)?### (?P<title>[^\n]+)\n(?P<text>.*)", chunk, re.S)
        if m:
            title = m["title"].strip()
            group = m["group"] or title.split(":", 1)[0].strip()
            sections.append((group, title, m["text"].strip()))
    return runs, rows, sections
