"""docs/replay.md stays true: its Python blocks run as written, its worked example is what `demo` prints,
and nothing the repository ships points at a document outside it."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from trajectory_replay.demo import run_demo

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "replay.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)
TEXT_BLOCKS = re.findall(r"```text\n(.*?)```", DOC, flags=re.S)


def test_readme_links_the_replay_doc():
    assert "docs/replay.md" in (REPO / "README.md").read_text()


@pytest.mark.parametrize("number", range(len(PYTHON_BLOCKS)))
def test_python_block_runs_as_written(number, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(PYTHON_BLOCKS[number], f"docs/replay.md python block {number + 1}", "exec"),
            {"__name__": "__main__"},
        )
    # the doc quotes what the example prints: each line must appear in it (line breaks and backticks aside)
    doc_words = " ".join(DOC.replace("`", "").split())
    printed = out.getvalue().splitlines()
    assert printed
    for line in printed:
        assert " ".join(line.split()) in doc_words, line


def test_worked_example_is_what_demo_prints(tmp_path):
    result = run_demo(tmp_path / "demo")
    assert result.as_expected
    assert TEXT_BLOCKS, "docs/replay.md has no worked-example report"
    assert TEXT_BLOCKS[0].rstrip("\n") == result.buggy.render_text()


EXTERNAL = re.compile(r"\b(?:DESIGN|REPLAY_SEMANTICS|ALGORITHMS|STYLE)\.md\b|\bshared/")


def test_nothing_shipped_points_outside_the_repository():
    shipped = [REPO / "README.md"]
    for folder in ("trajectory_replay", "docs", "examples", "benchmarks"):
        shipped += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".md", ".toml", ".txt", ".sh")]
    hits = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in shipped
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if EXTERNAL.search(line)
    ]
    assert hits == []
