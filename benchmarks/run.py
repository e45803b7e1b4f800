"""Run the registered benchmark groups, print one table and rewrite docs/benchmarks.md.

    python -m benchmarks [--only store,bundle [--refresh]] [--quick] [--docs PATH | --no-docs] [--strict]

To add a group: write `benchmarks/bench_<name>.py` with `run(ctx) -> list[Row]` (plus optional
`TITLE` and `HOW` strings for the docs) and list `<name>` in GROUPS below. A listed group whose
module does not exist yet is reported as skipped; one that raises is reported as an error and the
others still run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import REPO_ROOT, Context, Row, print_table, write_docs

GROUPS: list[str] = [
    "store",
    "bundle",
    "replay",
    "algorithms",
    "scale",
    "load",
    "capture",
    "recorder",
    "ops",
    "scan",
    "cli",
]
"""Benchmark groups in run order; group `x` lives in `benchmarks/bench_x.py`."""

DEFAULT_DOCS = REPO_ROOT / "docs" / "benchmarks.md"


def load_group(name: str):
    """The module of group `name`, or None when `benchmarks/bench_<name>.py` does not exist."""
    module_name = f"benchmarks.bench_{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise


def run_groups(ctx: Context, names: Sequence[str]) -> tuple[list[Row], list[tuple[str, str, str]]]:
    """Run each group; returns all rows and the (group, title, how-measured) docs sections."""
    rows: list[Row] = []
    sections: list[tuple[str, str, str]] = []
    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            module = load_group(name)
        except Exception as exc:  # noqa: BLE001 - one broken group must not stop the others
            traceback.print_exc()
            rows.append(Row(name, "(import)", "error", "-", None, f"{type(exc).__name__}: {exc}"))
            continue
        if module is None:
            rows.append(Row(name, "(group)", "skipped", "-", None, f"benchmarks/bench_{name}.py is not present yet"))
            continue
        started = time.perf_counter()
        try:
            group_rows = list(module.run(ctx))
        except Exception as exc:  # noqa: BLE001 - reported as an error row, the others still run
            traceback.print_exc()
            group_rows = [Row(name, "(run)", "error", "-", None, f"{type(exc).__name__}: {exc}")]
        print(f"== {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        rows.extend(group_rows)
        sections.append((name, getattr(module, "TITLE", name), getattr(module, "HOW", "")))
    return rows, sections


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated groups to run (default all: {','.join(GROUPS)})")
    parser.add_argument("--quick", action="store_true", help="small sizes, one repetition: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per timing (default 3, quick 1)")
    parser.add_argument(
        "--docs",
        default=None,
        help="where to write the results page (default docs/benchmarks.md on a full run or with --refresh; "
        "a --quick run writes no page unless this is given)",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not write the results page")
    parser.add_argument(
        "--refresh",
        action="store_true",
        help="with --only: replace just those groups' figures in the results page, keeping the others "
        "(the page says which run each group's figures come from)",
    )
    parser.add_argument("--workdir", default=None, help="parent of the scratch directory (default: system temp)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed (errors always do)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        print(f"unknown benchmark group(s): {', '.join(unknown)} (known: {', '.join(GROUPS)})", file=sys.stderr)
        return 2
    ctx = Context(quick=args.quick, workdir=args.workdir, repeats=args.repeats)
    started = time.perf_counter()
    try:
        rows, sections = run_groups(ctx, names)
        elapsed = time.perf_counter() - started
        print_table(rows, title=f"trajectory-replay benchmarks ({'quick' if args.quick else 'full'}, {elapsed:.0f} s)")
        default = DEFAULT_DOCS if not args.quick and (not args.only or args.refresh) else None
        docs = None if args.no_docs else (Path(args.docs) if args.docs else default)
        if docs is not None:
            command = (
                "python -m benchmarks"
                + (f" --only {','.join(names)}" if args.only else "")
                + (" --quick" if args.quick else "")
            )
            write_docs(docs, ctx, rows, sections, command, refresh=args.refresh, groups=GROUPS)
            print(f"wrote {docs}", file=sys.stderr)
    finally:
        ctx.close()
    if any(r.status == "ERROR" for r in rows):
        return 1
    if args.strict and any(r.passed is False for r in rows):
        return 1
    return 0
