"""One self-contained HTML file of a replay (or a chain, or a diff) that people can look at.

The page holds the verdict and the chain, the stage table, a per-sample error heatmap for each failed stage, and,
for the first divergent sample, its expected and actual values per token with the divergent tokens marked; the
rollout.mismatch metrics and worst tokens when the bundle has them. Plots are plotly figures; plotly.js is inlined,
so the file opens with no network access. plotly is the optional extra `trajectory-replay[report]`.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Optional

from trajectory_replay.errors import UsageError

HEATMAP_COLUMNS = 64
"""Samples per heatmap row: 2,048 samples make a 32 x 64 grid."""


def _plotly():
    try:
        import plotly.graph_objects as go
        import plotly.io as pio
    except ImportError:
        raise UsageError("--html needs plotly, the report extra: pip install 'trajectory-replay[report]'") from None
    return go, pio


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
.note{color:#4b5563;font-size:13px} code{font-size:12px}
"""


class _Page:
    """Sections of HTML and the figures they embed (plotly.js once, in the first figure)."""

    def __init__(self, title: str) -> None:
        self.go, self.pio = _plotly()
        self.title = title
        self.parts: list[str] = []
        self.figures = 0

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def figure(self, fig) -> None:
        fig.update_layout(margin=dict(l=60, r=20, t=40, b=40), template="plotly_white")
        self.parts.append(self.pio.to_html(fig, full_html=False, include_plotlyjs="inline" if self.figures == 0
                                           else False, div_id=f"plot-{self.figures}",
                                           config={"displaylogo": False, "responsive": True}))
        self.figures += 1

    def write(self, path: str | Path) -> int:
        doc = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_esc(self.title)}</title>"
               f"<style>{CSS}</style></head><body>" + "\n".join(self.parts) + "</body></html>")
        data = doc.encode("utf-8")
        Path(path).write_bytes(data)
        return len(data)


def _stage_table(page: _Page, report) -> None:
    rows = ["<table><tr><th>stage</th><th>rank</th><th>status</th><th>max abs error</th><th>mismatches</th>"
            "<th>message</th></tr>"]
    for s in report.stages:
        rows.append(f"<tr><td>{_esc(s.stage)}</td><td>{_esc(s.rank)}</td><td class='{s.status}'>{s.status}</td>"
                    f"<td class='num'>{_number(s.max_abs_error)}</td><td class='num'>{s.mismatch_count}</td>"
                    f"<td>{_esc(s.message)}</td></tr>")
    rows.append("</table>")
    page.add("".join(rows))


def _heatmap(page: _Page, stage: str, name: str, errors: dict[str, float]) -> None:
    """Each sample's largest error, on a grid of HEATMAP_COLUMNS samples per row (log10; NaN: non-finite)."""
    ids = list(errors)
    cols = min(HEATMAP_COLUMNS, max(len(ids), 1))
    rows = math.ceil(len(ids) / cols)
    z: list[list[Optional[float]]] = [[None] * cols for _ in range(rows)]
    text: list[list[str]] = [[""] * cols for _ in range(rows)]
    for k, sid in enumerate(ids):
        value = errors[sid]
        r, c = divmod(k, cols)
        z[r][c] = math.log10(value) if value and value > 0 and math.isfinite(value) else (
            None if value != value else -12.0)
        text[r][c] = f"{sid}: {'not finite' if value != value else f'{value:.6g}'}"
    fig = page.go.Figure(page.go.Heatmap(z=z, text=text, hoverinfo="text", colorscale="Reds",
                                         colorbar=dict(title="log10 |err|")))
    fig.update_layout(title=f"{stage}: {name}, largest error per sample ({len(ids)} samples, "
                            f"{cols} per row, in cohort order)", height=120 + 18 * rows,
                      yaxis=dict(autorange="reversed", title="row"), xaxis=dict(title="column"))
    page.figure(fig)


def _token_plot(page: _Page, stage: str, name: str, first: dict[str, Any]) -> None:
    """Expected and actual values of the first divergent sample, per token, divergent tokens marked."""
    go = page.go
    expected, actual, bad = first["expected"], first["actual"], first["divergent"]
    xs = list(range(len(expected)))
    fig = go.Figure([go.Scatter(x=xs, y=expected, mode="lines+markers", name="expected"),
                     go.Scatter(x=xs, y=actual, mode="lines+markers", name="actual"),
                     go.Scatter(x=bad, y=[actual[i] for i in bad], mode="markers", name="divergent",
                                marker=dict(symbol="x", size=11, color="#c81e1e"))])
    fig.update_layout(title=f"{stage}: {name} of {first['sample_id']}, the first divergent sample",
                      xaxis_title="token offset" if len(expected) > 1 else "", yaxis_title=name, height=360)
    page.figure(fig)


def _mismatch(page: _Page, stage) -> None:
    metrics = {k: v for k, v in stage.metrics.items() if not isinstance(v, list)}
    worst = stage.metrics.get("worst_tokens") or []
    page.add("<h3>training–inference mismatch</h3><table><tr>" + "".join(f"<th>{_esc(k)}</th>" for k in metrics)
             + "</tr><tr>" + "".join(f"<td class='num'>{_number(v)}</td>" for v in metrics.values()) + "</tr></table>")
    if worst:
        head = "".join(f"<th>{_esc(k)}</th>" for k in worst[0])
        body = "".join("<tr>" + "".join(f"<td>{_number(v)}</td>" for v in row.values()) + "</tr>" for row in worst)
        page.add(f"<table><tr>{head}</tr>{body}</table>")


def _bundle_sections(page: _Page, report, heading: str) -> None:
    """A bundle's stage table, mismatch metrics and the plots of its failed stages."""
    page.add(f"<h2>{_esc(heading)}</h2>")
    if report.overrides:
        page.add("<p class='note'>config overridden: " + _esc(", ".join(f"{k}={json.dumps(v)}" for k, v in
                                                                       report.overrides.items())) + "</p>")
    _stage_table(page, report)
    for s in report.stages:
        if s.stage == "rollout.mismatch" and s.metrics:
            _mismatch(page, s)
    failed = [s for s in report.stages if s.failed]
    for s in failed:
        for name, evidence in s.evidence.items():
            _heatmap(page, s.label, name, evidence["sample_errors"])
        if not s.evidence:
            page.add(f"<p class='note'>{_esc(s.label)}: nothing to plot (no per-sample values compared)</p>")
    # the first divergent sample token by token: the first failed field with tokens (a per-sample field such as
    # the rewards has one value per sample, which its heatmap already shows)
    per_token = [(s, name, e["first_sample"]) for s in failed for name, e in s.evidence.items()
                 if len(e["first_sample"]["expected"]) > 1]
    if per_token:
        s, name, first = per_token[0]
        _token_plot(page, s.label, name, first)


def _verdict(page: _Page, passed: bool, text: str) -> None:
    page.add(f"<div class='verdict {'pass' if passed else 'fail'}'>{_esc(text)}</div>")


def write_replay_html(report, path: str | Path) -> int:
    """The HTML page of a ReplayReport or a ChainReport at `path`; its size in bytes."""
    from trajectory_replay.replay.chain import ChainReport

    if isinstance(report, ChainReport):
        page = _Page(f"replay {report.step.bundle}")
        page.add(f"<h1>trajectory-replay: {_esc(report.step.bundle)} with the rollouts that produced it</h1>")
        first = report.first_divergence
        _verdict(page, report.passed, "no divergence" if first is None else "first divergence: " + ", ".join(
            f"{k} {v}" for k, v in first.items() if v is not None))
        page.add("<p class='note'>chain: " + " → ".join(_esc(e.bundle) for e in report.upstream)
                 + (" → " if report.upstream else "") + _esc(report.step.bundle) + "</p>")
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
    _verdict(page, report.passed, f"first divergent stage: {report.first_divergent_stage or 'none'}")
    _bundle_sections(page, report, "stages")
    return page.write(path)


def write_diff_html(report, path: str | Path) -> int:
    """The HTML page of a DiffReport: the verdict, the field table, and a bar chart of the fields that differ."""
    page = _Page(f"diff {report.a} {report.b}")
    page.add(f"<h1>trajectory-replay diff</h1><p class='note'>A: <code>{_esc(report.a)}</code><br>"
             f"B: <code>{_esc(report.b)}</code><br>{report.samples} samples matched by id</p>")
    first = report.first
    _verdict(page, report.identical, "identical" if first is None else f"first difference at {first.stage}: "
             f"{first.name}" + ("" if first.first is None else " " + ", ".join(
                 f"{k} {v}" for k, v in first.first.items() if v is not None)))
    for note in report.notes:
        page.add(f"<p class='note'>{_esc(note)}</p>")
    fields = sorted(report.fields, key=lambda f: f.stage != "config")
    rows = ["<table><tr><th>stage</th><th>field</th><th>compared</th><th>differ</th><th>max |a−b|</th>"
            "<th>note</th></tr>"]
    for f in fields:
        cls = "fail" if f.differs else ""
        rows.append(f"<tr class='{cls}'><td>{_esc(f.stage)}</td><td>{_esc(f.name)}</td>"
                    f"<td class='num'>{f.compared}</td><td class='num'>{f.differing}</td>"
                    f"<td class='num'>{_number(f.max_abs_diff)}</td><td>{_esc(f.note)}</td></tr>")
    rows.append("</table>")
    page.add("<h2>fields</h2>" + "".join(rows))
    differing = report.differences
    if differing:
        go = page.go
        fig = go.Figure(go.Bar(x=[f.differing / max(f.compared, 1) for f in differing],
                               y=[f"{f.stage} · {f.name}" for f in differing], orientation="h",
                               text=[f"{f.differing} of {f.compared}" for f in differing]))
        fig.update_layout(title="share of values that differ, per field", xaxis=dict(title="share", range=[0, 1]),
                          yaxis=dict(autorange="reversed"), height=160 + 30 * len(differing))
        page.figure(fig)
    return page.write(path)


SCAN_COLOURS = {"pass": "#2e9e4f", "diverged": "#d62728", "invalid": "#8c2d9c", "incomplete": "#f0a202",
                "unsupported": "#7f7f7f", "error": "#1d2330"}
"""Colour of each scan verdict in the timeline."""


def write_scan_html(report, path: str | Path) -> int:
    """The HTML page of a ScanReport: counts, the earliest divergence, incomplete bundles, the verdict timeline
    (x: bundles in anchor order, colour: verdict) and the per-bundle table; its size in bytes."""
    page = _Page(f"scan {report.root}")
    page.add(f"<h1>trajectory-replay scan</h1><p class='note'><code>{_esc(report.root)}</code>: "
             f"{len(report.verdicts)} bundles, {report.replayed} replayed, {report.cached} from stored verdicts "
             f"({_esc(report.engine)} engine, {report.workers} worker(s), replay {_esc(report.replay_version)})</p>")
    first = report.earliest_divergence
    where = "" if first is None else ", ".join(x for x in (
        f"sample {first.sample_id}" if first.sample_id else "", f"field {first.field}" if first.field else "",
        f"token {first.token_offset}" if first.token_offset is not None else "",
        f"rank {first.rank}" if first.rank is not None else "") if x)
    _verdict(page, report.passed, "every bundle passes" if report.passed else (
        "earliest divergence: none" if first is None else
        f"earliest divergence: {first.name} ({first.anchor or 'no anchor'}) at {first.first_divergent_stage}"
        + (f": {where}" if where else "")))
    counts = report.counts
    page.add("<h2>counts</h2><table><tr>" + "".join(f"<th>{_esc(k)}</th>" for k in counts) + "</tr><tr>"
             + "".join(f"<td class='num'>{v}</td>" for v in counts.values()) + "</tr></table>")
    if report.incomplete:
        page.add("<h2>incomplete bundles</h2><table><tr><th>bundle</th><th>anchor</th><th>missing ranks</th>"
                 "<th>expected ranks</th><th>detail</th></tr>" + "".join(
                     f"<tr><td>{_esc(v.name)}</td><td>{_esc(v.anchor)}</td><td>{_esc(v.missing_ranks)}</td>"
                     f"<td>{_esc(v.expected_ranks)}</td><td>{_esc(v.detail)}</td></tr>" for v in report.incomplete)
                 + "</table>")
    if report.verdicts:
        go = page.go
        labels = [f"{v.anchor or '-'} · {v.name}" for v in report.verdicts]
        traces = []
        for status, colour in SCAN_COLOURS.items():
            at = [i for i, v in enumerate(report.verdicts) if v.status == status]
            if not at:
                continue
            traces.append(go.Scatter(
                x=[labels[i] for i in at], y=[status] * len(at), mode="markers", name=status,
                marker=dict(color=colour, size=11, symbol="square"),
                text=[f"{report.verdicts[i].name} ({report.verdicts[i].anchor or 'no anchor'}): {status}"
                      + (f" at {report.verdicts[i].first_divergent_stage}"
                         if report.verdicts[i].first_divergent_stage else "") for i in at], hoverinfo="text"))
        fig = go.Figure(traces)
        fig.update_layout(title="verdict per bundle, in anchor order (rollout, step)", height=320,
                          xaxis=dict(title="step (anchor order)", type="category", categoryorder="array",
                                     categoryarray=labels, showticklabels=len(labels) <= 60),
                          yaxis=dict(title="verdict", type="category", categoryorder="array",
                                     categoryarray=list(SCAN_COLOURS)))
        page.figure(fig)
    rows = ["<h2>bundles</h2><table><tr><th>bundle</th><th>anchor</th><th>verdict</th><th>first divergent stage</th>"
            "<th>sample</th><th>field</th><th>from</th><th>detail</th></tr>"]
    for v in report.verdicts:
        cls = "pass" if v.status == "pass" else "fail"
        rows.append(f"<tr><td>{_esc(v.name)}</td><td>{_esc(v.anchor)}</td><td class='{cls}'>{_esc(v.status)}</td>"
                    f"<td>{_esc(v.first_divergent_stage)}</td><td>{_esc(v.sample_id)}</td><td>{_esc(v.field)}</td>"
                    f"<td>{'stored verdict' if v.cached else 'replayed'}</td><td>{_esc(v.detail)}</td></tr>")
    rows.append("</table>")
    page.add("".join(rows))
    return page.write(path)


__all__ = ["write_diff_html", "write_replay_html", "write_scan_html"]
