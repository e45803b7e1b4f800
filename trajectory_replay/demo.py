"""`demo`: the canonical physical-batch normalization bug, written as two bundles and replayed.

The same GRPO step is written twice into a store (a new local directory by default, or any path
or URL given: `s3://bucket/demo` writes there): once with rewards normalized per
prompt group (correct) and once normalized over the physical batch (the bug). Current
log-probs differ from the old ones (ratio e^0.5), so the final loss differs too; replay still
names reward.post_process as the first divergent stage.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trajectory_replay.backends import location_problem, redact_url
from trajectory_replay.bundle import BundleWriter, open_sources
from trajectory_replay.errors import UsageError
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.replay import ReplayReport, canonical_case, replay


@dataclass
class DemoResult(Outcome):
    """The two bundles written and their replays; it passes when they turned out as the demo shows them."""

    directory: str
    """The store written into, as given (a path or URL)."""
    clean: ReplayReport
    buggy: ReplayReport

    @property
    def status(self) -> Status:
        """pass when the clean step passes and the buggy one first diverges at reward.post_process; diverged when
        the replays differ from that."""
        expected = self.clean.passed and self.buggy.first_divergent_stage == "reward.post_process"
        return Status.PASS if expected else Status.DIVERGED

    @property
    def as_expected(self) -> bool:
        """The clean step passes and the buggy one first diverges at reward.post_process."""
        return self.status is Status.PASS

    def render_text(self) -> str:
        return (
            f"wrote {self.directory}/b-00001 (normalized per prompt group) and "
            f"{self.directory}/b-00065 (normalized over the physical batch)\n\n"
            f"{self.clean.render_text()}\n\n{self.buggy.render_text()}"
        )


def _fresh_directory(base: Path) -> Path:
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def run_demo(directory: str | os.PathLike | None = None) -> DemoResult:
    """Write the clean and buggy bundles into the store `directory` (a path or URL; default: a new
    ./trajectory-replay-demo) and replay both."""
    if directory is not None:
        problem = location_problem(directory)
        if problem:  # `s3://` stripped of its slashes would be a local directory named `s3:`; '' the current one
            raise UsageError(problem)
        # a URL stays a URL: as a Path, `s3://bucket/x` would become a local directory named `s3:`
        root = os.fspath(directory).rstrip("/") or "/"
    else:
        root = str(_fresh_directory(Path.cwd() / "trajectory-replay-demo"))
    reports = {}
    for buggy in (False, True):
        case = canonical_case(buggy=buggy, current_logprob=0.5)
        url = f"{root.rstrip('/')}/{case.manifest.bundle_id}"
        writer = BundleWriter(url, case.manifest, case.index, case.expected)
        for name, tensor in case.payloads.items():
            writer.write_payload(name, tensor)
        writer.finalize()
        reports[buggy] = replay(open_sources(url))
    return DemoResult(redact_url(root), reports[False], reports[True])
