"""Diff two captures of the same step: records, payloads and expected outputs, matched by sample id.

Two bundles (any mix of native, older-format, local and `s3://`) are compared sample by sample: the samples are
matched by id, so a different order or a different rank sharding is no difference. Compared are the recompute
config field by field, every record field a stage reads, every payload token by token, and the expected outputs
(per-sample lists by sample id, cohort scalars rank by rank when both bundles shard their samples alike). Each
difference is placed at the stage that produces it, else the first stage that reads it, and the report names, in
stage order, the first stage whose inputs or expected outputs differ.

Native payloads are compared lazily through the store: a payload with the same digest and the same rows in both
bundles is equal without a read, and a sample whose rows lie in blocks with equal hashes at the same offsets in
both blobs (the blob records list every block's BLAKE3 hash) is equal without fetching them; only the rows of the
other samples are read, each verified. So a diff of
two captures that differ in one prompt group fetches about that group's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from trajectory_replay.bundle.schema import STAGE_ORDER, RecomputeConfig, StageId
from trajectory_replay.bundle.stage_io import STAGE_IO
from trajectory_replay.outcome import Outcome, Status
from trajectory_replay.replay.compare import EXACT, SampleLayout, Tolerances, compare_tensors, resolve_tolerance
from trajectory_replay.replay.report import format_number, json_number
from trajectory_replay.replay.source import ReplaySource, SamplesById
from trajectory_replay.units import clip, fit, human_bytes, report_width

CONFIG = "config"
"""The pseudo-stage of recompute config differences: they change what every stage computes, so they come first."""

RECORD_STAGES = {
    "response_length": StageId.SAMPLE,
    "total_length": StageId.SAMPLE,
    "label_hash": StageId.SAMPLE,
    "rollout_id": StageId.SAMPLE,
    "policy_version": StageId.ROLLOUT_MISMATCH,
    "raw_reward": StageId.REWARD_RAW,
    "group_index": StageId.REWARD_POST_PROCESS,
    "reward": StageId.REWARD_POST_PROCESS,
}
"""The record fields compared, with the stage that reads (or, for `reward`, produces) each. Micro-batch ids and the
text fields are not: two captures of one step may batch it differently."""
EXACT_FIELDS = ("response_length", "total_length", "label_hash", "rollout_id", "policy_version", "group_index")
PER_SAMPLE_EXPECTED = {("reward.raw", "raw_rewards"), ("reward.post_process", "rewards")}


@dataclass(frozen=True)
class FieldDiff:
    """One compared field: where it belongs, how many values were compared, how many differ, by how much."""

    name: str
    kind: str
    """config, record, payload, expected or samples."""
    stage: str
    compared: int = 0
    differing: int = 0
    max_abs_diff: float | None = None
    first: dict[str, Any] | None = None
    """The first difference: sample, token, a, b."""
    note: str = ""

    @property
    def differs(self) -> bool:
        return self.differing > 0

    def to_dict(self) -> dict[str, Any]:
        first = (
            None
            if self.first is None
            else {k: json_number(v) if isinstance(v, float) else v for k, v in self.first.items()}
        )
        return {
            "name": self.name,
            "kind": self.kind,
            "stage": self.stage,
            "compared": self.compared,
            "differing": self.differing,
            "max_abs_diff": json_number(self.max_abs_diff),
            "first": first,
            "note": self.note or None,
        }


def _stage_rank(stage: str) -> int:
    order = [CONFIG] + [s.value for s in STAGE_ORDER]
    return order.index(stage) if stage in order else len(order)


@dataclass(frozen=True)
class DiffReport(Outcome):
    """Every field compared, in stage order, and the first stage whose inputs or expected outputs differ; its status
    is pass when the two captures are identical within tolerance, else diverged."""

    finite_json = True

    a: str
    b: str
    fields: tuple[FieldDiff, ...]
    samples: int
    bytes_fetched: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fields_in_stage_order(self) -> list[FieldDiff]:
        """Every field, the config first, then by the first stage that reads or records it."""
        return sorted(self.fields, key=lambda f: _stage_rank(f.stage))

    @property
    def differences(self) -> list[FieldDiff]:
        return [f for f in self.fields_in_stage_order if f.differs]

    @property
    def identical(self) -> bool:
        return not self.differences

    @property
    def first(self) -> FieldDiff | None:
        found = self.differences
        return found[0] if found else None

    @property
    def status(self) -> Status:
        return Status.PASS if self.identical else Status.DIVERGED

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS

    def to_dict(self) -> dict[str, Any]:
        first = self.first
        return {
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "samples": self.samples,
            "first_difference": None
            if first is None
            else {"stage": first.stage, "field": first.name, **(first.to_dict()["first"] or {})},
            "fields": [f.to_dict() for f in self.fields_in_stage_order],
            "bytes_fetched": self.bytes_fetched,
            "notes": list(self.notes),
        }

    def render_text(self, width: int | None = None) -> str:
        """The report; with a `width` (default: the terminal's, no limit when piped) the header and notes wrap and
        the field column narrows, a stage or field name too long for its column ending in an ellipsis."""
        width = width or report_width()
        field_width = 34 if width is None else max(12, width - _OTHER_COLUMNS)
        first = self.first
        if first is None:
            head = "identical"
        else:
            where = (
                ""
                if first.first is None
                else " "
                + " ".join(
                    f"{k}={format_number(v) if isinstance(v, float) else v}"
                    for k, v in first.first.items()
                    if v is not None
                )
            )
            head = f"first difference at {first.stage}: {first.name}{where}"
        lines = fit(f"diff {self.a} {self.b}: {self.samples} samples matched by id — {head}", width, 2)
        lines += [part for n in self.notes for part in fit(f"note: {n}", width, 6)]
        lines.append(f"  {'stage':<20} {'field':<{field_width}} {'compared':>9} {'differ':>7} {'max |a-b|':>11}")
        for f in self.fields_in_stage_order:
            mark = "*" if f.differs else " "
            stage = clip(f.stage, None if width is None else 20)
            name = clip(f.name, None if width is None else field_width)
            lines += fit(
                f"{mark} {stage:<20} {name:<{field_width}} {f.compared:>9} {f.differing:>7} "
                f"{format_number(f.max_abs_diff):>11}" + (f"  ({f.note})" if f.note else ""),
                width,
                23,
            )
        if self.bytes_fetched is not None:
            lines.append(f"fetched from the stores: {human_bytes(self.bytes_fetched)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- matching


def _payload_stage(name: str) -> str:
    """The stage that records its output in payload `name`, else the first stage that reads it."""
    for stage in STAGE_ORDER:
        io = STAGE_IO[stage]
        if io.recorded_as == "payload" and name in io.outputs:
            return stage.value
    for stage in STAGE_ORDER:
        if name in STAGE_IO[stage].payloads:
            return stage.value
    return StageId.SAMPLE.value


# --------------------------------------------------------------------------- the comparisons


def diff_bundles(
    a: Sequence[ReplaySource],
    b: Sequence[ReplaySource],
    *,
    a_label: str = "A",
    b_label: str = "B",
    atol: float | None = None,
    rtol: float | None = None,
) -> DiffReport:
    """Compare two bundles of one step (one source per rank each)."""
    left, right = SamplesById.of(a), SamplesById.of(b)
    common = [sid for sid in left.where if sid in right.where]
    fields: list[FieldDiff] = []
    only_a = [sid for sid in left.where if sid not in right.where]
    only_b = [sid for sid in right.where if sid not in left.where]
    if only_a or only_b:
        fields.append(
            FieldDiff(
                "sample_id",
                "samples",
                StageId.SAMPLE.value,
                len(common) + len(only_a) + len(only_b),
                len(only_a) + len(only_b),
                None,
                {
                    "sample": (only_a or only_b)[0],
                    "token": None,
                    "a": "present" if only_a else "absent",
                    "b": "absent" if only_a else "present",
                },
                f"{len(only_a)} only in A, {len(only_b)} only in B",
            )
        )
    manifest = a[0].manifest

    def tol(stage: str) -> Tolerances:
        return resolve_tolerance(manifest, stage, atol, rtol) if stage != CONFIG else EXACT

    fields += _config_fields(a[0].index.config, b[0].index.config)
    fields += _record_fields(left, right, common, tol)
    same_lengths = [sid for sid in common if left.record(sid).response_length == right.record(sid).response_length]
    names = sorted({n for s in list(a) + list(b) for n in s.manifest.payloads} | {"loss_mask"})
    for name in names:
        fields.append(_payload_field(name, left, right, same_lengths, tol(_payload_stage(name))))
    fields += _expected_fields(left, right, common, tol)
    notes = []
    if len(same_lengths) < len(common):
        notes.append(
            f"{len(common) - len(same_lengths)} samples differ in response_length: their payload rows are not compared"
        )
    return DiffReport(a_label, b_label, tuple(fields), len(common), _bytes_fetched(list(a) + list(b)), tuple(notes))


def _config_fields(a: RecomputeConfig, b: RecomputeConfig) -> list[FieldDiff]:
    out = []
    da, db = a.model_dump(), b.model_dump()
    differing = [k for k in da if da[k] != db.get(k)]
    first = None
    if differing:
        k = differing[0]
        first = {"sample": None, "token": None, "a": f"{k}={da[k]!r}", "b": f"{k}={db.get(k)!r}"}
    out.append(
        FieldDiff("recompute config", "config", CONFIG, len(da), len(differing), None, first, ", ".join(differing))
    )
    return out


def _record_fields(left: SamplesById, right: SamplesById, common: list[str], tol) -> list[FieldDiff]:
    out = []
    for name, stage in RECORD_STAGES.items():
        exact = name in EXACT_FIELDS
        values = [(sid, getattr(left.record(sid), name), getattr(right.record(sid), name)) for sid in common]
        if exact or any(v is None or w is None for _, v, w in values):
            bad = [(sid, v, w) for sid, v, w in values if v != w]
            first = None if not bad else {"sample": bad[0][0], "token": None, "a": bad[0][1], "b": bad[0][2]}
            numeric = [abs(v - w) for _, v, w in bad if isinstance(v, (int, float)) and isinstance(w, (int, float))]
            out.append(
                FieldDiff(
                    f"record.{name}",
                    "record",
                    stage.value,
                    len(values),
                    len(bad),
                    float(max(numeric)) if numeric else (0.0 if values and not bad else None),
                    first,
                )
            )
            continue
        compared = compare_tensors(
            name,
            torch.tensor([v for _, v, _ in values], dtype=torch.float64),
            torch.tensor([w for _, _, w in values], dtype=torch.float64),
            SampleLayout.per_sample([sid for sid, _, _ in values]),
            tol(stage.value),
        )
        out.append(_from_comparison(f"record.{name}", "record", stage.value, compared))
    return out  # loss masks are compared as the loss_mask payload (older bundles keep them in the records)


def _from_comparison(name: str, kind: str, stage: str, c, note: str = "") -> FieldDiff:
    first = None
    if c.divergences:
        d = c.divergences[0]
        first = {"sample": d.sample_id, "token": d.token_offset, "a": d.expected, "b": d.actual}
    problems = "; ".join(c.problems)
    return FieldDiff(
        name,
        kind,
        stage,
        c.compared,
        c.mismatch_count + (1 if c.problems and not c.mismatch_count else 0),
        c.max_abs_error,
        first,
        "; ".join(x for x in (note, problems) if x),
    )


def _payload_field(name: str, left: SamplesById, right: SamplesById, ids: list[str], tol: Tolerances) -> FieldDiff:
    stage = _payload_stage(name)
    in_a, in_b = left.has_payload(name), right.has_payload(name)
    if not (in_a and in_b):
        return FieldDiff(f"payload.{name}", "payload", stage, 0, 1, None, None, "only in A" if in_a else "only in B")
    unread, note = _provably_equal(name, left, right, ids)
    todo = [sid for sid in ids if sid not in unread]
    if not todo:
        tokens = sum(max(left.record(sid).response_length, 0) for sid in ids)
        return FieldDiff(f"payload.{name}", "payload", stage, tokens, 0, 0.0 if tokens else None, None, note)
    rows_a, rows_b = left.rows(name, todo), right.rows(name, todo)
    expected = torch.cat([rows_a[sid].to(torch.float64) for sid in todo])
    actual = torch.cat([rows_b[sid].to(torch.float64) for sid in todo])
    layout = SampleLayout.per_token(todo, torch.tensor([rows_a[sid].numel() for sid in todo]))
    compared = compare_tensors(name, expected, actual, layout, tol)
    field_diff = _from_comparison(f"payload.{name}", "payload", stage, compared, note)
    shared = sum(max(left.record(sid).response_length, 0) for sid in unread)
    return FieldDiff(
        field_diff.name,
        field_diff.kind,
        field_diff.stage,
        field_diff.compared + shared,
        field_diff.differing,
        field_diff.max_abs_diff,
        field_diff.first,
        field_diff.note,
    )


def _provably_equal(name: str, left: SamplesById, right: SamplesById, ids: list[str]) -> tuple[set[str], str]:
    """The samples whose rows of `name` are equal in both bundles without reading them, and how that was known."""
    if not all(_chunked(s, name) for s in list(left.sources) + list(right.sources)):
        return set(), ""
    equal: set[str] = set()
    by_pair: dict[tuple[int, int], list[str]] = {}
    for sid in ids:
        by_pair.setdefault((left.where[sid][0], right.where[sid][0]), []).append(sid)
    for (ka, kb), members in by_pair.items():
        sa, sb = left.sources[ka], right.sources[kb]
        if sa.manifest.payloads[name].dtype != sb.manifest.payloads[name].dtype:
            continue
        pa = [left.where[sid][1] for sid in members]
        pb = [right.where[sid][1] for sid in members]
        same_rows = [r.sample_id for r in sa.index.samples] == [r.sample_id for r in sb.index.samples] and [
            r.response_length for r in sa.index.samples
        ] == [r.response_length for r in sb.index.samples]
        if same_rows and sa.manifest.payloads[name].digest == sb.manifest.payloads[name].digest:
            equal.update(members)  # the same blob holding the same rows
            continue
        assert isinstance(sa, _Located) and isinstance(sb, _Located)  # every source is `_chunked`
        for sid, x, y in zip(members, sa.row_blocks(name, pa), sb.row_blocks(name, pb)):
            if x == y and x[0] < x[1]:
                equal.add(sid)  # the same byte span, in blocks of equal hashes at the same offsets
    return equal, (f"{len(equal)} of {len(ids)} samples equal by digest, not read" if equal else "")


@runtime_checkable
class _Located(Protocol):
    """A source that locates a payload's rows in the blocks of its blob (a native bundle's reader)."""

    def row_blocks(
        self, name: str, positions: Sequence[int]
    ) -> list[tuple[int, int, tuple[tuple[int, bytes], ...]]]: ...


def _chunked(source: ReplaySource, name: str) -> bool:
    """True for a native source whose payload `name` has a content digest (its rows can be located in chunks)."""
    spec = source.manifest.payloads.get(name)
    return spec is not None and spec.digest is not None and isinstance(source, _Located)


def _expected_fields(left: SamplesById, right: SamplesById, common: list[str], tol) -> list[FieldDiff]:
    out = []
    for stage_name, key in sorted(PER_SAMPLE_EXPECTED):
        va, vb = _per_sample_expected(left, stage_name, key), _per_sample_expected(right, stage_name, key)
        if va is None and vb is None:
            continue
        if va is None or vb is None:
            out.append(
                FieldDiff(
                    f"expected.{stage_name}.{key}",
                    "expected",
                    stage_name,
                    0,
                    1,
                    None,
                    None,
                    "only in A" if vb is None else "only in B",
                )
            )
            continue
        ids = [sid for sid in common if sid in va and sid in vb]
        compared = compare_tensors(
            key,
            torch.tensor([va[s] for s in ids], dtype=torch.float64),
            torch.tensor([vb[s] for s in ids], dtype=torch.float64),
            SampleLayout.per_sample(ids),
            tol(stage_name),
        )
        out.append(_from_comparison(f"expected.{stage_name}.{key}", "expected", stage_name, compared))
    out += _scalar_expected(left, right, tol)
    return out


def _per_sample_expected(side: SamplesById, stage: str, key: str) -> dict[str, float] | None:
    """{sample_id: value} of a per-sample expected list over every source, or None when no source has it."""
    values: dict[str, float] = {}
    found = False
    for source in side.sources:
        listed = (source.expected.get(stage) or {}).get(key)
        if not isinstance(listed, list):
            continue
        found = True
        for r, v in zip(source.index.samples, listed):
            values[r.sample_id] = float(v)
    return values if found else None


def _scalar_expected(left: SamplesById, right: SamplesById, tol) -> list[FieldDiff]:
    """Cohort scalars (loss.policy, loss.value, rollout.mismatch) rank by rank, when the ranks hold the same
    samples in both bundles (a scalar of another cohort is another quantity)."""
    stages = sorted(
        {
            k
            for s in list(left.sources) + list(right.sources)
            for k, v in s.expected.items()
            if isinstance(v, dict) and not any(isinstance(x, list) for x in v.values())
        },
        key=_stage_rank,
    )
    if not stages:
        return []
    cohorts_a = [sorted(r.sample_id for r in s.index.samples) for s in left.sources]
    cohorts_b = [sorted(r.sample_id for r in s.index.samples) for s in right.sources]
    out = []
    for stage in stages:
        if cohorts_a != cohorts_b:
            out.append(
                FieldDiff(
                    f"expected.{stage}",
                    "expected",
                    stage,
                    0,
                    0,
                    None,
                    None,
                    "not compared: the ranks hold different samples in A and B",
                )
            )
            continue
        names = sorted({k for s in list(left.sources) + list(right.sources) for k in (s.expected.get(stage) or {})})
        for name in names:
            xs = [(s.expected.get(stage) or {}).get(name) for s in left.sources]
            ys = [(s.expected.get(stage) or {}).get(name) for s in right.sources]
            if any(x is None for x in xs) or any(y is None for y in ys):
                out.append(
                    FieldDiff(
                        f"expected.{stage}.{name}",
                        "expected",
                        stage,
                        len(xs),
                        int(xs != ys),
                        None,
                        None,
                        "missing on one side",
                    )
                )
                continue
            ranks = [str(s.rank) for s in left.sources]
            compared = compare_tensors(
                name,
                torch.tensor(xs, dtype=torch.float64),
                torch.tensor(ys, dtype=torch.float64),
                SampleLayout.per_sample([f"rank {r}" for r in ranks]),
                tol(stage),
            )
            out.append(_from_comparison(f"expected.{stage}.{name}", "expected", stage, compared))
    return out


_OTHER_COLUMNS = len("* ") + 20 + 1 + 1 + 9 + 1 + 7 + 1 + 11
"""The width of a diff row without its field column."""


def _bytes_fetched(sources: Sequence[ReplaySource]) -> int | None:
    """Bytes read from the stores of native sources (each store counted once); None without one."""
    seen: dict[int, Any] = {}
    for s in sources:
        store = getattr(s, "store", None)
        if store is not None:
            seen[id(store.backend)] = store.backend
    return sum(b.stats.bytes_read for b in seen.values()) if seen else None


__all__ = ["CONFIG", "DiffReport", "FieldDiff", "diff_bundles"]
