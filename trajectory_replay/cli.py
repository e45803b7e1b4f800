"""The `trajectory-replay` command line: thin wrappers over the Python API.

Errors are the package's own exceptions, turned into one line on stderr here; their status and exit code come
from `trajectory_replay.outcome.error_status`. A command's report is printed, and the command ends, by `finish`:
the report's `status` and exit code come from `trajectory_replay.outcome` too.

With `--json` (replay, conventions, diff, inspect, validate, ls, scan, stats, cp, gc, fsck) stdout is exactly one
JSON object whatever happens, usage errors included: a top-level `status` (an `outcome.Status`) and, on an error,
`error`, the same one line that goes to stderr.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Callable
from functools import wraps
from typing import Annotated, Any, NoReturn

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from trajectory_replay import __version__
from trajectory_replay.backends import location_problem
from trajectory_replay.errors import TrajectoryReplayError, UsageError
from trajectory_replay.outcome import Outcome, Status, error_status, exit_code, missing_torch, one_line
from trajectory_replay.units import human_bytes

try:  # typer vendors click from 0.20 on; earlier releases use click itself
    from typer._click.exceptions import UsageError as ClickUsageError
except ImportError:  # pragma: no cover
    from click.exceptions import UsageError as ClickUsageError  # type: ignore[assignment]  # click's own class


class _Argument(TyperArgument):
    """A positional argument in help as people write one: its metavar (PATH, [DIR-OR-URL]), no Python type."""

    def display_type_rich(self, ctx) -> None:
        return None

    def _usage_display_name(self) -> str:
        return self.display_name_raw if self.required else f"[{self.display_name_raw}]"


class _Option(TyperOption):
    """An option in help as people write one: a flag alone (`--json`), a value option with its metavar
    (`--atol X`), never a Python type."""

    def display_type_rich(self, ctx) -> str | None:
        if self.is_flag or self.count:
            return None
        return self.metavar or (self.name or "value").upper()


_READABLE: dict[type, type] = {TyperArgument: _Argument, TyperOption: _Option}


def _readable(params: list) -> list:
    """`params` shown by `_Argument` and `_Option` (they parse as before: only their help differs)."""
    for param in params:
        param.__class__ = _READABLE.get(type(param), type(param))
    return params


def _whole_sentences(text: str | None) -> str | None:
    """A docstring's paragraphs each as one line, so help wraps them at the terminal's width, not the source's."""
    if not text:
        return text
    return "\n\n".join(" ".join(part.split()) for part in inspect.cleandoc(text).split("\n\n"))


class Group(TyperGroup):
    """The command group: an unknown command or option is one line too (and JSON with `--json`), exit 2."""

    def get_params(self, ctx) -> list:
        return _readable(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return _one_line_usage(lambda: super(Group, self).parse_args(ctx, args), ctx, args, "")

    def resolve_command(self, ctx, args: list[str]):
        return _one_line_usage(lambda: super(Group, self).resolve_command(ctx, args), ctx, args, "")


def _one_line_usage(parse: Callable, ctx, args: list[str], name: str):
    as_json = "--json" in args  # before parsing: the parser consumes `args`
    try:
        _refuse_flags_as_values(ctx.command.get_params(ctx), args)
        return parse()
    except ClickUsageError as exc:
        if ctx.resilient_parsing or type(exc).__name__ == "NoArgsIsHelpError":
            raise
        command = f"trajectory-replay {name}".rstrip()
        _fail(f"{error_message(exc)} (see `{command} --help`)", Status.USAGE, as_json)
        raise  # unreachable: _fail exits


app = typer.Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Capture what one async RL training step consumed; replay it offline and name the first divergence.",
)


def _print_version(value: bool) -> None:
    if value:
        emit(f"trajectory-replay {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Capture what one async RL training step consumed; replay it offline and name the first divergence."""


def _refuse_flags_as_values(params: list, args: list[str]) -> None:
    """An option followed by another of the command's options (`--sample --json`) is missing its value: the parser
    would take that option as the value, and `--json` would be lost (also where the command has no `--json`: the
    line still gets its one JSON object)."""
    options = {
        name: param
        for param in params
        if param.param_type_name == "option"
        for name in (*param.opts, *param.secondary_opts)
    }
    for arg, following in zip(args, args[1:]):
        if arg == "--":
            return
        param = options.get(arg)
        takes_value = param is not None and not (param.is_flag or param.count)
        if takes_value and (following in options or following == "--json"):
            metavar = param.display_type_rich(None) if isinstance(param, _Option) else "VALUE"
            raise ClickUsageError(f"{arg} is missing its value ({following} is an option): write {arg} {metavar}")


def error_message(exc: BaseException) -> str:
    """What the user reads about `exc`, one line."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, ClickUsageError):
        return one_line(exc.format_message())
    if isinstance(exc, OSError) and not isinstance(exc, TrajectoryReplayError):
        # a path that cannot be read or written: the user's to fix
        return one_line(f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": "))
    if isinstance(exc, TrajectoryReplayError):
        return one_line(str(exc))
    if missing_torch(exc):
        return (
            "this command recomputes tensors and needs PyTorch, which cannot be imported here "
            "(install it: pip install torch); inspect, validate, ls, stats, cp, gc, fsck and export run "
            "without it"
        )
    return one_line(f"{type(exc).__name__}: {exc}")


def _quiet_stdout() -> None:
    """The reader of stdout went away (`| head`): drop whatever is still buffered instead of failing on it."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (an in-process runner)
        pass


def emit(text: str) -> None:
    """Print `text` on stdout; a closed pipe ends the output quietly (the exit code is still the command's)."""
    try:
        typer.echo(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()


def emit_json(status: Status, payload: dict[str, Any], *, allow_nan: bool = True) -> None:
    """Print one JSON object: `status` first, then `payload`."""
    emit(json.dumps({"status": Status(status), **payload}, allow_nan=allow_nan))


def _say_error(message: str) -> None:
    try:
        typer.echo(f"trajectory-replay: error: {message}", err=True)
    except BrokenPipeError:
        pass


def _fail(message: str, status: Status, as_json: bool, code: int | None = None) -> NoReturn:
    """End the command on an error: its line on stderr, the JSON object with `--json`, the exit code (by default
    the one of `status`)."""
    _say_error(message)
    if as_json:
        emit_json(status, {"error": message})
    raise typer.Exit(exit_code(status) if code is None else code)


def finish(report: Outcome, as_json: bool) -> NoReturn:
    """Print a command's report and end the command with its exit code: the one way every report is emitted.

    With `--json` one object: the report's `status` first, then the report, and `error` (`Outcome.error`) when it
    carries a reason or found problems; otherwise the report's text. A report that checked nothing says why on
    stderr too, as an error would (its `reason`); problems a report found are in its own text only."""
    error = report.error
    if as_json:
        emit_json(
            report.status, {**report.to_dict(), **({"error": error} if error else {})}, allow_nan=not report.finite_json
        )
    else:
        emit(report.render_text())
    if report.reason:
        _say_error(report.reason)
    raise typer.Exit(report.exit_code)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    typer.echo(f"trajectory-replay: warning: {one_line(str(message))}", err=True)


class Command(TyperCommand):
    """A subcommand whose command-line mistakes are one line (and one JSON object with `--json`), exit 2, and
    whose help reads as a person's: whole sentences, metavars instead of Python types."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.help = _whole_sentences(self.help)

    def get_params(self, ctx) -> list:
        return _readable(super().get_params(ctx))

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return _one_line_usage(lambda: super(Command, self).parse_args(ctx, args), ctx, args, self.name or "")


def command(fn: Callable) -> Callable:
    """Run a command with the project's errors turned into one-line messages, statuses and exit codes."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("as_json"))
        warnings.showwarning = _show_warning
        logging.basicConfig(level=logging.WARNING, format="trajectory-replay: %(levelname)s: %(message)s")
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except (TrajectoryReplayError, OSError, KeyboardInterrupt) as exc:
            status, code = error_status(exc)
            _fail(error_message(exc), status, as_json, code)
        except Exception as exc:
            status, code = error_status(exc)
            if status is Status.IO or missing_torch(exc):  # the storage library's own error: still one line
                _fail(error_message(exc), status, as_json, code)
            if as_json:  # a bug of this tool: the JSON contract holds, and the traceback follows on stderr
                emit_json(status, {"error": f"internal error: {error_message(exc)}"})
            raise

    return wrapper


def _import_torch() -> None:
    """Import torch for a command that computes, then keep the collector from rescanning what it imported.

    torch leaves some 10^5 long-lived objects behind; every full collection the command triggers afterwards
    (bundle and pydantic imports, reading thousands of records) would walk all of them again. The process is
    short-lived and those objects live until it exits, so they move to the permanent generation."""
    import torch  # noqa: F401

    gc.freeze()


def check_tolerance(flag: str, value: float | None) -> float | None:
    """A tolerance from the command line: a finite number >= 0 (NaN would make every comparison pass)."""
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise UsageError(f"{flag} {value}: must be a finite number >= 0")
    return value


_RAY_ADDRESS = re.compile(r"(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")


def check_ray_address(address: str | None) -> None:
    """`--ray-address` as typed: HOST:PORT, ray://HOST:PORT, `auto` or `local` (checked before any verdict is
    looked up, so a typo is refused also when every verdict is cached)."""
    if address is None or address in ("auto", "local"):
        return
    match = _RAY_ADDRESS.fullmatch(address)
    if not match or not 0 < int(match.group(3)) < 65536:
        raise UsageError(f"--ray-address {address!r}: expected HOST:PORT, ray://HOST:PORT, auto or local")


def parse_overrides(assignments: list[str]) -> dict[str, Any]:
    """`--set FIELD=VALUE` flags as {field: value}: VALUE parsed as JSON (true, 1e-4, null, "x"), else kept as a
    string; UsageError for a flag without `=` or a field given twice."""
    out: dict[str, Any] = {}
    for item in assignments:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UsageError(f"--set {item!r}: expected FIELD=VALUE")
        if name in out:
            raise UsageError(f"--set {name}: given twice")
        try:
            out[name] = json.loads(raw)
        except ValueError:
            out[name] = raw
    return out


def _location(param: typer.CallbackParam, value: str | None) -> str | None:
    """A path or URL from the command line, refused as typed when it can name no store (before any request); an
    empty one is named by its argument or option (an unset shell variable leaves nothing else to name)."""
    if value is None:
        return value
    problem = location_problem(value)
    if problem and not value.strip():
        # typer hands the parameter itself, a TyperArgument or TyperOption
        name = param.display_name_raw if isinstance(param, TyperArgument) else param.opts[0]
        problem = f"{name}: {problem}"
    if problem:
        raise ClickUsageError(problem)
    return value


def Where(metavar: str, help: str) -> Any:  # noqa: N802 (reads as the type of an argument)
    """A path or URL argument: shown as `metavar`, checked by `_location`."""
    return typer.Argument(metavar=metavar, callback=_location, help=help)


def Value(flag: str, metavar: str, help: str, **kwargs: Any) -> Any:  # noqa: N802
    """An option that takes a value, shown as `flag metavar`."""
    return typer.Option(flag, metavar=metavar, help=help, **kwargs)


def _tolerance(flag: str, kind: str, default: str, each: str) -> Any:
    return Value(flag, "X", f"{kind} tolerance for every {each} (default: the bundle's own per stage, else {default}).")


JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the human report.")]
HtmlFlag = Annotated[
    str | None, Value("--html", "FILE", "Also write the report as one self-contained HTML file with plots.")
]
AtolFlag = Annotated[float | None, _tolerance("--atol", "Absolute", "1e-6", "stage")]
RtolFlag = Annotated[float | None, _tolerance("--rtol", "Relative", "1e-5", "stage")]
StepFlag = Annotated[str | None, Value("--step", "R:S", "The actor's step-level bundle of rollout R, step S.")]
CriticFlag = Annotated[
    str | None, Value("--critic", "R:S", "The critic's step-level bundle of rollout R, step S (critic-<R>-<S>).")
]
RolloutFlag = Annotated[int | None, Value("--rollout", "R", "The rollout-level bundle of rollout R.")]
QuietFlag = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar (it is shown only on a terminal).")]
BUNDLE_OR_DIR = "Bundle, bundle/rank-<r>, capture directory or store root (path or URL)."
BUNDLE_OR_ROOT = (
    "Bundle path or URL (native or older directory format), or a store root or capture directory with "
    "--step/--critic/--rollout."
)
STORE_ROOT = "Store root (path or URL)."


def _write_html(report, html_path: str | None, sources=None) -> None:
    """Write a replay, chain or diff report's HTML page when asked (a replay's with the `sources` replayed), saying
    on stderr where it went: stdout stays the report."""
    if html_path is None:
        return
    from trajectory_replay.html_report import write_diff_html, write_replay_html
    from trajectory_replay.replay.diff import DiffReport

    size = (
        write_diff_html(report, html_path)
        if isinstance(report, DiffReport)
        else write_replay_html(report, html_path, sources)
    )
    typer.echo(f"trajectory-replay: wrote {html_path} ({human_bytes(size)})", err=True)


@app.command("replay", cls=Command)
@command
def replay_cmd(
    path: Annotated[str, Where("BUNDLE-OR-DIR", BUNDLE_OR_DIR)],
    sample: Annotated[list[str], Value("--sample", "ID", "Sample id (repeatable); expands to its whole group.")] = [],
    group: Annotated[list[str], Value("--group", "g-N", "Prompt group g-<group_index> (repeatable).")] = [],
    batch: Annotated[list[str], Value("--batch", "mb-NNNN", "Micro-batch id (repeatable).")] = [],
    step: StepFlag = None,
    critic: CriticFlag = None,
    rollout: RolloutFlag = None,
    stage: Annotated[list[str], Value("--stage", "STAGE", "Run this stage and what it depends on (repeatable).")] = [],
    atol: AtolFlag = None,
    rtol: RtolFlag = None,
    set_: Annotated[
        list[str],
        Value(
            "--set",
            "FIELD=VALUE",
            "Replay with a recompute config field overridden (repeatable; VALUE as JSON, else a string).",
        ),
    ] = [],
    no_upstream: Annotated[
        bool,
        typer.Option(
            "--no-upstream",
            help="With --step or --critic: replay the step-level bundle alone, not with the rollout-level bundles it "
            "consumed.",
        ),
    ] = False,
    block_tokens: Annotated[
        int | None,
        Value(
            "--block-tokens",
            "N",
            "Stream the replay in blocks of whole prompt groups of about N tokens, to bound "
            "memory; the report is the same (default: only a cohort of more than 32M tokens streams, in blocks of "
            "4M).",
        ),
    ] = None,
    html_path: HtmlFlag = None,
    as_json: JsonFlag = False,
) -> None:
    """Recompute reward -> advantage -> loss and report the first divergence (with --step or --critic, across the
    rollout bundles the step consumed and the step itself)."""
    _import_torch()
    from trajectory_replay.bundle import open_for_replay
    from trajectory_replay.bundle.anchor import Anchor
    from trajectory_replay.replay import replay

    Anchor.requested(step, rollout, critic)  # a usage error before anything is opened
    atol, rtol = check_tolerance("--atol", atol), check_tolerance("--rtol", rtol)
    if block_tokens is not None and block_tokens < 1:
        raise UsageError(f"--block-tokens must be a positive number of tokens, got {block_tokens}")
    overrides = parse_overrides(set_)
    sources, rank = open_for_replay(path, step=step, rollout=rollout, critic=critic)

    def replay_step(step_sources):
        return replay(
            step_sources,
            samples=sample,
            groups=group,
            batches=batch,
            stages=stage or None,
            atol=atol,
            rtol=rtol,
            rank=rank,
            overrides=overrides,
            block_tokens=block_tokens,
        )

    if (step is not None or critic is not None) and not no_upstream:
        from trajectory_replay.errors import NoMatchingBundleError
        from trajectory_replay.replay.chain import replay_chain

        def open_rollout(rollout_id: int):
            try:
                return open_for_replay(path, rollout=rollout_id)[0]
            except NoMatchingBundleError:
                return None

        report = replay_chain(sources, open_rollout, replay_step=replay_step, atol=atol, rtol=rtol)
    else:
        report = replay_step(sources)
    _write_html(report, html_path, sources)
    finish(report, as_json)


@app.command("conventions", cls=Command)
@command
def conventions_cmd(
    path: Annotated[str, Where("BUNDLE-OR-DIR", BUNDLE_OR_DIR)],
    step: StepFlag = None,
    critic: CriticFlag = None,
    rollout: RolloutFlag = None,
    as_json: JsonFlag = False,
) -> None:
    """Replay under every convention profile and single-field variant; say which reproduce each stage."""
    _import_torch()
    from trajectory_replay.bundle import open_for_replay
    from trajectory_replay.bundle.anchor import Anchor
    from trajectory_replay.replay.convention_search import find_conventions

    Anchor.requested(step, rollout, critic)  # a usage error before anything is opened
    sources, rank = open_for_replay(path, step=step, rollout=rollout, critic=critic)
    finish(find_conventions(sources, rank=rank), as_json)


@app.command("diff", cls=Command)
@command
def diff_cmd(
    a: Annotated[str, Where("A", "First bundle (path or URL, native or older format).")],
    b: Annotated[str, Where("B", "Second bundle of the same step.")],
    step: StepFlag = None,
    critic: CriticFlag = None,
    rollout: RolloutFlag = None,
    atol: Annotated[float | None, _tolerance("--atol", "Absolute", "1e-6", "field")] = None,
    rtol: Annotated[float | None, _tolerance("--rtol", "Relative", "1e-5", "field")] = None,
    html_path: HtmlFlag = None,
    as_json: JsonFlag = False,
) -> None:
    """Compare two captures of one step, sample by sample: the first stage whose inputs or expected outputs
    differ, and every field compared (exit 0 identical within tolerance, 1 different)."""
    _import_torch()
    from trajectory_replay.bundle import open_for_replay
    from trajectory_replay.bundle.anchor import Anchor
    from trajectory_replay.replay.diff import diff_bundles

    Anchor.requested(step, rollout, critic)  # a usage error before anything is opened
    atol, rtol = check_tolerance("--atol", atol), check_tolerance("--rtol", rtol)
    left, _ = open_for_replay(a, step=step, rollout=rollout, critic=critic)
    right, _ = open_for_replay(b, step=step, rollout=rollout, critic=critic)
    report = diff_bundles(left, right, a_label=a, b_label=b, atol=atol, rtol=rtol)
    _write_html(report, html_path)
    finish(report, as_json)


@app.command("inspect", cls=Command)
@command
def inspect_cmd(
    path: Annotated[str, Where("BUNDLE-OR-DIR", BUNDLE_OR_ROOT)],
    step: StepFlag = None,
    critic: CriticFlag = None,
    rollout: RolloutFlag = None,
    as_json: JsonFlag = False,
) -> None:
    """Show a bundle's identity, capabilities, producer and payloads; also for an incomplete bundle (exit 0).
    Exit 1 when a payload's blob record or blob ref is missing or corrupt."""
    from trajectory_replay.bundle.inspect import inspect_bundle

    finish(inspect_bundle(path, step=step, rollout=rollout, critic=critic), as_json)


@app.command("validate", cls=Command)
@command
def validate_cmd(
    path: Annotated[str, Where("BUNDLE-OR-DIR", BUNDLE_OR_ROOT)],
    step: StepFlag = None,
    critic: CriticFlag = None,
    rollout: RolloutFlag = None,
    as_json: JsonFlag = False,
) -> None:
    """Verify format, every chunk's digest, safety and each recompute stage's inputs; exit 1 when invalid."""
    from trajectory_replay.bundle import open_bundle
    from trajectory_replay.replay.validate import validate_bundle

    finish(validate_bundle(open_bundle(path, step=step, rollout=rollout, critic=critic, choose=False).target), as_json)


@app.command("schema", cls=Command)
@command
def schema_cmd() -> None:
    """Print the JSON Schema of the manifest, index and expected documents."""
    from trajectory_replay.bundle.schema import json_schemas

    emit(json.dumps(json_schemas(), indent=2))


@app.command("import", cls=Command)
@command
def import_cmd(
    source: Annotated[str, Where("V1-BUNDLE-OR-DIR", "An older-format (V1) bundle directory, or a directory of them.")],
    store_root: Annotated[str, Where("STORE-ROOT", "Store root to import into (path or URL).")],
    as_name: Annotated[str | None, Value("--as", "NAME", "Name of the imported bundle (one bundle only).")] = None,
    step: StepFlag = None,
    critic: CriticFlag = None,
    rollout: RolloutFlag = None,
) -> None:
    """Convert V1 directory bundles into native bundles of a store."""
    from trajectory_replay.ops.importer import import_v1

    imported = import_v1(source, store_root, name=as_name, step=step, rollout=rollout, critic=critic)
    emit("\n".join(f"imported {url}" for url in imported))


@app.command("demo", cls=Command)
@command
def demo_cmd(
    directory: Annotated[
        str | None, Where("DIR-OR-URL", "Store to write into, a path or URL (default: a new ./trajectory-replay-demo).")
    ] = None,
) -> None:
    """Write a clean GRPO step and the same step with the physical-batch bug, replay both, print both reports."""
    from trajectory_replay.demo import run_demo

    finish(run_demo(directory), as_json=False)


@app.command("ls", cls=Command)
@command
def ls_cmd(
    root: Annotated[str, Where("ROOT", STORE_ROOT)],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object: status, root, bundles and totals.")
    ] = False,
) -> None:
    """List the bundles of a store: anchor, status, ranks, logical and stored size, age."""
    from trajectory_replay.ops.ls import list_bundles

    finish(list_bundles(root), as_json)


@app.command("scan", cls=Command)
@command
def scan_cmd(
    root: Annotated[str, Where("STORE-OR-CAPTURE", "Store root or capture directory (path or URL).")],
    engine: Annotated[
        str,
        Value(
            "--engine",
            "local|ray",
            "local: a process pool on this machine; ray: one task per bundle on a Ray cluster (the ray extra).",
        ),
    ] = "local",
    workers: Annotated[
        int | None,
        Value(
            "--workers",
            "N",
            "Worker processes (local) or CPUs of the Ray started for the scan (default: the CPUs free here).",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        Value(
            "--ray-address",
            "ADDR",
            "Ray cluster to run on, HOST:PORT or "
            "ray://HOST:PORT (default: RAY_ADDRESS, else a local Ray started "
            "for the scan).",
        ),
    ] = None,
    atol: AtolFlag = None,
    rtol: RtolFlag = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replay every bundle, also those with a stored verdict.")
    ] = False,
    quiet: QuietFlag = False,
    html_path: Annotated[
        str | None,
        Value("--html", "FILE", "Also write the summary as one self-contained HTML page with the verdict timeline."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Replay every complete bundle of a store, resumably (verdicts are kept in the store); summarize counts,
    the earliest divergence and incomplete bundles. Exit 1 when any bundle is not `pass`."""
    from trajectory_replay.ops.progress import progress_wanted
    from trajectory_replay.ops.scan import (
        RichScanProgress,
        ScanProgress,
        ScanReport,
        check_engine,
        check_workers,
        scan_store,
    )

    check_engine(engine)
    if ray_address is not None and engine != "ray":
        raise UsageError("--ray-address needs --engine ray")
    check_ray_address(ray_address)
    check_workers(workers)
    atol, rtol = check_tolerance("--atol", atol), check_tolerance("--rtol", rtol)
    if engine == "ray":
        from trajectory_replay.ops.scan.ray_engine import require_ray

        require_ray()

    def scan(progress: ScanProgress) -> ScanReport:
        return scan_store(
            root,
            engine=engine,
            workers=workers,
            ray_address=ray_address,
            atol=atol,
            rtol=rtol,
            force=force,
            progress=progress,
        )

    if progress_wanted(quiet):
        with RichScanProgress() as bar:
            report = scan(bar)
    else:
        report = scan(ScanProgress())
    if html_path is not None:
        from trajectory_replay.html_report import write_scan_html

        typer.echo(
            f"trajectory-replay: wrote {html_path} ({human_bytes(write_scan_html(report, html_path))})", err=True
        )
    finish(report, as_json)


@app.command("cp", cls=Command)
@command
def cp_cmd(
    source: Annotated[str, Where("BUNDLE-OR-ROOT", "A bundle, or a store root with --step/--critic/--rollout/--all.")],
    dest_root: Annotated[str, Where("DEST-ROOT", "Destination store root (path or URL).")],
    step: Annotated[
        str | None, Value("--step", "R:S", "Copy the actor's step-level bundle of rollout R, step S.")
    ] = None,
    critic: Annotated[
        str | None, Value("--critic", "R:S", "Copy the critic's step-level bundle of rollout R, step S.")
    ] = None,
    rollout: Annotated[int | None, Value("--rollout", "R", "Copy the rollout-level bundle of rollout R.")] = None,
    all_bundles: Annotated[bool, typer.Option("--all", help="Copy every complete bundle of the root.")] = False,
    quiet: QuietFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Copy bundles between stores, transferring only the objects the destination lacks; exit 1 when a
    corrupt bundle of the source root was skipped (the others are copied)."""
    from trajectory_replay.ops.cp import copy_bundles
    from trajectory_replay.ops.progress import terminal_progress

    with terminal_progress(quiet) as progress:
        report = copy_bundles(
            source, dest_root, step=step, rollout=rollout, critic=critic, all_bundles=all_bundles, progress=progress
        )
    finish(report, as_json)


@app.command("gc", cls=Command)
@command
def gc_cmd(
    root: Annotated[str, Where("ROOT", STORE_ROOT)],
    grace: Annotated[
        str, Value("--grace", "DURATION", "Keep unreferenced keys younger than this (0s, 30m, 24h, 7d).")
    ] = "24h",
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
    finish(report, as_json)


@app.command("fsck", cls=Command)
@command
def fsck_cmd(
    root: Annotated[str, Where("ROOT", STORE_ROOT)],
    repair_from: Annotated[
        str | None, Value("--repair-from", "URL", "Store to re-fetch bad or missing objects from.", callback=_location)
    ] = None,
    quiet: QuietFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Verify every object and bundle tree; finalize finalizable bundles; exit 1 while a problem remains."""
    from trajectory_replay.ops.fsck import check_store
    from trajectory_replay.ops.progress import terminal_progress

    with terminal_progress(quiet) as progress:
        report = check_store(root, repair_from=repair_from, progress=progress)
    finish(report, as_json)


@app.command("stats", cls=Command)
@command
def stats_cmd(
    root: Annotated[str, Where("ROOT", STORE_ROOT)],
    as_json: JsonFlag = False,
) -> None:
    """Bundles, objects, logical and stored payload bytes, the dedup ratio, per payload name."""
    from trajectory_replay.ops.stats import store_stats

    finish(store_stats(root), as_json)


@app.command("export", cls=Command)
@command
def export_cmd(
    bundle: Annotated[str, Where("BUNDLE", "Native bundle path or URL.")],
    out_dir: Annotated[str, Where("OUT-DIR", "New directory to write the V1 bundle to.")],
    quiet: QuietFlag = False,
) -> None:
    """Write a bundle as a self-contained directory in the older V1 layout (`import` reads it back)."""
    from trajectory_replay.ops.export import export_bundle
    from trajectory_replay.ops.progress import terminal_progress

    with terminal_progress(quiet) as progress:
        report = export_bundle(bundle, out_dir, progress=progress)
    finish(report, as_json=False)


def main() -> None:
    """Console-script entry point."""
    from trajectory_replay._allocator import return_large_buffers_to_os

    return_large_buffers_to_os()
    # what the process holds before the command (the CLI's own imports, and torch when the caller imported it
    # first) lives until exit: out of the collector's scans, as `_import_torch` does for torch
    gc.freeze()
    app(prog_name="trajectory-replay")


if __name__ == "__main__":
    main()
