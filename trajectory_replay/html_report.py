"""One self-contained HTML file of a replay (or a chain, a diff, a scan) that people can look at.

A replay page answers what the terminal report answers, first: the bundle (id, anchor, where it is stored, the
recompute config), then the first divergent stage with its expected and actual values per sample (and per token)
as a table and a plot, then the stage table, the rollout.mismatch metrics of each rank, a heatmap of each sample's
largest error for every failed stage and field, and each later failed stage's listed divergences.

Plots are inline SVG drawn by `html_plots` (no script, no network, no dependency): plotly.js inlined costs 4.8 MB
per page, and the installed plotly ships no partial bundle. What a page holds is bounded, so a page stays under
PAGE_LIMIT for any bundle: heatmaps show at most HEATMAP_CELLS cells (a cell then holds consecutive samples), long
tables keep their failed rows first, and a plot that would pass the limit is left out; the page says so each time.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trajectory_replay import html_plots as plots
from trajectory_replay.backends import redact_url
from trajectory_replay.outcome import Status

PAGE_LIMIT = 1_500_000
"""Bytes a page may take."""
HEATMAP_COLUMNS = 64
"""Samples per heatmap row: 2,048 samples make a 32 x 64 grid."""
HEATMAP_CELLS = 2048
"""Cells per heatmap; more samples share cells."""
TABLE_ROWS = 400
"""Rows per long table (stages of many ranks, a scan's bundles)."""


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _number(value: Any) -> str:
    from trajectory_replay.replay.report import format_number

    return format_number(value) if isinstance(value, float) else _esc(value)


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d2330;max-width:1280px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px} h3{font-size:15px;margin:18px 0 6px}
.verdict{padding:10px 14px;border-radius:6px;margin:12px 0;font-weight:600}
.pass{background:#e6f4ea;color:#1e6b34} .fail{background:#fde8e8;color:#9b1c1c} .skipped{color:#6b7280}
table{border-collapse:collapse;font-size:13px;margin:6px 0} td,th{border:1px solid #d7dbe3;padding:4px 8px;
text-align:left;vertical-align:top} th{background:#f3f5f9} td.num{text-align:right;font-variant-numeric:tabular-nums}
table.identity th{width:120px} td.changed{background:#fff4d6} td.wrap{overflow-wrap:anywhere;min-width:240px}
.note{color:#4b5563;font-size:13px} code{font-size:12px}
figure{margin:14px 0} figcaption{font-size:14px;font-weight:600;margin:0 0 4px}
svg.plot{display:block;font-size:11px;fill:#1d2330} svg.plot .grid{stroke:#eceff4} svg.plot .axis,svg.plot .tick
{stroke:#6b7280} svg.plot .title{font-size:12px;fill:#4b5563} svg.plot .hover{fill:transparent}
svg.plot .hover:hover{fill:rgba(31,111,180,.08)}
"""


class _Page:
    """Sections of HTML and the plots among them, written out under PAGE_LIMIT: plots are placed in order while
    they fit beside all the text; text past the limit (only a page of very many failed ranks has so much) is
    cut, and the page says where."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str | tuple[str, str, str]] = []

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def figure(self, caption: str, svg: str, note: str = "") -> None:
        self.parts.append((caption, svg, note))

    def write(self, path: str | Path) -> int:
        head = (
            f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_esc(self.title)}</title>"
            f"<style>{CSS}</style></head><body>"
        )
        tail = "</body></html>"
        room = PAGE_LIMIT - _size(head) - _size(tail) - 1_024  # 1 kB kept for the note of a cut
        figures = [_figure(0, *part[:1], "", *part[2:]) for part in self.parts if not isinstance(part, str)]
        plot_room = (
            room - sum(_size(p) + 1 for p in self.parts if isinstance(p, str)) - sum(_size(f) + 1 for f in figures)
        )
        out, used, count = [head], 0, 0
        for part in self.parts:
            if not isinstance(part, str):
                caption, svg, note = part
                count += 1
                fits = _size(svg) <= plot_room
                plot_room -= _size(svg) if fits else 0
                part = _figure(
                    count,
                    caption,
                    svg
                    if fits
                    else (
                        f"<p class='note'>plot left out: it would take this page past {PAGE_LIMIT / 1e6:g} MB (the "
                        "tables and --json say the same)</p>"
                    ),
                    note,
                )
            if used + _size(part) + 1 > room:
                out.append(
                    f"<p class='note'>the rest of this report is left out: it would take this page past "
                    f"{PAGE_LIMIT / 1e6:g} MB (--json has everything)</p>"
                )
                break
            out.append(part)
            used += _size(part) + 1
        data = ("\n".join(out) + tail).encode("utf-8")
        Path(path).write_bytes(data)
        return len(data)


def _size(markup: str) -> int:
    return len(markup.encode("utf-8"))


def _figure(number: int, caption: str, content: str, note: str) -> str:
    return (
        f"<figure id='plot-{number}'><figcaption>{_esc(caption)}</figcaption>{content}"
        + (f"<p class='note'>{_esc(note)}</p>" if note else "")
        + "</figure>"
    )


def _table(head: Sequence[str], rows: Sequence[str], note: str = "") -> str:
    """A table of ready-made `<tr>` rows under `head`, with a note below when some rows were left out."""
    return (
        "<table><tr>"
        + "".join(f"<th>{_esc(h)}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table>"
        + (f"<p class='note'>{_esc(note)}</p>" if note else "")
    )


def _bounded(items: Sequence[Any], keep: Callable[[Any], bool], what: str) -> tuple[list[Any], str]:
    """At most TABLE_ROWS of `items`, in their order: those `keep` picks first, then the others; and a note
    saying how many were left out."""
    if len(items) <= TABLE_ROWS:
        return list(items), ""
    chosen = {id(x) for x in [x for x in items if keep(x)][:TABLE_ROWS]}
    for x in items:
        if len(chosen) >= TABLE_ROWS:
            break
        chosen.add(id(x))
    shown = [x for x in items if id(x) in chosen]
    return shown, f"{len(items) - len(shown)} of {len(items)} {what} not listed here (--json lists every one)"


# ---- a replay page ------------------------------------------------------------------------------------


def _identity(page: _Page, sources: Sequence[Any], overrides: dict[str, Any]) -> None:
    """The bundle: id, anchor, where it is stored (no credentials), ranks, samples, and its recompute config
    (fields replayed with another value marked)."""
    from trajectory_replay.bundle.anchor import Anchor

    first = sources[0]
    anchor = Anchor.of(first.index.identity)
    ranks = sorted(s.rank for s in sources if s.rank is not None)
    rows = [
        ("bundle", first.bundle_id),
        ("anchor", f"{anchor}  ({anchor.flag})"),
        ("stored at", redact_url(str(getattr(first, "label", "") or ""))),
    ]
    if ranks:
        rows.append(("ranks", ", ".join(map(str, ranks))))
    rows.append(("samples", str(sum(len(s.index.samples) for s in sources))))
    page.add(
        "<table class='identity'>"
        + "".join(f"<tr><th>{_esc(k)}</th><td><code>{_esc(v)}</code></td></tr>" for k, v in rows)
        + "</table>"
    )
    config = first.index.config
    fields = config.model_dump()
    cells = []
    for name, value in fields.items():
        if name in overrides:
            cells.append(
                f"<td class='changed'><code>{_esc(name)}</code></td><td class='changed'>"
                f"<code>{_esc(json.dumps(value))} → {_esc(json.dumps(overrides[name]))}</code></td>"
            )
        else:
            cells.append(f"<td><code>{_esc(name)}</code></td><td><code>{_esc(json.dumps(value))}</code></td>")
    per_row = 3
    body = "".join("<tr>" + "".join(cells[k : k + per_row]) + "</tr>" for k in range(0, len(cells), per_row))
    profile = getattr(config, "profile", None)
    page.add(
        "<h3>recompute config"
        + (f" (profile {_esc(profile)})" if profile else "")
        + "</h3>"
        + (
            f"<p class='note'>replayed with {len(overrides)} field(s) changed (marked): recorded → replayed</p>"
            if overrides
            else ""
        )
        + f"<table>{body}</table>"
    )


def _divergence_table(stage) -> str:
    rows = [
        f"<tr><td>{_esc(d.field)}</td><td>{_esc(d.sample_id)}</td><td class='num'>{_esc(d.token_offset)}</td>"
        f"<td class='num'>{_number(d.expected)}</td><td class='num'>{_number(d.actual)}</td>"
        f"<td class='num'>{_number(d.abs_error)}</td></tr>"
        for d in stage.divergences
    ]
    more = stage.mismatch_count - len(stage.divergences)
    return _table(
        ("field", "sample", "token", "expected", "actual", "|error|"),
        rows,
        f"the first {len(stage.divergences)} of {stage.mismatch_count} mismatches" if more > 0 else "",
    )


def _first_divergence(page: _Page, stage) -> None:
    """The first failed stage: its message, its listed divergences (sample ids, tokens, expected, actual) as a
    table and a plot, and its first divergent sample token by token when its values are per token."""
    page.add(f"<h2>first divergent stage: {_esc(stage.label)}</h2><p>{_esc(stage.message)}</p>")
    if stage.divergences:
        page.add(_divergence_table(stage))
        field = stage.divergences[0].field
        shown = [d for d in stage.divergences if d.field == field or d.sample_id is None]
        labels = [
            d.field
            if d.sample_id is None
            else d.sample_id
            if d.token_offset is None
            else f"{d.sample_id} token {d.token_offset}"
            for d in shown
        ]
        per = (
            "per field"
            if all(d.sample_id is None for d in shown)
            else "per sample"
            if all(d.token_offset is None for d in shown)
            else "per sample and token"
        )
        page.figure(
            f"{stage.label}: {field}, expected and actual {per}",
            plots.paired_chart(labels, [d.expected for d in shown], [d.actual for d in shown], field),
            ""
            if len(shown) == stage.mismatch_count
            else f"the {len(shown)} mismatches listed above; the heatmap below shows every sample",
        )
    _first_sample(page, stage)


def _first_sample(page: _Page, stage) -> None:
    """The stage's first divergent sample token by token, for its first failed field with values per token (a
    per-sample field such as the rewards has one value per sample, which its table and heatmap show)."""
    from trajectory_replay.replay.compare import MAX_EVIDENCE_TOKENS

    for name, evidence in stage.evidence.items():
        first = evidence["first_sample"]
        if len(first["expected"]) > 1:
            page.figure(
                f"{stage.label}: {name} of {first['sample_id']}, its first divergent sample, per token",
                plots.token_chart(first["expected"], first["actual"], first["divergent"], name, first["sample_id"]),
                f"{len(first['divergent'])} divergent token(s) marked"
                + (
                    f"; its first {len(first['expected'])} tokens shown"
                    if len(first["expected"]) >= MAX_EVIDENCE_TOKENS
                    else ""
                ),
            )
            return


def _stage_table(page: _Page, report) -> None:
    stages, note = _bounded(report.stages, lambda s: s.failed, "stage entries")
    rows = [
        f"<tr><td>{_esc(s.stage)}</td><td>{_esc(s.rank)}</td><td class='{s.status}'>{s.status}</td>"
        f"<td class='num'>{_number(s.max_abs_error)}</td><td class='num'>{s.mismatch_count}</td>"
        f"<td class='wrap'>{_esc(s.message)}</td></tr>"
        for s in stages
    ]
    page.add(_table(("stage", "rank", "status", "max abs error", "mismatches", "message"), rows, note))


def _heatmap(page: _Page, stage: str, name: str, errors: dict[str, float]) -> None:
    """Each sample's largest error, HEATMAP_COLUMNS samples per row in cohort order."""
    svg, per_cell = plots.heatmap(list(errors), list(errors.values()), HEATMAP_COLUMNS, HEATMAP_CELLS)
    row = f"{min(HEATMAP_COLUMNS, len(errors))} per row" if per_cell == 1 else f"{HEATMAP_COLUMNS} cells per row"
    page.figure(
        f"{stage}: {name}, largest error per sample ({len(errors)} samples in cohort order, {row})",
        svg,
        "each row is named by its first sample; hover a cell for its sample and error"
        + (
            f"; each cell holds {per_cell} consecutive samples and shows the largest of their errors "
            f"(at most {HEATMAP_CELLS} cells are drawn)"
            if per_cell > 1
            else ""
        ),
    )


def _mismatch(page: _Page, stage) -> None:
    metrics = {k: v for k, v in stage.metrics.items() if not isinstance(v, list)}
    worst = stage.metrics.get("worst_tokens") or []
    page.add(
        f"<h3>training–inference mismatch: {_esc(stage.label)}</h3>"
        + _table(
            list(metrics), ["<tr>" + "".join(f"<td class='num'>{_number(v)}</td>" for v in metrics.values()) + "</tr>"]
        )
    )
    if worst:
        page.add(
            "<p class='note'>worst tokens</p>"
            + _table(
                list(worst[0]),
                ["<tr>" + "".join(f"<td>{_number(v)}</td>" for v in row.values()) + "</tr>" for row in worst],
            )
        )


def _bundle_sections(page: _Page, report, heading: str | None = None) -> None:
    """A bundle's first divergent stage, stage table, mismatch metrics, and its failed stages (under `heading`:
    one bundle of a chain)."""
    if heading:
        page.add(f"<h2>{_esc(heading)}</h2>")
    if report.overrides:
        page.add(
            "<p class='note'>config overridden: "
            + _esc(", ".join(f"{k}={json.dumps(v)}" for k, v in report.overrides.items()))
            + "</p>"
        )
    failed = [s for s in report.stages if s.failed]
    if failed:
        _first_divergence(page, failed[0])
    page.add("<h2>stages</h2>")
    _stage_table(page, report)
    for s in report.stages:
        if s.stage == "rollout.mismatch" and s.metrics:
            _mismatch(page, s)
    for s in failed:
        page.add(f"<h3>failed: {_esc(s.label)}</h3><p class='note'>{_esc(s.message)}</p>")
        if s is not failed[0] and s.divergences:
            page.add(_divergence_table(s))
        for name, evidence in s.evidence.items():
            _heatmap(page, s.label, name, evidence["sample_errors"])
        if s is not failed[0]:
            _first_sample(page, s)


def _verdict(page: _Page, passed: bool, text: str) -> None:
    page.add(f"<div class='verdict {'pass' if passed else 'fail'}'>{_esc(text)}</div>")


def _unchecked(report) -> str | None:
    """The verdict line of a replay that compared nothing (why), or None."""
    reason = report.unsupported_reason
    return None if reason is None else f"unsupported: nothing compared ({reason})"


def write_replay_html(report, path: str | Path, sources: Sequence[Any] | None = None) -> int:
    """The HTML page of a ReplayReport or a ChainReport at `path`; its size in bytes. `sources`: the replayed
    bundle's (the chain's step bundle's) sources, whose identity and config the page shows first."""
    from trajectory_replay.replay.chain import ChainReport

    if isinstance(report, ChainReport):
        page = _Page(f"replay {report.step.bundle}")
        page.add(f"<h1>trajectory-replay: {_esc(report.step.bundle)} with the rollouts that produced it</h1>")
        first = report.first_divergence
        _verdict(
            page,
            report.passed,
            _unchecked(report)
            or (
                "no divergence"
                if first is None
                else "first divergence: " + ", ".join(f"{k} {v}" for k, v in first.items() if v is not None)
            ),
        )
        if sources:
            _identity(page, sources, {} if report.step.report is None else report.step.report.overrides)
        page.add(
            "<p class='note'>chain: "
            + " → ".join(_esc(e.bundle) for e in report.upstream)
            + (" → " if report.upstream else "")
            + _esc(report.step.bundle)
            + "</p>"
        )
        for note in report.notes:
            page.add(f"<p class='note'>{_esc(note)}</p>")
        for entry in report.upstream:
            if entry.report is None:
                page.add(f"<h2>{_esc(entry.bundle)} (upstream)</h2><p class='note'>{_esc(entry.note)}</p>")
            else:
                _bundle_sections(page, entry.report, f"{entry.bundle} (upstream)")
        if report.link is not None:
            page.add("<h2>link: rollout outputs → step inputs</h2>")
            page.add(f"<p class='{report.link.status}'>{_esc(report.link.message)}</p>")
            for name, evidence in report.link.evidence.items():
                _heatmap(page, "link", name, evidence["sample_errors"])
        if report.step.report is not None:
            _bundle_sections(page, report.step.report, f"{report.step.bundle} (step)")
        return page.write(path)
    page = _Page(f"replay {report.bundle_id}")
    page.add(f"<h1>trajectory-replay: {_esc(report.bundle_id)}</h1>")
    _verdict(
        page, report.passed, _unchecked(report) or f"first divergent stage: {report.first_divergent_stage or 'none'}"
    )
    if sources:
        _identity(page, sources, report.overrides)
    _bundle_sections(page, report)
    return page.write(path)


# ---- a diff page -------------------------------------------------------------------------------------


def write_diff_html(report, path: str | Path) -> int:
    """The HTML page of a DiffReport: the verdict, the field table in stage order, and a bar chart of the
    fields that differ; its size in bytes."""
    a, b = redact_url(report.a), redact_url(report.b)
    page = _Page(f"diff {a} {b}")
    page.add(
        f"<h1>trajectory-replay diff</h1><p class='note'>A: <code>{_esc(a)}</code><br>"
        f"B: <code>{_esc(b)}</code><br>{report.samples} samples matched by id</p>"
    )
    first = report.first
    _verdict(
        page,
        report.identical,
        "identical"
        if first is None
        else f"first difference at {first.stage}: "
        f"{first.name}"
        + (
            ""
            if first.first is None
            else " " + ", ".join(f"{k} {_number(v)}" for k, v in first.first.items() if v is not None)
        ),
    )
    for note in report.notes:
        page.add(f"<p class='note'>{_esc(note)}</p>")
    fields, note = _bounded(report.fields_in_stage_order, lambda f: f.differs, "fields")
    rows = [
        f"<tr class='{'fail' if f.differs else ''}'><td>{_esc(f.stage)}</td><td>{_esc(f.name)}</td>"
        f"<td class='num'>{f.compared}</td><td class='num'>{f.differing}</td>"
        f"<td class='num'>{_number(f.max_abs_diff)}</td><td class='wrap'>{_esc(f.note)}</td></tr>"
        for f in fields
    ]
    page.add(
        "<h2>fields, in stage order</h2>"
        + _table(("stage", "field", "compared", "differ", "max |a−b|", "note"), rows, note)
    )
    differing = report.differences[:TABLE_ROWS]
    if differing:
        page.figure(
            "share of values that differ, per field",
            plots.bar_chart(
                [f"{f.stage} · {f.name}" for f in differing],
                [f.differing / max(f.compared, 1) for f in differing],
                [f"{f.differing} of {f.compared}" for f in differing],
            ),
        )
    return page.write(path)


# ---- a scan page -------------------------------------------------------------------------------------

SCAN_COLOURS = {
    Status.PASS: "#2e9e4f",
    Status.DIVERGED: "#d62728",
    Status.INVALID: "#8c2d9c",
    Status.INCOMPLETE: "#f0a202",
    Status.UNSUPPORTED: "#7f7f7f",
    "error": "#1d2330",
}
"""Colour of each scan verdict in the timeline (`error`: a bundle the scan could not judge)."""
TIMELINE_COLUMNS = 1000
"""Columns of the verdict timeline; more bundles share columns."""


def write_scan_html(report, path: str | Path) -> int:
    """The HTML page of a ScanReport: counts, the earliest divergence, incomplete bundles, the verdict timeline
    (x: bundles in anchor order, colour: verdict) and the per-bundle table; its size in bytes."""
    root = redact_url(report.root)
    page = _Page(f"scan {root}")
    page.add(
        f"<h1>trajectory-replay scan</h1><p class='note'><code>{_esc(root)}</code>: "
        f"{len(report.verdicts)} bundles, {report.replayed} replayed, {report.cached} from stored verdicts "
        f"({_esc(report.engine)} engine, {report.workers} worker(s), replay {_esc(report.replay_version)})</p>"
    )
    first = report.earliest_divergence
    where = "" if first is None else first.place
    _verdict(
        page,
        report.passed,
        "every bundle passes"
        if report.passed
        else (
            "earliest divergence: none"
            if first is None
            else f"earliest divergence: {first.name} ({first.anchor or 'no anchor'}) at {first.first_divergent_stage}"
            + (f": {where}" if where else "")
        ),
    )
    counts = report.counts
    page.add(
        "<h2>counts</h2>"
        + _table(list(counts), ["<tr>" + "".join(f"<td class='num'>{v}</td>" for v in counts.values()) + "</tr>"])
    )
    if report.incomplete:
        incomplete, note = _bounded(report.incomplete, lambda v: True, "incomplete bundles")
        page.add(
            "<h2>incomplete bundles</h2>"
            + _table(
                ("bundle", "anchor", "missing ranks", "expected ranks", "detail"),
                [
                    f"<tr><td>{_esc(v.name)}</td><td>{_esc(v.anchor)}</td><td>{_esc(v.missing_ranks)}</td>"
                    f"<td>{_esc(v.expected_ranks)}</td><td class='wrap'>{_esc(v.detail)}</td></tr>"
                    for v in incomplete
                ],
                note,
            )
        )
    if report.verdicts:
        verdicts = report.verdicts
        svg, per_column = plots.strip_chart(
            [f"{v.anchor or '-'} · {v.name}" for v in verdicts],
            [v.status for v in verdicts],
            SCAN_COLOURS,
            TIMELINE_COLUMNS,
            [
                f"{v.name} ({v.anchor or 'no anchor'}): {v.status}"
                + (f" at {v.first_divergent_stage}" if v.first_divergent_stage else "")
                for v in verdicts
            ],
        )
        page.figure(
            "verdict per bundle, in anchor order (rollout, step)",
            svg,
            "hover a square for its bundle"
            if per_column == 1
            else f"each column holds {per_column} consecutive bundles and marks every verdict among them",
        )
    verdicts, note = _bounded(report.verdicts, lambda v: v.status != Status.PASS, "bundles")
    rows = [
        f"<tr><td>{_esc(v.name)}</td><td>{_esc(v.anchor)}</td>"
        f"<td class='{'pass' if v.status == Status.PASS else 'fail'}'>{_esc(v.status)}</td>"
        f"<td>{_esc(v.first_divergent_stage)}</td><td>{_esc(v.sample_id)}</td><td>{_esc(v.field)}</td>"
        f"<td>{'stored verdict' if v.cached else 'replayed'}</td><td class='wrap'>{_esc(v.detail)}</td></tr>"
        for v in verdicts
    ]
    page.add(
        "<h2>bundles</h2>"
        + _table(
            ("bundle", "anchor", "verdict", "first divergent stage", "sample", "field", "from", "detail"), rows, note
        )
    )
    return page.write(path)


__all__ = ["PAGE_LIMIT", "write_diff_html", "write_replay_html", "write_scan_html"]
