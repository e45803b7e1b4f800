"""Stores for the `scan` tests: clean, divergent, incomplete and corrupt bundles at chosen anchors."""

from __future__ import annotations

import json
from typing import Any

from typer.testing import CliRunner

from tests.ops.conftest import write_ranks
from trajectory_replay.backends import open_backend
from trajectory_replay.bundle import BundleWriter
from trajectory_replay.bundle.schema import ActorStepId, Identity
from trajectory_replay.bundle.status import bundle_status
from trajectory_replay.cli import app
from trajectory_replay.ops.walk import Walker
from trajectory_replay.replay import canonical_case
from trajectory_replay.store.digest import object_key

runner = CliRunner()

CLEAN = {"s-1-0": (1, 0), "s-1-1": (1, 1), "s-4-0": (4, 0)}
DIVERGED = {"s-2-1": (2, 1), "a-late": (9, 0)}
"""`a-late` sorts first by name but last by anchor: the earliest divergence is s-2-1 (step 2:1)."""
CORRUPT = {"s-3-0": (3, 0)}
INCOMPLETE = "partial"
"""A two-rank bundle whose rank 1 never landed."""


def write_step(
    root: str,
    name: str,
    rollout: int,
    step: int,
    *,
    buggy: bool = False,
    current_logprob: float = 0.0,
    storage_options: dict | None = None,
) -> str:
    """The canonical step (buggy: the physical-batch bug) as bundle `name` at anchor `rollout:step`."""
    case = canonical_case(buggy=buggy, current_logprob=current_logprob)
    identity = Identity(actor_step_id=ActorStepId(rollout_id=rollout, step_id=step))
    manifest = case.manifest.model_copy(update={"bundle_id": name})
    index = case.index.model_copy(update={"bundle_id": name, "identity": identity})
    writer = BundleWriter(f"{root}/{name}", manifest, index, case.expected, **(storage_options or {}))
    for payload, tensor in case.payloads.items():
        writer.write_payload(payload, tensor)
    writer.finalize()
    return f"{root}/{name}"


def corrupt_payload(root: str, name: str, payload: str, storage_options: dict | None = None) -> None:
    """Overwrite the chunks of one payload of bundle `name` with other bytes of the same size."""
    backend = open_backend(root, **(storage_options or {}))
    state = bundle_status(backend, name)
    tree = Walker(backend).trees([state])[name]
    chunks = [c for _, spec, node in tree.payloads if spec.name == payload for c in node.chunks]
    assert chunks, f"{name} has no payload {payload}"
    for digest, size in chunks:
        backend.write(object_key(digest), b"\x5a" * size)


def populate(root: str, storage_options: dict | None = None, *, corrupt: bool = True) -> None:
    """Clean and divergent step bundles, one incomplete two-rank bundle, and (with `corrupt`) one whose
    `log_probs` payload no longer matches its digest (its log-probs are its own: no other bundle shares them)."""
    opts = storage_options or {}
    for name, (r, s) in CLEAN.items():
        write_step(root, name, r, s, storage_options=opts)
    for name, (r, s) in DIVERGED.items():
        write_step(root, name, r, s, buggy=True, storage_options=opts)
    if corrupt:
        for name, (r, s) in CORRUPT.items():
            write_step(root, name, r, s, current_logprob=0.3, storage_options=opts)
            corrupt_payload(root, name, "log_probs", opts)
    write_ranks(root, INCOMPLETE, land=[0], expected_ranks=[0, 1], **opts)


def cli(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    return result


def cli_json(*args: str) -> tuple[int, dict[str, Any]]:
    result = cli(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def check_summary(summary: dict[str, Any], *, corrupt: bool = True) -> None:
    """The summary of a `populate`d store: counts, earliest divergence, the incomplete bundle, every verdict."""
    counts = summary["counts"]
    assert counts == {
        "pass": len(CLEAN),
        "diverged": len(DIVERGED),
        "invalid": len(CORRUPT) if corrupt else 0,
        "incomplete": 1,
        "unsupported": 0,
        "error": 0,
    }, counts
    first = summary["earliest_divergence"]
    assert (first["name"], first["anchor"], first["first_divergent_stage"], first["sample_id"], first["field"]) == (
        "s-2-1",
        "step 2:1",
        "reward.post_process",
        "s-0",
        "reward",
    )
    assert [(i["name"], i["missing_ranks"], i["expected_ranks"]) for i in summary["incomplete"]] == [
        (INCOMPLETE, [1], [0, 1])
    ]
    by_name = {v["name"]: v for v in summary["verdicts"]}
    assert [v["name"] for v in summary["verdicts"]] == [
        "s-1-0",
        "s-1-1",
        "s-2-1",
        *(["s-3-0"] if corrupt else []),
        "s-4-0",
        "a-late",
        INCOMPLETE,
    ], "anchor order"
    if corrupt:
        assert by_name["s-3-0"]["status"] == "invalid"
        assert "s-3-0" not in [v["name"] for v in summary["verdicts"] if v["cached"]]
    assert by_name["a-late"]["first_divergent_stage"] == "reward.post_process"


__all__ = [
    "CLEAN",
    "CORRUPT",
    "DIVERGED",
    "INCOMPLETE",
    "check_summary",
    "cli",
    "cli_json",
    "corrupt_payload",
    "populate",
    "write_step",
]
