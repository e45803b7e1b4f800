"""Fixtures shared by the example tests: the capture-off baseline run of the tiny GRPO example."""

from __future__ import annotations

import pytest

from tests.examples.helpers import SMALL, ExampleRun, run_example


@pytest.fixture(scope="session")
def baseline(tmp_path_factory) -> ExampleRun:
    """W=2, 2 rollouts of the SMALL size, seed 3, no capture variables at all (capture off)."""
    return run_example(tmp_path_factory.mktemp("tiny_grpo"), "baseline", *SMALL)
