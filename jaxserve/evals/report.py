"""`jaxserve eval report`: a static HTML dashboard of a suite's stored runs — per task, each
version's score with its 95 % interval, a trend plot (inline SVG, drawn here: no script, no CDN,
and a Content-Security-Policy that forbids fetching anything), and the questions that flipped
between consecutive versions with the paired test's numbers."""

from __future__ import annotations

import html
from pathlib import Path

from jaxserve.evals.regression import Comparison, compare, confidence_interval
from jaxserve.evals.store import ResultsStore, Run, Sample
from jaxserve.evals.suite import Suite

MAX_FLIPS_SHOWN = 50
_W, _H, _PAD = 640, 240, 40

_STYLE = """body{font:14px system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f4f4f4}.alert{color:#b00;font-weight:bold}.ok{color:#070}
svg{border:1px solid #ddd;background:#fff}code{font-size:12px}"""


def _latest_per_version(runs: list[Run]) -> list[Run]:
    """Each version's newest run, versions in the order they were first run (checkpoint order)."""
    order, latest = [], {}
    for run in runs:  # oldest first
        if run.version not in latest:
            order.append(run.version)
        latest[run.version] = run
    return [latest[v] for v in order]


def _trend_svg(task: str, points: list[tuple[str, float, float, float]]) -> str:
    """Score (0..1) per version with its interval as a whisker; x in version order."""
    n = len(points)
    step = (_W - 2 * _PAD) / max(n - 1, 1)

    def xy(i: int, value: float) -> tuple[float, float]:
        return _PAD + i * step, _H - _PAD - value * (_H - 2 * _PAD)

    parts = [f'<svg class="trend" data-task="{html.escape(task)}" width="{_W}" height="{_H}" '
             f'viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg" role="img">',
             f'<title>{html.escape(task)}: score per version</title>']
    for tick in (0.0, 0.5, 1.0):
        _, y = xy(0, tick)
        parts.append(f'<line x1="{_PAD}" y1="{y:.1f}" x2="{_W - _PAD}" y2="{y:.1f}" '
                     f'stroke="#eee"/><text x="4" y="{y + 4:.1f}" font-size="10">{tick:.1f}</text>')
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, p[1]) for i, p in enumerate(points)))
    parts.append(f'<polyline class="score-line" points="{line}" fill="none" stroke="#36c" '
                 'stroke-width="2"/>')
    for i, (version, score, low, high) in enumerate(points):
        x, y = xy(i, score)
        _, y_low = xy(i, low)
        _, y_high = xy(i, high)
        parts.append(f'<line x1="{x:.1f}" y1="{y_low:.1f}" x2="{x:.1f}" y2="{y_high:.1f}" '
                     f'stroke="#36c" stroke-opacity=".5"/>'
                     f'<circle class="score-point" cx="{x:.1f}" cy="{y:.1f}" r="4" fill="#36c">'
                     f'<title>{html.escape(version)}: {score:.4f} [{low:.4f}, {high:.4f}]</title>'
                     f'</circle><text x="{x:.1f}" y="{_H - 12}" font-size="10" '
                     f'text-anchor="middle">{html.escape(version[:16])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _flips_table(c: Comparison, base: dict[int, Sample], cand: dict[int, Sample]) -> str:
    rows = []
    for kind, ids in (("lost", c.lost), ("gained", c.gained)):
        for doc_id in ids[:MAX_FLIPS_SHOWN]:
            b, a = base.get(doc_id), cand[doc_id]
            rows.append(f"<tr><td>{kind}</td><td>{doc_id}</td><td>{html.escape(a.target)}</td>"
                        f"<td>{html.escape(b.response if b else '')}</td>"
                        f"<td>{html.escape(a.response)}</td></tr>")
    shown = min(len(c.lost), MAX_FLIPS_SHOWN) + min(len(c.gained), MAX_FLIPS_SHOWN)
    more = len(c.lost) + len(c.gained) - shown
    return ("<table class=\"flips\"><tr><th>flip</th><th>doc</th><th>target</th>"
            f"<th>{html.escape(c.baseline)}</th><th>{html.escape(c.candidate)}</th></tr>"
            + "".join(rows) + "</table>" + (f"<p>… and {more} more</p>" if more else ""))


def _task_section(task: str, runs: list[Run], store: ResultsStore, suite: Suite) -> str:
    latest = _latest_per_version(runs)
    samples = {r.id: store.samples(r.id) for r in latest}
    points, rows = [], []
    for run in latest:
        low, high = confidence_interval([s.correct for s in samples[run.id]])
        points.append((run.version, run.score, low, high))
        rows.append(f"<tr><td>{html.escape(run.version)}</td><td><code>"
                    f"{html.escape(run.version_id)}</code></td><td>{html.escape(run.metric)}</td>"
                    f"<td>{run.score:.4f}</td><td>[{low:.4f}, {high:.4f}]</td>"
                    f"<td>{run.num_samples}</td><td>{run.seed}</td></tr>")
    out = [f'<section class="task"><h2>{html.escape(task)}</h2>', _trend_svg(task, points),
           "<table><tr><th>version</th><th>id</th><th>metric</th><th>score</th><th>95% CI</th>"
           "<th>questions</th><th>seed</th></tr>", *rows, "</table>"]
    for before, after in zip(latest, latest[1:]):
        c = compare(task, after.metric, before.version, samples[before.id], after.version,
                    samples[after.id], suite.regression)
        verdict = ('<span class="alert">regression</span>' if c.alert
                   else '<span class="ok">no significant drop</span>')
        out.append(f"<h3>{html.escape(before.version)} → {html.escape(after.version)}: "
                   f"{verdict}</h3><p>drop {c.drop_points:.2f} points (alert at ≥ "
                   f"{suite.regression.min_drop_points:g}), {c.test} p = {c.p_value:.4g} "
                   f"(alert below {suite.regression.alpha:g}), {c.paired} paired questions, "
                   f"{len(c.lost)} lost, {len(c.gained)} gained</p>")
        out.append(_flips_table(c, {s.doc_id: s for s in samples[before.id]},
                                {s.doc_id: s for s in samples[after.id]}))
    out.append("</section>")
    return "\n".join(out)


def write_dashboard(suite: Suite, store: ResultsStore, out: Path) -> Path:
    runs = store.runs(suite.name)
    tasks = sorted({r.task for r in runs})
    body = [_task_section(t, [r for r in runs if r.task == t], store, suite) for t in tasks]
    page = ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "style-src 'unsafe-inline'\">"
            f"<title>eval: {html.escape(suite.name)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>eval suite {html.escape(suite.name)}</h1>"
            + ("\n".join(body) if body else "<p>No runs stored yet.</p>") + "</body></html>\n")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    path.write_text(page)
    return path
