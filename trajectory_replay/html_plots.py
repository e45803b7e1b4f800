"""Small inline SVG plots for the HTML reports: a per-token line chart, expected-against-actual points per
labelled position, a per-sample heatmap with a colour bar, horizontal bars and a category strip.

Each function returns one `<svg>` element as text, sized by what it draws, with no script: the page renders the
same in any browser, offline, and a plot of N points costs bytes in proportion to N. Hovering an element shows its
SVG `<title>` (a sample id and its value). Index axes (token offsets, positions) get integer ticks only.
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence

WIDTH = 1000
"""Width of every plot, in pixels (the page is at most 1,280 wide)."""

EXPECTED_COLOUR, ACTUAL_COLOUR, DIVERGENT_COLOUR = "#1f6fb4", "#e8710a", "#c81e1e"
REDS = ((255, 245, 240), (252, 187, 161), (251, 106, 74), (203, 24, 29), (103, 0, 13))
"""The error colour scale, from no error to the largest (ColorBrewer Reds)."""
NOT_FINITE_COLOUR = "#9ca3af"

CHAR_WIDTH = 6.2
"""About the width of one character of an 11 px label, to size margins by the labels they hold."""
MAX_LINE_POINTS = 2048
"""Points per line of a line chart; a longer series is drawn from each bucket's extremes."""


def _esc(value: object) -> str:
    return html.escape(str(value))


def _num(value: float) -> str:
    """A coordinate with one decimal at most (SVG text stays small)."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def short(value: float | None) -> str:
    """A value as a tick or hover label: 4 significant digits, 'not finite' for NaN and infinities."""
    if value is None:
        return "n/a"
    if not math.isfinite(value):
        return "not finite" if value != value else ("inf" if value > 0 else "-inf")
    return f"{value:.4g}"


def integer_ticks(lo: int, hi: int, most: int = 10) -> list[int]:
    """At most `most` integers covering [lo, hi] on a 1-2-5 step (an index axis never gets a fractional tick)."""
    span = max(hi - lo, 1)
    step = next(s for s in (m * 10**e for e in itertools.count() for m in (1, 2, 5)) if span / s <= most - 1)
    start = math.ceil(lo / step) * step
    return list(range(start, hi + 1, step))


def value_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Evenly spaced round values covering [lo, hi] for a value axis."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / most
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    start = math.ceil(lo / step) * step
    count = int(math.floor((hi - start) / step + 1e-9)) + 1
    return [round(start + k * step, 12) for k in range(count)]


class _Frame:
    """A plot area inside an SVG of WIDTH x `height`, mapping data to pixels."""

    def __init__(
        self,
        height: int,
        x: tuple[float, float],
        y: tuple[float, float],
        left: int = 80,
        bottom: int = 48,
        top: int = 16,
        right: int = 20,
    ) -> None:
        self.height, self.left, self.right, self.top, self.bottom = height, left, right, top, bottom
        self.x0, self.x1 = x if x[1] > x[0] else (x[0] - 0.5, x[0] + 0.5)
        self.y0, self.y1 = y if y[1] > y[0] else (y[0] - 1, y[0] + 1)

    def px(self, x: float) -> float:
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (WIDTH - self.left - self.right)

    def py(self, y: float) -> float:
        return self.height - self.bottom - (y - self.y0) / (self.y1 - self.y0) * (self.height - self.top - self.bottom)

    def axes(
        self,
        x_ticks: Sequence[tuple[float, str]],
        y_ticks: Sequence[float],
        x_title: str,
        y_title: str,
        rotate_x: bool = False,
        x_class: str = "index",
    ) -> list[str]:
        """Grid lines, tick labels (the x ones of class `x_class`: `index` on an index axis) and axis titles."""
        base, out = self.height - self.bottom, []
        for y in y_ticks:
            out.append(
                f"<line class='grid' x1='{self.left}' x2='{WIDTH - self.right}' y1='{_num(self.py(y))}' "
                f"y2='{_num(self.py(y))}'/><text x='{self.left - 6}' y='{_num(self.py(y) + 4)}' "
                f"text-anchor='end'>{_esc(short(y))}</text>"
            )
        for x, label in x_ticks:
            at = _num(self.px(x))
            text = (
                f"<text class='{x_class}' x='{at}' y='{base + 14}' text-anchor='end' "
                f"transform='rotate(-35 {at} {base + 14})'>"
                if rotate_x
                else f"<text class='{x_class}' x='{at}' y='{base + 16}' text-anchor='middle'>"
            )
            out.append(
                f"<line class='tick' x1='{at}' x2='{at}' y1='{base}' y2='{base + 4}'/>{text}{_esc(label)}</text>"
            )
        out.append(f"<line class='axis' x1='{self.left}' x2='{WIDTH - self.right}' y1='{base}' y2='{base}'/>")
        out.append(
            f"<text class='title' x='{(self.left + WIDTH - self.right) / 2:.0f}' y='{self.height - 6}' "
            f"text-anchor='middle'>{_esc(x_title)}</text>"
        )
        mid = (self.top + base) / 2
        out.append(
            f"<text class='title' x='14' y='{mid:.0f}' text-anchor='middle' "
            f"transform='rotate(-90 14 {mid:.0f})'>{_esc(y_title)}</text>"
        )
        return out


def _svg(height: int, body: Sequence[str], label: str) -> str:
    return (
        f"<svg class='plot' xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
        f"viewBox='0 0 {WIDTH} {height}' role='img' aria-label='{_esc(label)}'>" + "".join(body) + "</svg>"
    )


def _legend(items: Sequence[tuple[str, str]], x: int, y: int) -> list[str]:
    """A row of (colour, name) swatches starting at (x, y)."""
    out = []
    for colour, name in items:
        out.append(
            f"<rect x='{x}' y='{y - 9}' width='12' height='10' fill='{colour}'/>"
            f"<text x='{x + 16}' y='{y}'>{_esc(name)}</text>"
        )
        x += 30 + 7 * len(name)
    return out


def _finite_range(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def _buckets(n: int, most: int) -> list[tuple[int, int]]:
    """[start, end) ranges that split range(n) into at most `most` consecutive buckets."""
    size = max(1, math.ceil(n / most))
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _polyline(frame: _Frame, values: Sequence[float], colour: str) -> str:
    """One line through the finite values (a non-finite value breaks it); a long series is drawn from each
    bucket's smallest and largest value, so a spike stays visible."""
    runs: list[list[str]] = []
    run: list[str] = []
    for start, end in _buckets(len(values), MAX_LINE_POINTS // 2):
        chunk = [(i, values[i]) for i in range(start, end)]
        finite = [(i, v) for i, v in chunk if math.isfinite(v)]
        if len(finite) < len(chunk):
            if run:
                runs.append(run)
            run = []
        if finite:
            pair = sorted({min(finite, key=lambda p: p[1]), max(finite, key=lambda p: p[1])})
            run.extend(f"{_num(frame.px(i))},{_num(frame.py(v))}" for i, v in pair)
    if run:
        runs.append(run)
    return "".join(f"<polyline fill='none' stroke='{colour}' stroke-width='1.6' points='{' '.join(r)}'/>" for r in runs)


def token_chart(
    expected: Sequence[float], actual: Sequence[float], divergent: Sequence[int], y_title: str, sample_id: str
) -> str:
    """Expected and actual values of one sample per token offset; its divergent tokens marked on the axis (and,
    when there are few, with a cross on the actual value)."""
    n = max(len(expected), len(actual), 1)
    lo, hi = _finite_range([*expected, *actual])
    frame = _Frame(360, (-0.5, n - 0.5), (lo, hi), top=30)
    ticks = [(t, str(t)) for t in integer_ticks(0, n - 1)]
    body = frame.axes(ticks, value_ticks(lo, hi), f"token offset in {sample_id}'s response", y_title)
    body.append(_polyline(frame, expected, EXPECTED_COLOUR))
    body.append(_polyline(frame, actual, ACTUAL_COLOUR))
    marked = list(divergent)
    base = frame.height - frame.bottom
    rug = "".join(f"M{_num(frame.px(i))} {base - 1}v-7" for i in marked)  # every divergent token, at the axis
    crosses = (
        "".join(
            f"M{_num(frame.px(i) - 4)} {_num(frame.py(_finite_or(actual, i, hi)) - 4)}l8 8m-8 0l8-8" for i in marked
        )
        if len(marked) <= 64
        else ""
    )  # few: a cross on the actual value too
    if marked:
        body.append(f"<path d='{rug}{crosses}' stroke='{DIVERGENT_COLOUR}' stroke-width='2' fill='none'/>")
    if n <= 64:  # few tokens: each one says its values on hover
        for i in range(n):
            e = expected[i] if i < len(expected) else None
            a = actual[i] if i < len(actual) else None
            body.append(
                f"<rect class='hover' x='{_num(frame.px(i - 0.5))}' y='{frame.top}' "
                f"width='{_num(frame.px(1) - frame.px(0))}' height='{frame.height - frame.top - frame.bottom}'>"
                f"<title>{_esc(sample_id)} token {i}: expected {short(e)}, actual {short(a)}</title></rect>"
            )
    legend = [(EXPECTED_COLOUR, "expected"), (ACTUAL_COLOUR, "actual")]
    if marked:
        legend.append((DIVERGENT_COLOUR, f"divergent ({len(divergent)})"))
    body += _legend(legend, frame.left + 10, 14)
    return _svg(frame.height, body, f"{y_title} of {sample_id} per token")


def paired_chart(
    labels: Sequence[str], expected: Sequence[float | None], actual: Sequence[float | None], y_title: str
) -> str:
    """Expected (a ring) and actual (a dot) values at labelled positions (sample ids, or sample id and token),
    joined by a dashed line; a non-finite value is left out."""
    n = max(len(labels), 1)
    values = [v for v in (*expected, *actual) if v is not None]
    lo, hi = _finite_range(values)
    rotate = n > 8 or max((len(s) for s in labels), default=0) > 12
    frame = _Frame(360 + (40 if rotate else 0), (-0.5, n - 0.5), (lo, hi), top=30, bottom=88 if rotate else 48)
    body = frame.axes(list(enumerate(labels)), value_ticks(lo, hi), "", y_title, rotate_x=rotate, x_class="label")
    for i, label in enumerate(labels):
        e, a = expected[i], actual[i]
        x = frame.px(i)
        points = [
            (v, colour, name)
            for v, colour, name in ((e, EXPECTED_COLOUR, "expected"), (a, ACTUAL_COLOUR, "actual"))
            if v is not None and math.isfinite(v)
        ]
        if e is not None and a is not None and len(points) == 2:
            body.append(
                f"<line x1='{_num(x)}' x2='{_num(x)}' y1='{_num(frame.py(e))}' y2='{_num(frame.py(a))}' "
                f"stroke='{DIVERGENT_COLOUR}' stroke-dasharray='3 2'/>"
            )
        for v, colour, name in points:  # expected a ring around actual's dot: both show where they meet
            paint = (
                f"r='4.5' fill='{colour}'"
                if name == "actual"
                else f"r='7.5' fill='none' stroke='{colour}' stroke-width='2.5'"
            )
            body.append(
                f"<circle cx='{_num(x)}' cy='{_num(frame.py(v))}' {paint}>"
                f"<title>{_esc(label)}: {name} {short(v)}</title></circle>"
            )
    body += _legend([(EXPECTED_COLOUR, "expected"), (ACTUAL_COLOUR, "actual")], frame.left + 10, 14)
    return _svg(frame.height, body, f"{y_title}: expected and actual")


def _finite_or(values: Sequence[float], i: int, default: float) -> float:
    """values[i] where it exists and is finite, else `default`."""
    return values[i] if i < len(values) and math.isfinite(values[i]) else default


def _red(fraction: float) -> str:
    """The colour of `fraction` (0..1) along REDS."""
    f = min(max(fraction, 0.0), 1.0) * (len(REDS) - 1)
    k = min(int(f), len(REDS) - 2)
    t = f - k
    return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(REDS[k], REDS[k + 1]))


def _log_range(values: Sequence[float]) -> tuple[float, float]:
    """The log10 range the colours span: from the smallest positive finite value's decade (at least one decade
    below the largest) up to the largest value, which gets the darkest colour."""
    logs = [math.log10(v) for v in values if math.isfinite(v) and v > 0]
    if not logs:
        return -1.0, 0.0
    hi = max(logs)
    return min(math.floor(min(logs)), hi - 1), hi


def heatmap(ids: Sequence[str], values: Sequence[float], columns: int, max_cells: int) -> tuple[str, int]:
    """(the SVG, samples per cell) of each sample's largest error on a grid of `columns` cells per row, in
    the order given, coloured on a log scale; a cell names its sample(s) on hover, and its id inside where it
    fits. More than `max_cells` samples: each cell holds consecutive samples and shows the largest of them."""
    cells = []  # (first id, last id, value)
    per_cell = max(1, math.ceil(len(ids) / max_cells))
    for start, end in _buckets(len(ids), max_cells) if ids else []:
        chunk = values[start:end]
        bad = [v for v in chunk if not math.isfinite(v)]
        cells.append((ids[start], ids[end - 1], float("nan") if bad else max(chunk)))
    cols = max(1, min(columns, len(cells)))
    rows = math.ceil(len(cells) / cols)
    left, top, bar = 110, 26, 90
    cell_w = min(90.0, (WIDTH - left - bar - 10) / cols)
    cell_h = 34.0 if cell_w >= 40 else max(10.0, min(18.0, cell_w))
    label_inside = per_cell == 1 and cell_w >= 40
    lo, hi = _log_range([v for _, _, v in cells])
    body = []
    for t in integer_ticks(0, cols - 1, 16):  # column numbers on top
        body.append(
            f"<text class='index' x='{_num(left + (t + 0.5) * cell_w)}' y='{top - 8}' text-anchor='middle'>{t}</text>"
        )
    label_every = max(1, math.ceil(14 / cell_h))
    for k, (first, last, value) in enumerate(cells):
        r, c = divmod(k, cols)
        x, y = left + c * cell_w, top + r * cell_h
        if value != value:
            fill = NOT_FINITE_COLOUR
        elif value <= 0:
            fill = _red(0.0)
        else:
            fill = _red((math.log10(value) - lo) / (hi - lo))
        name = first if first == last else f"{first} … {last}"
        body.append(
            f"<rect x='{_num(x)}' y='{_num(y)}' width='{_num(cell_w - 1)}' height='{_num(cell_h - 1)}' "
            f"fill='{fill}'><title>{_esc(name)}: {short(value)}</title></rect>"
        )
        if label_inside:
            dark = value == value and value > 0 and (math.log10(value) - lo) / (hi - lo) > 0.55
            body.append(
                f"<text x='{_num(x + cell_w / 2)}' y='{_num(y + cell_h / 2 + 4)}' text-anchor='middle' "
                f"fill='{'#fff' if dark else '#1d2330'}'>{_esc(first)}</text>"
            )
        if c == 0 and r % label_every == 0:  # each row named by its first sample
            body.append(f"<text x='{left - 6}' y='{_num(y + cell_h / 2 + 4)}' text-anchor='end'>{_esc(first)}</text>")
    grid_h = rows * cell_h
    bar_h = max(grid_h, 90)
    height = int(top + bar_h + 30)
    body += _colour_bar(left + cols * cell_w + 24, top, bar_h, lo, hi)
    if any(v != v for _, _, v in cells):
        body += _legend([(NOT_FINITE_COLOUR, "not finite")], left, int(top + grid_h + 18))
    return _svg(height, body, "largest error per sample"), per_cell


def _colour_bar(x: float, y: float, height: float, lo: float, hi: float) -> list[str]:
    """A vertical bar of the error colours from 10^lo (bottom) to 10^hi (top), labelled at whole decades."""
    stops = "".join(
        f"<stop offset='{k / (len(REDS) - 1):.2f}' stop-color='{_red(1 - k / (len(REDS) - 1))}'/>"
        for k in range(len(REDS))
    )
    gid = f"bar{abs(hash((x, y, height, lo, hi))) % 10**8}"
    out = [
        f"<defs><linearGradient id='{gid}' x1='0' x2='0' y1='0' y2='1'>{stops}</linearGradient></defs>",
        f"<rect x='{x}' y='{y}' width='14' height='{_num(height)}' fill='url(#{gid})' stroke='#d7dbe3'/>",
        f"<text x='{x}' y='{y - 8}'>|error|</text>",
    ]

    def label(value: float, text: str) -> str:
        at = y + (hi - value) / (hi - lo) * height
        return (
            f"<line class='tick' x1='{x + 14}' x2='{x + 18}' y1='{_num(at)}' y2='{_num(at)}'/>"
            f"<text x='{x + 21}' y='{_num(at + 4)}'>{_esc(text)}</text>"
        )

    out.append(label(hi, short(10**hi)))  # the largest error, at the top
    decades = [d for d in range(math.ceil(lo), math.floor(hi) + 1) if (hi - d) / (hi - lo) * height >= 16]
    step = max(1, math.ceil(len(decades) * 16 / height))  # labels at least 16 px apart
    out += [label(d, f"1e{d}") for d in decades[::-step]]
    return out


def bar_chart(labels: Sequence[str], shares: Sequence[float], notes: Sequence[str]) -> str:
    """Horizontal bars of a share (0..1) per label, each with its note at the bar's end."""
    longest = max((len(s) for s in labels), default=0)
    left, row = min(40 + int(longest * CHAR_WIDTH), WIDTH // 2), 26
    fits = int((left - 16) / CHAR_WIDTH)
    height = 60 + row * len(labels)
    frame = _Frame(height, (0.0, 1.0), (0.0, 1.0), left=left, right=110, top=10, bottom=44)
    body = []
    for t in (0, 0.25, 0.5, 0.75, 1):
        x = _num(frame.px(t))
        body.append(
            f"<line class='grid' x1='{x}' x2='{x}' y1='{frame.top}' y2='{height - frame.bottom}'/>"
            f"<text x='{x}' y='{height - frame.bottom + 16}' text-anchor='middle'>{t:g}</text>"
        )
    body.append(
        f"<text class='title' x='{_num(frame.px(0.5))}' y='{height - 6}' text-anchor='middle'>share of "
        "values that differ</text>"
    )
    for k, (label, share, note) in enumerate(zip(labels, shares, notes)):
        y = frame.top + k * row
        shown = label if len(label) <= fits else "…" + label[len(label) - fits + 1 :]
        body.append(
            f"<text x='{left - 8}' y='{y + 17}' text-anchor='end'>{_esc(shown)}</text>"
            f"<rect x='{left}' y='{y + 4}' width='{_num(frame.px(share) - left)}' height='{row - 8}' "
            f"fill='{DIVERGENT_COLOUR}'><title>{_esc(label)}: {_esc(note)}</title></rect>"
            f"<text x='{_num(frame.px(share) + 6)}' y='{y + 17}'>{_esc(note)}</text>"
        )
    return _svg(height, body, "share of values that differ per field")


def strip_chart(
    labels: Sequence[str], categories: Sequence[str], colours: dict[str, str], max_columns: int, hover: Sequence[str]
) -> tuple[str, int]:
    """(the SVG, items per column) of one coloured square per item, in the order given, on the row of its
    category; more than `max_columns` items: each column holds consecutive items and marks every category
    among them."""
    rows = [c for c in colours if c in set(categories)]
    buckets = _buckets(len(labels), max_columns)
    per_column = max(1, math.ceil(len(labels) / max_columns))
    few = per_column == 1 and len(labels) <= 40
    left, row = 100, 26
    bottom = min(40 + int(max(map(len, labels)) * CHAR_WIDTH * 0.65), 200) if few else 50  # labels at -40°
    frame = _Frame(40 + row * len(rows) + bottom, (-0.5, len(buckets) - 0.5), (0, 1), left=left, bottom=bottom, top=10)
    body = []
    for k, name in enumerate(rows):
        body.append(f"<text x='{left - 8}' y='{frame.top + k * row + 17}' text-anchor='end'>{_esc(name)}</text>")
    size = max(2.0, min(16.0, frame.px(1) - frame.px(0) - 1))
    for col, (start, end) in enumerate(buckets):
        for k, name in enumerate(rows):
            members = [i for i in range(start, end) if categories[i] == name]
            if not members:
                continue
            title = hover[members[0]] if len(members) == 1 else f"{len(members)} {name}: {labels[members[0]]} …"
            body.append(
                f"<rect x='{_num(frame.px(col) - size / 2)}' y='{frame.top + k * row + 5}' "
                f"width='{_num(size)}' height='16' fill='{colours[name]}'><title>{_esc(title)}</title></rect>"
            )
    base = frame.height - frame.bottom
    body.append(f"<line class='axis' x1='{left}' x2='{WIDTH - frame.right}' y1='{base}' y2='{base}'/>")
    if few:
        ticks = [(i, labels[i]) for i in range(len(labels))]
        title = ""
    else:
        ticks = [(t, str(buckets[t][0] + 1)) for t in integer_ticks(0, len(buckets) - 1)]
        title = "position in anchor order" + ("" if per_column == 1 else f" (each column: {per_column} bundles)")
    for x, label in ticks:
        at = _num(frame.px(x))
        text = (
            f"<text class='label' x='{at}' y='{base + 12}' text-anchor='end' transform='rotate(-40 {at} {base + 12})'>"
            if few
            else f"<text class='index' x='{at}' y='{base + 16}' text-anchor='middle'>"
        )
        body.append(f"<line class='tick' x1='{at}' x2='{at}' y1='{base}' y2='{base + 4}'/>{text}{_esc(label)}</text>")
    if title:
        body.append(
            f"<text class='title' x='{(left + WIDTH) / 2:.0f}' y='{frame.height - 6}' "
            f"text-anchor='middle'>{_esc(title)}</text>"
        )
    return _svg(frame.height, body, "verdict per bundle"), per_column


__all__ = ["bar_chart", "heatmap", "integer_ticks", "paired_chart", "strip_chart", "token_chart", "value_ticks"]
