"""One first divergence across a step-level bundle and the rollout-level bundles that produced its samples.

Capture writes the reward and advantage stages into rollout-level bundles (`rollout-<R>`) and the loss into
step-level ones (`step-<R>-<S>`); each step sample records the rollout it came from (`SampleRecord.rollout_id`).
A chain replays every rollout-level bundle the step consumed, then checks the **link**: the inputs the step's
loss took that a rollout bundle recomputes (per-token `advantages` and, with gae, `returns`; the per-sample
`reward`) must equal that bundle's recomputed outputs for the same sample ids. Then the step itself.

The first divergence is taken in chain order: an upstream rollout stage (rollouts in id order, stages in
pipeline order), then the link, then the step's own stages. A bug upstream is thus named where it starts, not
as "loss.policy diverged" in the step. A rollout bundle that is not there is reported as such and the step
stands alone: the verdict (and exit code) is the step's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trajectory_replay.bundle.schema import StageId
from trajectory_replay.bundle.stage_io import STAGE_IO
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.replay.compare import SampleLayout, StageChecks, compare_tensors, resolve_tolerance
from trajectory_replay.replay.report import Divergence, ReplayReport, StageResult, divergence_place
from trajectory_replay.replay.source import ReplaySource, SamplesById

LINK = "link"
"""The report entry of the check between a rollout bundle's recomputed outputs and a step's inputs."""

STEP_STAGES = (StageId.LOSS_POLICY, StageId.LOSS_VALUE)
"""The stages of a step-level bundle that take inputs a rollout-level bundle recomputes."""
LINKED_TOKENS = tuple(
    dict.fromkeys(
        name
        for stage in STEP_STAGES
        for upstream, name in STAGE_IO[stage].upstream
        if STAGE_IO[upstream].per == "token"
    )
)
"""Per-token step inputs that a rollout stage recomputes (advantage.estimate's advantages and returns)."""
LINKED_SAMPLE = tuple((field, output) for output, field in STAGE_IO[StageId.REWARD_POST_PROCESS].in_records.items())
"""Per-sample step record fields that a rollout stage recomputes (reward.post_process): (record field, output)."""

Recomputed = dict[str, dict[str, torch.Tensor]]
"""Recomputed outputs of a rollout replay by output name, then sample id (the sample's rows)."""
KEPT = LINKED_TOKENS + tuple(output for _, output in LINKED_SAMPLE)
"""The outputs a rollout replay hands the link."""


def replay_upstream(
    sources: Sequence[ReplaySource], atol: float | None = None, rtol: float | None = None
) -> tuple[ReplayReport, Recomputed]:
    """A whole rollout-level bundle replayed (its groups and whitening need every sample), with what it recomputed
    for the link."""
    from trajectory_replay.replay.plan import plan_replay
    from trajectory_replay.replay.runner import execute_keeping

    return execute_keeping(plan_replay(sources), KEPT, atol=atol, rtol=rtol)


@dataclass(frozen=True)
class ChainEntry:
    """One bundle of the chain: its replay report, or why there is none."""

    bundle: str
    role: str
    """"upstream" (a rollout-level bundle) or "step"."""
    report: ReplayReport | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "bundle": self.bundle,
            "role": self.role,
            "note": self.note or None,
            "report": None if self.report is None else self.report.to_dict(),
        }


@dataclass(frozen=True)
class ChainReport(Outcome):
    """The replay of a step with its upstream rollouts: every report, the link, and one first divergence."""

    finite_json = True

    step: ChainEntry
    upstream: tuple[ChainEntry, ...] = ()
    link: StageResult | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def linked(self) -> bool:
        """True when at least one upstream rollout bundle was replayed (the chain is more than the step)."""
        return any(e.report is not None for e in self.upstream)

    @property
    def first_divergence(self) -> dict[str, Any] | None:
        """{bundle, stage, rank, sample, field, token} of the first failure in chain order, or None."""
        for entry in self.upstream:
            if entry.report is not None and entry.report.first_divergence is not None:
                return entry.report.first_divergence
        if self.link is not None and self.link.failed:
            return divergence_place(self.step.bundle, self.link)
        return None if self.step.report is None else self.step.report.first_divergence

    @property
    def first_divergent_stage(self) -> str | None:
        """The stage of the first divergence, in whichever bundle of the chain it is (`link` for the link)."""
        first = self.first_divergence
        return None if first is None else first["stage"]

    @property
    def unsupported_reason(self) -> str | None:
        """Why the step was not checked (nothing diverged and its own replay compared nothing), or None. Rollouts
        that pass do not make a step that was not checked pass."""
        if self.first_divergence is not None:
            return None
        if self.step.report is None:
            return f"step bundle {self.step.bundle} was not replayed"
        reason = self.step.report.unsupported_reason
        return None if reason is None else f"step bundle {self.step.bundle}: {reason}"

    @property
    def reason(self) -> str | None:
        return self.unsupported_reason

    @property
    def status(self) -> Status:
        """diverged (anywhere in the chain), unsupported (the step checked nothing) or pass."""
        if self.first_divergence is not None:
            return Status.DIVERGED
        return Status.UNSUPPORTED if self.unsupported_reason is not None else Status.PASS

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS

    def _entries(self) -> list[dict[str, Any]]:
        """Every stage entry of the chain in chain order, each naming its bundle: rollouts, the link, the step."""
        out = [
            {"bundle": e.bundle, **s.to_dict()} for e in self.upstream if e.report is not None for s in e.report.stages
        ]
        if self.link is not None:
            out.append({"bundle": self.step.bundle, **self.link.to_dict()})
        if self.step.report is not None:
            out += [{"bundle": self.step.bundle, **s.to_dict()} for s in self.step.report.stages]
        return out

    def to_dict(self) -> dict[str, Any]:
        """The `replay --json` object of a chain: the keys of a single bundle's report (`ReplayReport.to_dict`),
        describing the first divergence wherever it is and listing every stage of the chain; then `chain` (each
        bundle's own report), `link` and `notes`."""
        step = self.step.report
        reports = [e.report for e in self.upstream if e.report is not None] + ([step] if step is not None else [])
        return {
            "status": self.status,
            "bundle_id": self.step.bundle,
            "passed": self.passed,
            "first_divergent_stage": self.first_divergent_stage,
            "first_divergence": self.first_divergence,
            "reason": self.unsupported_reason,
            "compared": sum(r.compared for r in reports) + (self.link.compared if self.link is not None else 0),
            "config_overrides": {} if step is None else dict(step.overrides),
            "stages": self._entries(),
            "chain": [e.to_dict() for e in self.upstream] + [self.step.to_dict()],
            "link": None if self.link is None else self.link.to_dict(),
            "notes": list(self.notes),
        }

    def render_text(self) -> str:
        """Each bundle's report in chain order, the link between them, and the first divergence on top."""
        if not self.upstream:  # nothing to chain: the step's own report, with why
            return "\n".join(
                [f"note: {n}" for n in self.notes]
                + ([self.step.report.render_text()] if self.step.report is not None else [])
            )
        names = " -> ".join([e.bundle for e in self.upstream] + [self.step.bundle])
        first, reason = self.first_divergence, self.unsupported_reason
        if reason is not None:
            lines = [f"chain {names} — unsupported: nothing compared ({reason})"]
        else:
            where = "none" if first is None else ", ".join(f"{k} {v}" for k, v in first.items() if v is not None)
            lines = [f"chain {names} — first divergence: {where}"]
        lines += [f"note: {n}" for n in self.notes]
        for entry in self.upstream:
            lines.append(f"== {entry.bundle} (upstream)" + (f": {entry.note}" if entry.note else ""))
            if entry.report is not None:
                lines.append(entry.report.render_text())
        if self.link is not None:
            lines.append(f"== link: rollout outputs -> {self.step.bundle} inputs")
            lines.append(f"[{self.link.status:>7}] {LINK}  {self.link.message}")
            lines.extend(f"          {d.render()}" for d in self.link.divergences)
        lines.append(f"== {self.step.bundle} (step)")
        if self.step.report is not None:
            lines.append(self.step.report.render_text())
        return "\n".join(lines)


def rollout_ids(step_sources: Sequence[ReplaySource]) -> tuple[list[int], list[str]]:
    """(the rollout ids the step's samples record, in order; ids of samples that record none)."""
    ids: dict[int, None] = {}
    missing: list[str] = []
    for source in step_sources:
        for r in source.index.samples:
            if r.rollout_id is None:
                missing.append(r.sample_id)
            else:
                ids.setdefault(int(r.rollout_id))
    return sorted(ids), missing


def check_link(
    step_sources: Sequence[ReplaySource],
    upstream: Mapping[int, Recomputed],
    atol: float | None = None,
    rtol: float | None = None,
) -> StageResult:
    """Compare each step sample's inputs with its rollout bundle's recomputed outputs for the same sample id.
    `upstream`: rollout id -> what that bundle's replay recomputed. A step sample of a replayed rollout that the
    rollout bundle does not hold is a failure; samples whose rollout was not replayed are not compared."""
    f = StageChecks()
    tol = resolve_tolerance(step_sources[0].manifest, StageId.ADVANTAGE_ESTIMATE.value, atol, rtol)
    step = SamplesById.of(step_sources)
    linked: dict[str, Recomputed] = {}  # sample id -> what its rollout bundle recomputed
    for sample_id in step.where:
        r = step.record(sample_id)
        if r.rollout_id is None or int(r.rollout_id) not in upstream:
            continue
        outputs = upstream[int(r.rollout_id)]
        if not any(sample_id in values for values in outputs.values()):
            source = step.sources[step.where[sample_id][0]]
            f.problem(
                f"sample {sample_id} of step bundle {source.bundle_id} is not in rollout-{r.rollout_id}",
                Divergence("sample_id", sample_id, None, None, None, None),
            )
            continue
        linked[sample_id] = outputs
    for name in LINKED_TOKENS:
        _link_tokens(f, name, step, linked, tol)
    for record_field, output in LINKED_SAMPLE:
        _link_samples(f, record_field, output, step, linked, tol)
    return f.result(LINK, None, passed_message=f"{len(linked)} samples linked")


def _link_tokens(f: StageChecks, name: str, step: SamplesById, linked: Mapping[str, Recomputed], tol) -> None:
    """The step's `name` payload rows against the rollout bundles' recomputed rows, sample by sample."""
    ids = [sid for sid, outputs in linked.items() if sid in outputs.get(name, {})]
    if not ids or not step.has_payload(name):
        return  # not recomputed upstream, or not an input the step took (e.g. returns without a value loss)
    taken = step.rows(name, ids)
    expected, actual, kept = [], [], []
    for sid in ids:
        recomputed = linked[sid][name][sid]
        if recomputed.numel() != taken[sid].numel():
            f.problem(
                f"{name} of sample {sid}: the step has {taken[sid].numel()} tokens, "
                f"rollout-{step.record(sid).rollout_id} {recomputed.numel()}"
            )
            continue
        expected.append(recomputed)
        actual.append(taken[sid])
        kept.append(sid)
    if kept:
        f.add(
            compare_tensors(
                name,
                torch.cat(expected),
                torch.cat(actual),
                SampleLayout.per_token(kept, torch.tensor([t.numel() for t in actual])),
                tol,
            )
        )


def _link_samples(
    f: StageChecks, record_field: str, output: str, step: SamplesById, linked: Mapping[str, Recomputed], tol
) -> None:
    """A per-sample record field of the step against the rollout bundles' recomputed per-sample output."""
    ids = [sid for sid, outputs in linked.items() if sid in outputs.get(output, {})]
    if ids:
        expected = torch.tensor([float(linked[sid][output][sid].reshape(-1)[0]) for sid in ids])
        actual = torch.tensor([float(getattr(step.record(sid), record_field)) for sid in ids])
        f.add(compare_tensors(record_field, expected, actual, SampleLayout.per_sample(ids), tol))


def replay_chain(
    step_sources: Sequence[ReplaySource],
    open_rollout: Callable[[int], Sequence[ReplaySource] | None],
    *,
    replay_step: Callable[[Sequence[ReplaySource]], ReplayReport],
    atol: float | None = None,
    rtol: float | None = None,
) -> ChainReport:
    """Replay the step (`replay_step`, which applies the user's selection and options) with every rollout bundle its
    samples record. `open_rollout(R)` gives the sources of rollout-R, or None when it is not there."""
    step_id = step_sources[0].bundle_id
    ids, unlinked = rollout_ids(step_sources)
    notes: list[str] = []
    if unlinked and not ids:
        notes.append(
            f"step bundle {step_id} records no rollout bundle for its samples (captured before samples "
            "recorded their rollout_id): replayed alone"
        )
    elif unlinked:
        notes.append(f"{len(unlinked)} samples of {step_id} record no rollout bundle (e.g. {unlinked[0]}): not linked")
    upstream: list[ChainEntry] = []
    recomputed: dict[int, Recomputed] = {}
    for rollout_id in ids:
        name = f"rollout-{rollout_id}"
        sources = open_rollout(rollout_id)
        if sources is None:
            upstream.append(ChainEntry(name, "upstream", note="not in the store: the step is replayed alone"))
            continue
        report, outputs = replay_upstream(sources, atol, rtol)
        upstream.append(ChainEntry(sources[0].bundle_id, "upstream", report))
        recomputed[rollout_id] = outputs
    link = check_link(step_sources, recomputed, atol, rtol) if recomputed else None
    step = ChainEntry(step_id, "step", replay_step(step_sources))
    return ChainReport(step=step, upstream=tuple(upstream), link=link, notes=tuple(notes))


__all__ = [
    "ChainEntry",
    "ChainReport",
    "KEPT",
    "LINK",
    "LINKED_TOKENS",
    "Recomputed",
    "check_link",
    "replay_chain",
    "replay_upstream",
    "rollout_ids",
]
