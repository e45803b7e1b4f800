"""Fixtures for the V1 directory format tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bundle_legacy.v1_cases import Case, make_case


@pytest.fixture
def case() -> Case:
    return make_case()


@pytest.fixture
def bundle(tmp_path: Path, case: Case) -> Path:
    """The canonical case written as a single-producer V1 bundle `<tmp>/b-1`."""
    return case.write(tmp_path / "b-1")
