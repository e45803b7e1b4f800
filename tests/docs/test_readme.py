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
