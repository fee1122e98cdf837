"""``OUTPUT/report.html``: the run report as figures, for an engineer who would rather look than read.

One self-contained page (inline SVG and CSS; no script, font or image from elsewhere), built by pure
functions from the report dict (``report.json``) and the drafter's ``metrics.jsonl`` rows:

* quarantine reasons, samples per source, seconds per stage (bar charts)
* generation throughput over time per source (``throughput.series``, see pipeline.report.throughput)
* billing differences: rebuilt ids minus billed completion tokens (all sources, then per provider)
* training curves per TTT position (loss, accuracy), learning rate, tokens/s
* held-out acceptance per draft position, and per dataset of the held-out samples (± one standard error)

Every figure is an ``<svg>`` with a fixed id (``FIGURE_IDS``) and a ``<title>``, drawn even when it
has no data (it then says why), so tests and people find the same figures in every report.
``write_report_html`` writes the page next to ``report.json`` and never raises.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from pipeline.base.layout import RunLayout, atomic_write
from pipeline.checks.audit_html import histogram_bins
from pipeline.report.costs import cost_groups
from pipeline.report.throughput import windowed_rates

log = logging.getLogger("pipeline")

FIGURE_IDS = ("fig-quarantine-reasons", "fig-samples-per-source", "fig-throughput", "fig-throughput-cumulative",
              "fig-throughput-tokens",
              "fig-billing", "fig-seconds", "fig-train-loss", "fig-train-acc", "fig-train-lr", "fig-train-tps",
              "fig-heldout", "fig-heldout-datasets", "fig-value-curves")
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac")
MAX_LINE_POINTS = 400
WIDE, NARROW = 960, 470

# ----------------------------------------------------------------------------- numbers


def fmt_num(v: float | int | None) -> str:
    """Short tick/value label: 1.2k, 3.4M, 0.012, 2e-04."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 1:
        return f"{v:.4g}" if a < 1000 else f"{v:,.0f}"
    return f"{v:.3g}"


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """One style per axis: all in k (or M) once the axis reaches 10k, else ``fmt_num``."""
    top = max((abs(t) for t in ticks), default=0)
    if top >= 1e7:
        return [f"{t / 1e6:.3g}M" if t else "0" for t in ticks]
    if top >= 1e4:
        return [f"{t / 1e3:.3g}k" if t else "0" for t in ticks]
    return [fmt_num(t) for t in ticks]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values, the first at or below ``lo``, the last at or above ``hi``."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def downsample(points: Sequence[tuple[float, float]], max_points: int = MAX_LINE_POINTS) -> list[tuple[float, float]]:
    """Bucket means, so a 100k-step curve stays a few hundred points (and is smoothed a little)."""
    if len(points) <= max_points:
        return list(points)
    size = len(points) / max_points
    out = []
    for i in range(max_points):
        chunk = points[int(i * size):int((i + 1) * size)] or points[int(i * size):int(i * size) + 1]
        out.append((sum(p[0] for p in chunk) / len(chunk), sum(p[1] for p in chunk) / len(chunk)))
    return out


# ----------------------------------------------------------------------------- SVG pieces


SUB = 15  # extra top margin of a figure with a subtitle


def _svg_open(fig_id: str, title: str, w: int, h: int, subtitle: str = "") -> str:
    """The figure's <svg> with its <title> (what a screen reader, a tooltip and a test read) and a visible
    heading, left-aligned and cut to the width (the whole of it stays in <title>)."""
    full = f"{title}: {subtitle}" if subtitle else title
    sub = (f'<text x="2" y="31" class="fs">{escape(_short(subtitle, int(w / 6.2)))}</text>' if subtitle else "")
    return (f'<svg id="{fig_id}" class="fig" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" '
            f'height="{h}" role="img" aria-labelledby="{fig_id}-title"><title id="{fig_id}-title">{escape(full)}'
            f'</title><text x="2" y="15" class="ft">{escape(_short(title, int(w / 7.6)))}</text>{sub}')


def empty_figure(fig_id: str, title: str, message: str, w: int = NARROW, h: int = 120) -> str:
    """A figure with nothing to draw says so, in place (the page keeps its shape)."""
    return (_svg_open(fig_id, title, w, h) + f'<rect x="1" y="24" width="{w - 2}" height="{h - 26}" class="none"/>'
            f'<text x="{w / 2:.0f}" y="{h / 2 + 14:.0f}" text-anchor="middle" class="muted">{escape(message)}</text>'
            "</svg>")


def bar_chart(fig_id: str, title: str, bars: Sequence[tuple[str, float]], *, y_label: str = "",
              x_label: str = "", colours: Sequence[str] | None = None, w: int = NARROW, h: int = 240,
              y_max: float | None = None, value_fmt: Callable[[float], str] | None = None,
              empty: str = "no data", subtitle: str = "", errors: Sequence[float | None] | None = None) -> str:
    """Vertical bars, one per (label, value); labels thinned to fit; values on the bars when they fit;
    ``errors``: a whisker of ± that much on each bar (None: none)."""
    if not bars:
        return empty_figure(fig_id, title, empty, w)
    errs = [e if isinstance(e, int | float) and e > 0 else 0.0 for e in errors or []] + [0.0] * len(bars)
    left, right, bottom = 52, 10, 42 if x_label else 28
    show_values = len(bars) <= 24 and (w - left - right) / len(bars) >= 22
    top = 28 + (SUB if subtitle else 0) + (12 if show_values else 0)
    pw, ph = w - left - right, h - top - bottom
    peak = y_max if y_max is not None else max(max(v + e for (_, v), e in zip(bars, errs, strict=False)), 1e-12)
    ticks = nice_ticks(0, peak, 5)
    top_val = ticks[-1]
    parts = [_svg_open(fig_id, title, w, h, subtitle)]
    parts += _y_axis(ticks, 0, top_val, left, top, pw, ph, y_label, log_y=False)
    bw = pw / len(bars)
    label_every = max(1, math.ceil(len(bars) * 38 / pw))
    for i, (label, value) in enumerate(bars):
        x = left + i * bw
        bh = ph * max(value, 0) / top_val if top_val else 0
        colour = colours[i] if colours else PALETTE[0]
        parts.append(f'<rect x="{x + bw * 0.12:.1f}" y="{top + ph - bh:.1f}" width="{max(bw * 0.76, 1):.1f}" '
                     f'height="{bh:.1f}" fill="{colour}"><title>{escape(label)}: {escape(_val(value, value_fmt))}'
                     "</title></rect>")
        if errs[i]:  # whisker from value - error to value + error, clipped to the axis
            lo, hi = (top + ph - ph * min(max(v, 0), top_val) / top_val for v in (value - errs[i], value + errs[i]))
            cx, cap = x + bw / 2, min(bw * 0.15, 6)
            parts.append(f'<path d="M{cx:.1f} {lo:.1f}V{hi:.1f}M{cx - cap:.1f} {hi:.1f}H{cx + cap:.1f}'
                         f'M{cx - cap:.1f} {lo:.1f}H{cx + cap:.1f}" stroke="#333" fill="none"/>')
            bh = max(bh, top + ph - hi)  # the value label goes above the whisker
        if show_values and value:
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{top + ph - bh - 3:.1f}" text-anchor="middle" '
                         f'class="val">{escape(_val(value, value_fmt))}</text>')
        if i % label_every == 0 or label.startswith(("<", ">")) or label == "0":
            parts.append(f'<text x="{x + bw / 2:.1f}" y="{top + ph + 13}" text-anchor="middle" class="tick">'
                         f"{escape(_short(label, max(4, int(bw * label_every / 6.5))))}</text>")
    if x_label:
        parts.append(f'<text x="{left + pw / 2:.0f}" y="{h - 6}" text-anchor="middle" class="axis">'
                     f"{escape(x_label)}</text>")
    return "".join(parts) + "</svg>"


def hbar_chart(fig_id: str, title: str, bars: Sequence[tuple[str, float]], *, w: int = NARROW,
               colour: str = PALETTE[0], value_fmt: Callable[[float], str] | None = None,
               empty: str = "no data", label_chars: int = 34, subtitle: str = "") -> str:
    """Horizontal bars (long labels such as quarantine reasons), largest first as given."""
    if not bars:
        return empty_figure(fig_id, title, empty, w)
    row, top = 22, 28 + (SUB if subtitle else 0)
    label_w = min(label_chars * 6.4 + 8, w * 0.5)
    h = top + row * len(bars) + 10
    pw = w - label_w - 60
    peak = max(max(v for _, v in bars), 1e-12)
    parts = [_svg_open(fig_id, title, w, h, subtitle)]
    for i, (label, value) in enumerate(bars):
        y = top + i * row
        bw = pw * max(value, 0) / peak
        parts.append(f'<text x="{label_w - 6:.0f}" y="{y + row / 2 + 4:.1f}" text-anchor="end" class="tick">'
                     f"<title>{escape(label)}</title>{escape(_short(label, label_chars))}</text>")
        parts.append(f'<rect x="{label_w:.0f}" y="{y + 3:.1f}" width="{max(bw, 1):.1f}" height="{row - 6}" '
                     f'fill="{colour}"><title>{escape(label)}: {escape(_val(value, value_fmt))}</title></rect>')
        parts.append(f'<text x="{label_w + bw + 4:.1f}" y="{y + row / 2 + 4:.1f}" class="val">'
                     f"{escape(_val(value, value_fmt))}</text>")
    return "".join(parts) + "</svg>"


def line_chart(fig_id: str, title: str, series: Sequence[tuple[str, Sequence[tuple[float, float]]]], *,
               x_label: str = "", y_label: str = "", w: int = NARROW, h: int = 250, y_min: float | None = None,
               y_max: float | None = None, log_y: bool = False, empty: str = "no data",
               dashed: Iterable[str] = (), x_min: float | None = None, subtitle: str = "",
               steps: bool = False) -> str:
    """Lines over a shared x axis, one colour per series, with a legend when there are several; ``steps``
    draws each value flat until the next point (counts that change only when a batch arrives)."""
    series = [(name, [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y) and (y > 0 or not log_y)])
              for name, pts in series]
    series = [(name, downsample(pts)) for name, pts in series if pts]
    if not series:
        return empty_figure(fig_id, title, empty, w)
    dashed = set(dashed)
    per_row = max(1, min(5, int((w - 68) // 120)))
    legend_rows = math.ceil(len(series) / per_row) if len(series) > 1 else 0
    left, right, top, bottom = 56, 12, 28 + (SUB if subtitle else 0) + 16 * legend_rows, 44 if x_label else 30
    pw, ph = w - left - right, h - top - bottom
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    x0, x1 = min(xs) if x_min is None else min(x_min, min(xs)), max(xs)
    if x1 <= x0:
        x1 = x0 + 1
    if log_y:
        lo, hi = math.log10(min(ys)), math.log10(max(ys))
        if hi - lo < 1e-9:
            lo, hi = lo - 0.5, hi + 0.5
        ticks = [float(t) for t in range(math.floor(lo), math.ceil(hi) + 1)]
        lo, hi = ticks[0], ticks[-1]
    else:
        lo = min(ys) if y_min is None else y_min
        hi = max(ys) if y_max is None else y_max
        if hi <= lo:
            hi = lo + (abs(lo) or 1.0)
        ticks = nice_ticks(lo, hi, 5)
        lo, hi = ticks[0], (ticks[-1] if y_max is None else hi)
        ticks = [t for t in ticks if t <= hi + 1e-12]

    def px(x: float) -> float:
        return left + pw * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        v = math.log10(y) if log_y else y
        return top + ph - ph * (v - lo) / (hi - lo)

    parts = [_svg_open(fig_id, title, w, h, subtitle)]
    parts += _y_axis(ticks, lo, hi, left, top, pw, ph, y_label, log_y=log_y)
    x_ticks = [t for t in nice_ticks(x0, x1, 6) if x0 - 1e-9 <= t <= x1 + 1e-9]
    for t, text in zip(x_ticks, tick_labels(x_ticks), strict=True):
        parts.append(f'<line x1="{px(t):.1f}" y1="{top + ph}" x2="{px(t):.1f}" y2="{top + ph + 4}" class="ax"/>'
                     f'<text x="{px(t):.1f}" y="{top + ph + 15}" text-anchor="middle" class="tick">{text}</text>')
    if x_label:
        parts.append(f'<text x="{left + pw / 2:.0f}" y="{h - 6}" text-anchor="middle" class="axis">'
                     f"{escape(x_label)}</text>")
    for i, (name, pts) in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        drawn = [p for a, b in zip(pts, pts[1:], strict=False) for p in (a, (b[0], a[1]))] + pts[-1:] if steps else pts
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in drawn)
        dash = ' stroke-dasharray="5 3"' if name in dashed else ""
        parts.append(f'<polyline class="series" data-series="{escape(name)}" points="{d}" fill="none" '
                     f'stroke="{colour}" stroke-width="1.8"{dash}><title>{escape(name)}</title></polyline>')
        if len(pts) == 1:
            x, y = pts[0]
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>')
        if legend_rows:
            lx, ly = left + (i % per_row) * (pw / per_row), top - 16 * legend_rows + 4 + 16 * (i // per_row)
            parts.append(f'<line x1="{lx:.1f}" y1="{ly:.1f}" x2="{lx + 16:.1f}" y2="{ly:.1f}" stroke="{colour}" '
                         f'stroke-width="3"{dash}/><text x="{lx + 20:.1f}" y="{ly + 4:.1f}" class="tick">'
                         f"{escape(_short(name, 18))}</text>")
    return "".join(parts) + "</svg>"


def _y_axis(ticks: Sequence[float], lo: float, hi: float, left: float, top: float, pw: float, ph: float,
            label: str, *, log_y: bool) -> list[str]:
    out = [f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" class="ax"/>']
    labels = [fmt_num(10 ** t) for t in ticks] if log_y else tick_labels(ticks)
    for t, text in zip(ticks, labels, strict=True):
        y = top + ph - ph * (t - lo) / (hi - lo) if hi > lo else top + ph
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{left - 5}" y="{y + 4:.1f}" text-anchor="end" class="tick">{text}</text>')
    if label:
        out.append(f'<text transform="translate(13,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
                   f'class="axis">{escape(label)}</text>')
    return out


def _val(v: float, value_fmt: Callable[[float], str] | None) -> str:
    return value_fmt(v) if value_fmt else fmt_num(v)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[:max(n - 1, 1)] + "…"


# ----------------------------------------------------------------------------- figures of a report


def quarantine_figure(report: dict[str, Any]) -> str:
    reasons = sorted((report.get("quarantine_reasons") or {}).items(), key=lambda kv: -kv[1])
    stages = ", ".join(f"{k} {v}" for k, v in (report.get("quarantine_by_stage") or {}).items())
    return hbar_chart("fig-quarantine-reasons", "Quarantine reasons", reasons, colour="#e15759",
                      empty="nothing quarantined", subtitle=f"by stage: {stages}" if stages else "")


def sources_figure(report: dict[str, Any]) -> str:
    bars = [(name, s.get("served") or 0) for name, s in (report.get("sources") or {}).items()]
    return bar_chart("fig-samples-per-source", "Samples generated per source (this attempt)", bars,
                     y_label="samples", colours=[PALETTE[i % len(PALETTE)] for i in range(len(bars))],
                     empty="no sources")


def throughput_figures(report: dict[str, Any]) -> str:
    """Samples/s per source, samples done per source and tokens/s over time, from the snapshots in
    ``throughput.series`` (this attempt; t = 0 is the start of generation, engine start-up included)."""
    snaps = sorted((p for p in (report.get("throughput") or {}).get("series") or []
                    if isinstance(p, dict) and isinstance(p.get("t"), (int, float))), key=lambda p: p["t"])
    title_s, title_t = "Generation throughput per source", "Generated tokens/s (all sources)"
    title_c = "Samples generated per source over time"
    if len(snaps) < 1:
        msg = "no snapshots (nothing generated in this attempt, or a report from before they were recorded)"
        return (empty_figure("fig-throughput", title_s, msg, WIDE) + "<div class=grid2>"
                + empty_figure("fig-throughput-cumulative", title_c, "no snapshots")
                + empty_figure("fig-throughput-tokens", title_t, "no snapshots") + "</div>")
    if snaps[0]["t"] > 0:
        snaps = [{"t": 0.0, "done": 0, "tokens": 0, "served": {}}] + snaps
    span = snaps[-1]["t"] - snaps[0]["t"]
    window = max(5.0, span / 30)
    names = sorted({k for p in snaps for k in (p.get("served") or {})})
    series = [(name, windowed_rates([(p["t"], (p.get("served") or {}).get(name, 0)) for p in snaps], window))
              for name in names]
    if len(names) > 1:
        series.append(("all rows", windowed_rates([(p["t"], p.get("done") or 0) for p in snaps], window)))
    tokens = [("tokens/s", windowed_rates([(p["t"], p.get("tokens") or 0) for p in snaps], window))]
    done = [(name, [(p["t"], (p.get("served") or {}).get(name, 0)) for p in snaps]) for name in names]
    x_label = "seconds since generation started"
    sub = f"rate over a sliding {window:.0f} s window (this attempt; engine start-up included)"
    return (line_chart("fig-throughput", title_s, series, x_label=x_label, y_label="samples/s", w=WIDE, y_min=0,
                       x_min=0, dashed=["all rows"], empty="no samples generated in this attempt", subtitle=sub)
            + "<div class=grid2>"
            + line_chart("fig-throughput-cumulative", title_c, done, x_label=x_label, y_label="samples", y_min=0,
                         x_min=0, steps=True, empty="no samples generated in this attempt")
            + line_chart("fig-throughput-tokens", title_t, tokens, x_label=x_label, y_label="tokens/s", y_min=0,
                         x_min=0, subtitle=f"over a sliding {window:.0f} s window") + "</div>")


def _billing_colours(bins: list[tuple[str, int]]) -> list[str]:
    return ["#c0392b" if label.startswith(("<", ">")) else ("#27ae60" if label == "0" else "#4e79a7")
            for label, _ in bins]


def billing_figures(report: dict[str, Any]) -> str:
    """The billing-difference histogram of all billed samples, then one per provider when there are several."""
    audit = report.get("audit") or {}
    billing = audit.get("billing") or {}
    bins = histogram_bins(billing.get("histogram") or {})
    out = bar_chart("fig-billing", "Billing differences: rebuilt ids − billed completion tokens", bins,
                    colours=_billing_colours(bins), w=WIDE, y_label="samples", subtitle=_billing_sub(billing),
                    x_label="token difference (green: exact; red: the tails beyond the central 98%)",
                    empty="no billed samples (only API sources bill; engine ids are exact)")
    providers = [(name, b["billing"]) for name, b in (audit.get("by_provider") or {}).items()
                 if (b.get("billing") or {}).get("samples")]
    if len(providers) > 1:
        out += "<div class=grid2>" + "".join(
            bar_chart(f"fig-billing-provider-{i}", f"Provider {name}", pb, colours=_billing_colours(pb),
                      y_label="samples", h=190, subtitle=_billing_sub(b))
            for i, (name, b) in enumerate(providers) for pb in [histogram_bins(b.get("histogram") or {})]) + "</div>"
    return out


def _billing_sub(billing: dict[str, Any]) -> str:
    if not billing.get("samples"):
        return ""
    mean_abs, n = billing.get("mean_abs_diff"), f"{billing['samples']:,} billed samples"
    return n if mean_abs is None else f"{n}, mean |diff| {mean_abs:.3g} tokens, {billing.get('outliers', 0)} outliers"


def seconds_figure(report: dict[str, Any]) -> str:
    secs = [(k, v) for k, v in (report.get("seconds") or {}).items() if k != "total" and isinstance(v, (int, float))]
    total = (report.get("seconds") or {}).get("total")
    title = "Seconds per stage" + (f" (total {fmt_num(total)} s)" if total is not None else "")
    return hbar_chart("fig-seconds", title, secs, colour="#76b7b2", value_fmt=lambda v: f"{v:.1f} s",
                      label_chars=20)


def _positions(rows: list[dict[str, Any]], prefix: str) -> list[int]:
    ks = {int(k[len(prefix):]) for r in rows for k in r if k.startswith(prefix) and k[len(prefix):].isdigit()}
    return sorted(ks)


def training_figures(rows: list[dict[str, Any]]) -> str:
    """Loss and accuracy per TTT position, learning rate and tokens/s over the training steps."""
    rows = [r for r in rows if isinstance(r.get("step"), (int, float))]
    rows.sort(key=lambda r: r["step"])
    msg = "no training metrics (drafter/metrics.jsonl is empty or absent)"

    def curve(key: str) -> list[tuple[float, float]]:
        return [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]

    loss = [(f"position {k}", curve(f"loss_{k}")) for k in _positions(rows, "loss_")]
    acc = [(f"position {k}", curve(f"acc_{k}")) for k in _positions(rows, "acc_")]
    return (line_chart("fig-train-loss", "Training loss per TTT position", loss, x_label="step", y_label="loss",
                       empty=msg)
            + line_chart("fig-train-acc", "Training accuracy per TTT position", acc, x_label="step",
                         y_label="accuracy", y_min=0, empty=msg)
            + line_chart("fig-train-lr", "Learning rate", [("lr", curve("lr"))], x_label="step", y_label="lr",
                         y_min=0, empty=msg, h=200)
            + line_chart("fig-train-tps", "Training tokens/s (rank 0)", [("tokens/s", curve("tokens_per_s"))],
                         x_label="step", y_label="tokens/s", y_min=0, empty=msg, h=200))


def heldout_figure(report: dict[str, Any]) -> str:
    training = report.get("training") or {}
    h = training.get("heldout") or {}
    per = h.get("per_position") or []
    if not per:
        why = h.get("skipped") or training.get("skipped") or "no held-out evaluation in this run"
        return empty_figure("fig-heldout", "Held-out acceptance per draft position", why)
    sub = f"acceptance length {h['acceptance_length']:.3f} at k={h['k']} on {h['samples']} held-out samples"
    served = training.get("served") or {}
    if served.get("per_position"):  # side by side: simulated, then served by vLLM, per position
        sub += f"; served by vLLM {served['acceptance_length']:.3f}"
        bars = [b for k, (v, w) in enumerate(zip(per, served["per_position"], strict=False))
                for b in ((f"{k + 1} sim", v), (f"{k + 1} vLLM", w))]
        colours, x_label = [PALETTE[2], PALETTE[0]] * len(per), "simulated greedy verification / served by vLLM"
    else:
        bars = [(f"draft {k + 1}", v) for k, v in enumerate(per)]
        colours, x_label = [PALETTE[2]] * len(bars), "simulated greedy verification on samples never trained on"
    return bar_chart("fig-heldout", "Held-out acceptance per draft position", bars, subtitle=sub,
                     y_label="share of drafts accepted", y_max=1.0, colours=colours,
                     value_fmt=lambda v: f"{v:.1%}" if v < 1 else "100%", x_label=x_label)


def heldout_datasets_figure(report: dict[str, Any]) -> str:
    """The held-out acceptance length per dataset of the held-out samples, ± one standard error, so a
    weak dataset shows and so does whether a gap is beyond noise. Grey: fewer drafts than a sure figure needs."""
    from pipeline.report.summary import heldout_groups

    fig_id, title = "fig-heldout-datasets", "Held-out acceptance per dataset"
    training = report.get("training") or {}
    h = training.get("heldout") or {}
    if h.get("acceptance_length") is None:
        why = h.get("skipped") or training.get("skipped") or "no held-out evaluation in this run"
        return empty_figure(fig_id, title, why)
    groups = heldout_groups(h, "dataset")
    if len(groups) < 2:
        why = (f"one dataset held out ({groups[0].get('name')}): its figure is the one beside" if groups else
               "no per-dataset figures in this report (written before they were measured)")
        return empty_figure(fig_id, title, why)
    bars = [(str(g.get("name")), float(g["acceptance_length"])) for g in groups]
    few = [bool(g.get("few")) for g in groups]
    sub = f"tokens per target step at k={h.get('k')}, ± 1 standard error" + ("; grey: few drafts" if any(few) else "")
    return bar_chart(fig_id, title, bars, subtitle=sub, y_label="acceptance length",
                     colours=[PALETTE[9] if f else PALETTE[2] for f in few],
                     errors=[g.get("se") for g in groups], value_fmt=lambda v: f"{v:.2f}",
                     x_label="dataset of the held-out samples (simulated greedy verification)")


def value_figure(value: dict[str, Any] | None) -> str:
    """See ``_value_figure``; a value.json of another shape is said in the figure, never raised."""
    try:
        return _value_figure(value)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return empty_figure("fig-value-curves", "What each dataset's samples bought",
                            f"value/value.json not drawn ({type(e).__name__}): run `python -m pipeline value` again",
                            w=WIDE)


def _value_figure(value: dict[str, Any] | None) -> str:
    """Each cut dataset's points (held-out acceptance on the serving mix against the dollars of its training
    samples in that drafter, the others whole) and, dashed, the curve fitted through them (value.json carries
    it drawn: ``fit_line``)."""
    fig_id, title = "fig-value-curves", "What each dataset's samples bought"
    per = (value or {}).get("datasets") or {}
    series, dashed = [], []
    for name, d in per.items():
        pts = [(float(p["usd"]), float(p["acceptance"])) for p in d.get("points") or []]
        if not pts:
            continue
        series.append((f"{name}", pts))
        line = [(float(x), float(y)) for x, y in d.get("fit_line") or []]
        if line:
            series.append((f"{name} fit", line))
            dashed.append(f"{name} fit")
    if not series:
        return empty_figure(fig_id, title, "no value curves yet: `python -m pipeline value CONFIG` measures them",
                            w=WIDE)
    sub = (f"{value.get('steps')} steps per drafter; held-out acceptance on the mix "
           + ", ".join(f"{k} {v:.0%}" for k, v in (value.get("mix") or {}).items()))
    return line_chart(fig_id, title, series, x_label="dollars of the dataset's training samples",
                      y_label="acceptance length", w=WIDE, dashed=dashed, subtitle=sub, x_min=0.0)


def _plan_table(plan: dict[str, Any] | None) -> str:
    """The latest plan: dollars per dataset, what each is predicted to gain, beside an even split (a plan.json
    of another shape is left out, with a line)."""
    if not plan or not isinstance(plan.get("datasets"), list):
        return ""
    try:
        return _plan_rows(plan)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return f"<p class=muted>value/plan.json not shown ({escape(type(e).__name__)}): run `plan` again</p>"


def _plan_rows(plan: dict[str, Any]) -> str:
    lines = [str(x) for x in plan.get("lines") or []] or [""]
    rows = [[r.get("dataset"), r.get("add_usd"), r.get("add_samples"), r.get("usd_per_sample"), r.get("gain"),
             r.get("room"), "yes" if r.get("extrapolated") else ""] for r in plan["datasets"]]
    return (f"<p>{escape(lines[0].removeprefix('[plan] '))}</p>"
            + _table(["dataset", "add $", "samples", "$ per sample", "predicted gain", "samples left",
                      "extrapolated"], rows))


# ----------------------------------------------------------------------------- tables and page


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(_cell(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items()) or "–"
    return str(v)


def _cards(report: dict[str, Any]) -> str:
    t = report.get("throughput") or {}
    attempt = report.get("this_attempt")
    again = attempt.get("replayed") if isinstance(attempt, dict) else None
    replayed = again.get("samples") if isinstance(again, dict) else None  # counted in no rate
    replayed = replayed if isinstance(replayed, int) and not isinstance(replayed, bool) else None
    h = (report.get("training") or {}).get("heldout") or {}
    m = (report.get("training") or {}).get("metrics") or {}
    from pipeline.report.summary import ledger_datasets, ledger_usd

    ledgers = report.get("spend") or {}
    spend = sum(ledger_usd(d) for s in ledgers.values() for d in ledger_datasets(s).values())
    cards = [
        ("rows in", report.get("rows_in")), ("passed generation", report.get("passed")),
        ("quarantined at extraction (not trained on)", report.get("quarantined_at_extraction")),
        ("quarantined", report.get("quarantined")), ("not generated", report.get("not_generated")),
        ("tokens generated (in passed samples)", report.get("tokens_generated")),
        *([("API spend (ledger total, all attempts)", f"${spend:.4f}")] if ledgers else []),
        ("generated rows/s (this attempt)", t.get("samples_per_s")), ("tokens/s", t.get("tokens_per_s")),
        *([("replayed from the journal (this attempt, paid before)", replayed)] if replayed else []),
        ("drafter steps", m.get("step")),
        ("held-out acceptance length", h.get("acceptance_length")),
        ("served acceptance length", ((report.get("training") or {}).get("served") or {}).get("acceptance_length")),
        ("seconds", (report.get("seconds") or {}).get("total")),
    ]
    return "<div class=cards>" + "".join(
        f"<div class=card><div class=cv>{escape(v if isinstance(v, str) else fmt_num(v))}</div>"
        f"<div class=cl>{escape(k)}</div></div>" for k, v in cards) + "</div>"


def _attention(report: dict[str, Any]) -> str:
    from pipeline.report.summary import aside_line, attention_lines

    lines = [ln.strip().lstrip("! ").strip() for ln in attention_lines(report)]
    if aside := aside_line(report.get("not_in_current_files") or {}):
        lines.append(aside)
    for name, src in (report.get("sources") or {}).items():
        if src.get("start_error"):
            lines.append(f"source {name} failed to start: {src['start_error'][:300]}")
        elif src.get("engine_error"):
            lines.append(f"source {name} left prompts to do: {src['engine_error'][:300]}")
    if not lines:
        return ""
    return "<div class=attention><b>Needs attention</b><ul>" + "".join(
        f"<li>{escape(ln)}</li>" for ln in lines) + "</ul></div>"


def _sources_table(report: dict[str, Any]) -> str:
    rows = [[name, s.get("kind"), s.get("served"), s.get("spilled"), sum((s.get("left_to_do") or {}).values()),
             s.get("requests"), s.get("retried"), (s.get("start_error") or "")[:120] or None]
            for name, s in (report.get("sources") or {}).items()]
    return _table(["source", "kind", "generated", "spilled", "left to do", "requests", "retried", "start error"],
                  rows) if rows else ""


def _dollars(v: Any) -> str | None:
    """Dollars to the hundredth of a cent (a spend of $5.004 beside a $5.00 cap must not read $5.00)."""
    return f"{v:.4f}" if isinstance(v, int | float) and not isinstance(v, bool) else None


def _spend_table(report: dict[str, Any]) -> str:
    """Each API source's ledger per dataset: caps and spend in tokens and dollars over every attempt, dollars in
    doubt and billed beyond reservations, this attempt's requests; a breached cap is marked."""
    from pipeline.report.summary import ledger_datasets, ledger_usd

    rows = []
    for name, s in (report.get("spend") or {}).items():
        for d, x in ledger_datasets(s).items():
            cap, usd = x.get("budget_usd"), ledger_usd(x)
            over = isinstance(cap, int | float) and usd > cap + 1e-9
            rows.append([name, d, x.get("budget"), x.get("spent"), _dollars(cap), _dollars(usd),
                         _dollars(x.get("in_doubt_usd")), _dollars(x.get("overrun_usd")), x.get("sent"),
                         "OVER THE CAP" if over else None, s.get("halted")])
    return _table(["source", "dataset", "budget tokens", "spent tokens (all attempts)", "budget $",
                   "spent $ (ledger total, all attempts)", "in doubt $", "billed beyond reservations $",
                   "requests (this attempt)", "cap", "halted"],
                  rows) if rows else "<p class=muted>No spending sources.</p>"


def _cost_table(report: dict[str, Any]) -> str:
    """What the samples cost per dataset and per source: API dollars billed and engine device-hours."""
    rows = [[field, name, c.get("samples"), c.get("output_tokens"), c.get("billed_usd"), c.get("device_hours"),
             c.get("engine_usd"), c.get("usd"), c.get("usd_per_mtok")]
            for field in ("dataset", "source") for name, c in cost_groups(report.get("costs"), field).items()]
    return ("<p class=muted>Dollars in passed samples, all attempts (a quarantined row's bill is in the ledger "
            "above, not here).</p>" + _table(["by", "name", "samples", "output tokens", "API billed $",
                                              "device-hours", "engine $", "total $", "$ per M output tokens"], rows)
            ) if rows else ""


def _checks_table(report: dict[str, Any]) -> str:
    checks = (report.get("audit") or {}).get("checks") or {}
    rows = [[name, c.get("mode"), c.get("checked"), c.get("failed"), c.get("flagged")] for name, c in checks.items()]
    return _table(["check", "mode", "checked", "failed", "flagged"], rows) if rows else ""


def _datasets_table(report: dict[str, Any]) -> str:
    rows = [[d, x.get("rows"), x.get("passed"), x.get("quarantined_at_extraction"), x.get("quarantined")]
            for d, x in (report.get("by_dataset") or {}).items()]
    return _table(["dataset", "rows", "passed generation", "quarantined at extraction (not trained on)",
                   "quarantined"], rows) if rows else ""


def _training_table(report: dict[str, Any]) -> str:
    t = report.get("training") or {}
    x = t.get("extraction") or {}
    rows = [["export", t.get("export_dir")], ["aux layer ids", t.get("aux_layer_ids")],
            ["extraction", f"{x.get('samples')} samples, {x.get('tokens')} tokens, "
                           f"{x.get('tokens_per_s_per_actor')} tok/s/actor, peak RSS {x.get('peak_rss_mb')} MB"
             if x.get("samples") is not None else None]]
    if t.get("skipped"):
        rows.append(["skipped", t["skipped"]])
    rows = [r for r in rows if r[1] is not None]
    return ("<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(_cell(v))}</td></tr>" for k, v in rows)
            + "</table>") if rows else ""


CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1000px;color:#222;"
    "padding:0 12px}h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid "
    "#ddd;padding-bottom:4px}.sub{color:#666;font-size:13px;margin-bottom:14px;word-break:break-all}"
    ".cards{display:flex;flex-wrap:wrap;gap:8px}.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;"
    "min-width:104px;background:#fafafa}.cv{font-size:19px;font-weight:600}.cl{font-size:12px;color:#666}"
    ".grid2{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:10px 20px;align-items:start}"
    "svg.fig{display:block;max-width:100%;height:auto;margin:6px 0}.ft{font-size:13px;font-weight:600;fill:#222}"
    ".tick{font-size:10.5px;fill:#444}.axis{font-size:11px;fill:#555}.val{font-size:10px;fill:#333}"
    ".fs{font-size:11px;fill:#666}.muted{font-size:12px;fill:#888;color:#888}.ax{stroke:#777}.grid{stroke:#eee}.none{fill:#fbfbfb;"
    "stroke:#e4e4e4}table{border-collapse:collapse;margin:8px 0;font-size:12.5px}td,th{border:1px solid #ddd;"
    "padding:3px 8px;text-align:left}th{background:#f4f4f4}.attention{border:1px solid #e15759;background:#fdf0f0;"
    "border-radius:6px;padding:8px 14px;margin:14px 0}.attention ul{margin:4px 0 0 0;padding-left:18px}"
)


def render_report_html(report: dict[str, Any], metrics_rows: list[dict[str, Any]] | None = None, *,
                       title: str = "Run report", subtitle: str = "", value: dict[str, Any] | None = None,
                       plan: dict[str, Any] | None = None) -> str:
    """The whole page as one string (pure: from the report dict, the drafter's metrics.jsonl rows, and the
    value curves and plan where ``python -m pipeline value`` / ``plan`` made them)."""
    rows = metrics_rows or []
    return (
        "<!DOCTYPE html><html lang=en><head><meta charset='utf-8'>"
        f"<meta name=viewport content='width=device-width'><title>{escape(title)}</title><style>{CSS}</style>"
        f"</head><body><h1>{escape(title)}</h1><div class=sub>{escape(subtitle)}</div>"
        + _cards(report) + _attention(report)
        + "<h2>Data</h2><div class=grid2>" + quarantine_figure(report) + sources_figure(report) + "</div>"
        + _datasets_table(report) + _sources_table(report)
        + "<h2>Throughput</h2>" + throughput_figures(report) + seconds_figure(report)
        + "<h2>Billing</h2>" + billing_figures(report) + _spend_table(report) + _cost_table(report)
        + "<h2>Checks</h2>" + _checks_table(report)
        + "<h2>Drafter training</h2><div class=grid2>" + training_figures(rows) + "</div>"
        + "<h2>Held-out acceptance</h2><div class=grid2>" + heldout_figure(report)
        + heldout_datasets_figure(report) + "</div>" + _training_table(report)
        + "<h2>What the next dollar buys</h2>" + value_figure(value) + _plan_table(plan)
        + "</body></html>\n"
    )


def read_metrics_rows(path: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows; a torn or foreign line is skipped, a missing file is no rows."""
    rows = []
    try:
        text = Path(path).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def refresh_report_html(layout: RunLayout) -> Path | None:
    """Redraw ``report.html`` from the folder's report.json (after ``value`` or ``plan`` wrote theirs), if the
    run wrote one."""
    report = _read_json(layout.report)
    return write_report_html(layout, report) if report is not None else None


def write_report_html(layout: RunLayout, report: dict[str, Any]) -> Path | None:
    """Write ``report.html`` beside ``report.json``. Never raises: a failure is logged and the run goes on."""
    try:
        page = render_report_html(report, read_metrics_rows(layout.metrics), subtitle=str(layout.root.resolve()),
                                  value=_read_json(layout.value_report), plan=_read_json(layout.plan))
        atomic_write(layout.report_html, page)
        return layout.report_html
    except Exception:  # noqa: BLE001 - a figure must never fail a run
        log.exception("report.html not written (report.json is)")
        return None
