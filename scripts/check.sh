#!/usr/bin/env bash
# Lint, format check and type check, as CI runs them: ruff (rules and format in pyproject.toml) over the project's
# Python, and mypy over the package (strict on the public API modules named in pyproject.toml).
# Run after ./scripts/bootstrap.sh, which installs both tools at the versions pinned in the test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
paths=(trajectory_replay tests benchmarks examples)
.venv/bin/ruff check "${paths[@]}"
.venv/bin/ruff format --check "${paths[@]}"
.venv/bin/mypy trajectory_replay
