"""The README's Python blocks are complete programs: each runs as written, in a fresh directory."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("number", range(len(BLOCKS)))
def test_readme_block_runs_as_written(number, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[number], f"README.md python block {number + 1}", "exec"), {"__name__": "__main__"})
    if "first divergent stage" in BLOCKS[number]:
        assert out.getvalue().strip() == "first divergent stage: None"


COMMAND_ROWS = dict(re.findall(r"^\| `trajectory-replay (\w+)([^`]*)` \|", README.read_text(), flags=re.M))
"""README's command table: command -> its usage as the row writes it."""


def _usage(text: str) -> tuple[list[str], dict[str, str | None]]:
    """(positional placeholders, {--option: its metavar, None for a flag}) of a usage line as README writes it:
    ` \\| ` separates alternatives, a `\\|` inside a word is part of it (`local\\|ray`)."""
    text = text.replace(" \\| ", " ").replace("\\|", "|")
    option = r"(--[a-z-]+)(?: (?!--)([^\s\[\]]+))?"
    options = {m.group(1): m.group(2) for m in re.finditer(option, text)}
    positional = re.sub(option, "", text).replace("[", " ").replace("]", " ").split()
    return positional, options


def _help_usage(command) -> tuple[list[str], dict[str, str | None]]:
    """The same from the command itself: its arguments' metavars, its long options and their metavars."""
    arguments = [
        p.metavar if p.required else f"[{p.metavar}]" for p in command.params if p.param_type_name == "argument"
    ]
    options = {
        next(o for o in p.opts if o.startswith("--")): None if p.is_flag else p.metavar
        for p in command.params
        if p.param_type_name == "option"
    }
    return arguments, options


def test_every_command_has_a_row_that_matches_its_help():
    import typer.main

    from trajectory_replay.cli import app

    commands = typer.main.get_command(app).commands
    assert sorted(COMMAND_ROWS) == sorted(commands)
    for name, command in commands.items():
        row_arguments, row_options = _usage(COMMAND_ROWS[name])
        arguments, options = _help_usage(command)
        assert row_arguments == [a.strip("[]") for a in arguments], name
        assert row_options == options, (name, row_options, options)
