"""The `trajectory-replay` command line: thin wrappers over the Python API.

Errors are the package's own exceptions, turned into one line on stderr and an exit code here
and nowhere else: 0 pass / valid, 1 divergence, invalid or incomplete bundle, selection or
topology problem, 2 malformed command line.
"""

from __future__ import annotations

import json
import logging
import warnings
from functools import wraps
from typing import Annotated, Callable, Optional

import typer

from trajectory_replay.errors import TrajectoryReplayError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Capture what one async RL training step consumed; replay it offline and name the first "
                       "divergence.")


def _fail(message: str, code: int) -> None:
    typer.echo(f"trajectory-replay: error: {message}", err=True)
    raise typer.Exit(code)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    typer.echo(f"trajectory-replay: warning: {message}", err=True)


def command(fn: Callable) -> Callable:
    """Run a command with the project's errors turned into one-line messages and exit codes."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        warnings.showwarning = _show_warning
        logging.basicConfig(level=logging.WARNING, format="trajectory-replay: %(levelname)s: %(message)s")
        try:
            return fn(*args, **kwargs)
        except UsageError as exc:
            _fail(str(exc), 2)
        except TrajectoryReplayError as exc:
            _fail(str(exc), 1)
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except OSError as exc:  # a path that cannot be read or written: the user's to fix
            _fail(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "), 1)

    return wrapper


JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the human report.")]


@app.command("replay")
@command
def replay_cmd(
    path: Annotated[str, typer.Argument(help="Bundle, bundle/rank-<r>, capture directory or store root (path or URL).")],
    sample: Annotated[list[str], typer.Option("--sample", help="Sample id (repeatable); expands to its whole group.")] = [],
    group: Annotated[list[str], typer.Option("--group", help="Group id g-<group_index> (repeatable).")] = [],
    batch: Annotated[list[str], typer.Option("--batch", help="Micro-batch id mb-NNNN (repeatable).")] = [],
    step: Annotated[Optional[str], typer.Option("--step", help="ROLLOUT:STEP of a step-level bundle.")] = None,
    rollout: Annotated[Optional[int], typer.Option("--rollout", help="Rollout id of a rollout-level bundle.")] = None,
    stage: Annotated[list[str], typer.Option("--stage", help="Run this stage and what it depends on (repeatable).")] = [],
    atol: Annotated[Optional[float], typer.Option("--atol", help="Absolute tolerance for every stage.")] = None,
    rtol: Annotated[Optional[float], typer.Option("--rtol", help="Relative tolerance for every stage.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Recompute reward -> advantage -> loss and report the first divergence."""
    from trajectory_replay.bundle import open_for_replay
    from trajectory_replay.bundle.resolve import resolve_bundle
    from trajectory_replay.replay import replay

    if step is not None and rollout is not None:
        raise UsageError("--step and --rollout are mutually exclusive")
    target = resolve_bundle(path, step=step, rollout=rollout)
    sources, rank = open_for_replay(target)
    report = replay(sources, samples=sample, groups=group, batches=batch, stages=stage or None,
                    atol=atol, rtol=rtol, rank=rank)
    typer.echo(report.to_json() if as_json else report.render_text())
    raise typer.Exit(report.exit_code)


@app.command("inspect")
@command
def inspect_cmd(
    path: Annotated[str, typer.Argument(help="Bundle path or URL (native or older directory format).")],
    as_json: JsonFlag = False,
) -> None:
    """Show a bundle's identity, capabilities, producer and payloads; also for an incomplete bundle (exit 0).
    Exit 1 when a payload's blob record or blob ref is missing or corrupt."""
    from trajectory_replay.bundle.inspect import inspect_bundle

    result = inspect_bundle(path)
    typer.echo(result.to_json() if as_json else result.render_text())
    raise typer.Exit(result.exit_code)


@app.command("validate")
@command
def validate_cmd(
    path: Annotated[str, typer.Argument(help="Bundle path or URL (native or older directory format).")],
    as_json: JsonFlag = False,
) -> None:
    """Verify format, every chunk's digest, safety and each recompute stage's inputs; exit 1 when invalid."""
    from trajectory_replay.replay.validate import validate_bundle

    report = validate_bundle(path)
    typer.echo(report.to_json() if as_json else report.render_text())
    raise typer.Exit(0 if report.valid else 1)


@app.command("schema")
@command
def schema_cmd() -> None:
    """Print the JSON Schema of the manifest, index and expected documents."""
    from trajectory_replay.bundle.schema import json_schemas

    typer.echo(json.dumps(json_schemas(), indent=2))


@app.command("import")
@command
def import_cmd(
    source: Annotated[str, typer.Argument(help="An older-format (V1) bundle directory, or a directory of them.")],
    store_root: Annotated[str, typer.Argument(help="Store root to import into (path or URL).")],
    as_name: Annotated[Optional[str], typer.Option("--as", help="Name of the imported bundle (one bundle only).")] = None,
) -> None:
    """Convert V1 directory bundles into native bundles of a store."""
    from trajectory_replay.ops.importer import import_v1

    for url in import_v1(source, store_root, name=as_name):
        typer.echo(f"imported {url}")


@app.command("demo")
@command
def demo_cmd(
    directory: Annotated[Optional[str], typer.Argument(help="Store to write into (default: a new "
                                                            "./trajectory-replay-demo).")] = None,
) -> None:
    """Write a clean GRPO step and the same step with the physical-batch bug, replay both, print both reports."""
    from trajectory_replay.demo import run_demo

    result = run_demo(directory)
    typer.echo(f"wrote {result.directory}/b-00001 (normalized per prompt group) and "
               f"{result.directory}/b-00065 (normalized over the physical batch)\n")
    typer.echo(result.clean.render_text())
    typer.echo("")
    typer.echo(result.buggy.render_text())
    raise typer.Exit(0 if result.as_expected else 1)


QuietFlag = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar (it is shown only on a terminal).")]


@app.command("ls")
@command
def ls_cmd(
    root: Annotated[str, typer.Argument(help="Store root (path or URL).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of bundle objects.")] = False,
) -> None:
    """List the bundles of a store: anchor, status, ranks, logical and stored size, age."""
    from trajectory_replay.ops.ls import list_bundles

    report = list_bundles(root)
    typer.echo(report.to_json() if as_json else report.render_text())


@app.command("cp")
@command
def cp_cmd(
    source: Annotated[str, typer.Argument(help="A bundle, or a store root with --step/--rollout/--all.")],
    dest_root: Annotated[str, typer.Argument(help="Destination store root (path or URL).")],
    step: Annotated[Optional[str], typer.Option("--step", help="Copy the step-level bundle ROLLOUT:STEP.")] = None,
    rollout: Annotated[Optional[int], typer.Option("--rollout", help="Copy the rollout-level bundle ROLLOUT.")] = None,
    all_bundles: Annotated[bool, typer.Option("--all", help="Copy every complete bundle of the root.")] = False,
    quiet: QuietFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Copy bundles between stores, transferring only the objects the destination lacks; exit 1 when a
    corrupt bundle of the source root was skipped (the others are copied)."""
    from trajectory_replay.ops.cp import copy_bundles
    from trajectory_replay.ops.progress import terminal_progress

    with terminal_progress(quiet) as progress:
        report = copy_bundles(source, dest_root, step=step, rollout=rollout, all_bundles=all_bundles,
                              progress=progress)
    typer.echo(json.dumps(report.to_dict()) if as_json else report.render_text())
    raise typer.Exit(1 if report.skipped else 0)  # the rest was copied; a corrupt bundle was not


@app.command("gc")
@command
def gc_cmd(
    root: Annotated[str, typer.Argument(help="Store root (path or URL).")],
    grace: Annotated[str, typer.Option("--grace", help="Keep unreferenced keys younger than this (0s, 30m, 24h, "
                                                       "7d).")] = "24h",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be removed; remove nothing.")] = False,
    quiet: QuietFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Remove objects no bundle or capture in progress needs, abandoned cohorts and expired in-flight records."""
    from trajectory_replay.ops.gc import collect_garbage, parse_duration
    from trajectory_replay.ops.progress import terminal_progress

    grace_s = parse_duration(grace)
    with terminal_progress(quiet) as progress:
        report = collect_garbage(root, grace=grace_s, dry_run=dry_run, progress=progress)
    typer.echo(json.dumps(report.to_dict()) if as_json else report.render_text())


@app.command("fsck")
@command
def fsck_cmd(
    root: Annotated[str, typer.Argument(help="Store root (path or URL).")],
    repair_from: Annotated[Optional[str], typer.Option("--repair-from", help="Store to re-fetch bad or missing "
                                                                             "objects from.")] = None,
    quiet: QuietFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Verify every object and bundle tree; finalize finalizable bundles; exit 1 while a problem remains."""
    from trajectory_replay.ops.fsck import check_store
    from trajectory_replay.ops.progress import terminal_progress

    with terminal_progress(quiet) as progress:
        report = check_store(root, repair_from=repair_from, progress=progress)
    typer.echo(json.dumps(report.to_dict()) if as_json else report.render_text())
    raise typer.Exit(report.exit_code)


@app.command("stats")
@command
def stats_cmd(
    root: Annotated[str, typer.Argument(help="Store root (path or URL).")],
    as_json: JsonFlag = False,
) -> None:
    """Bundles, objects, logical and stored payload bytes, the dedup ratio, per payload name."""
    from trajectory_replay.ops.stats import store_stats

    report = store_stats(root)
    typer.echo(report.to_json() if as_json else report.render_text())


@app.command("export")
@command
def export_cmd(
    bundle: Annotated[str, typer.Argument(help="Native bundle path or URL.")],
    out_dir: Annotated[str, typer.Argument(help="New directory to write the V1 bundle to.")],
    quiet: QuietFlag = False,
) -> None:
    """Write a bundle as a self-contained directory in the older V1 layout (`import` reads it back)."""
    from trajectory_replay.ops.export import export_bundle
    from trajectory_replay.ops.progress import terminal_progress

    with terminal_progress(quiet) as progress:
        report = export_bundle(bundle, out_dir, progress=progress)
    typer.echo(report.render_text())


def main() -> None:
    """Console-script entry point."""
    from trajectory_replay._allocator import return_large_buffers_to_os

    return_large_buffers_to_os()
    app(prog_name="trajectory-replay")


if __name__ == "__main__":
    main()
