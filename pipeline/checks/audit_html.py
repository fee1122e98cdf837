"""A self-contained HTML page for an audit report: tables plus inline-SVG billing histograms.

No scripts, styles or images from elsewhere, so the page can be attached to a ticket or
opened from an air-gapped machine. Built from the report dict alone.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

MAX_BINS = 41
W, H, PAD_L, PAD_B, PAD_T = 640, 200, 44, 34, 12


def histogram_bins(histogram: dict[str, int], max_bins: int = MAX_BINS) -> list[tuple[str, int]]:
    """(label, count) bins over integer diffs, centred on 0; the tails fold into '<=' / '>=' bins.

    A single huge outlier must not squash the bulk near 0 into one bar, so the range shown is
    the central 98% of samples (at least +-5), and whatever lies beyond lands in the edge bins.
    """
    counts = sorted((int(k), v) for k, v in histogram.items())
    if not counts:
        return []
    total = sum(v for _, v in counts)
    seen, lo_cut, hi_cut = 0, counts[0][0], counts[-1][0]
    for d, v in counts:
        seen += v
        if seen > 0.01 * total:
            lo_cut = d
            break
    seen = 0
    for d, v in reversed(counts):
        seen += v
        if seen > 0.01 * total:
            hi_cut = d
            break
    span = max(5, abs(lo_cut), abs(hi_cut))
    width = max(1, math.ceil((2 * span + 1) / (max_bins - 2)))
    half = (span + width - 1) // width * width
    edges = list(range(-half, half + 1, width))  # bin i holds [edges[i], edges[i] + width)
    bins = [0] * len(edges)
    low_tail = high_tail = 0
    for d, v in counts:
        if d < edges[0]:
            low_tail += v
        elif d >= edges[-1] + width:
            high_tail += v
        else:
            bins[(d - edges[0]) // width] += v
    labels = [str(e) if width == 1 else f"{e}..{e + width - 1}" for e in edges]
    out = list(zip(labels, bins, strict=True))
    if low_tail:
        out.insert(0, (f"<{edges[0]}", low_tail))
    if high_tail:
        out.append((f">{edges[-1] + width - 1}", high_tail))
    return out


def histogram_svg(histogram: dict[str, int], title: str) -> str:
    """An inline SVG bar chart of billing differences (rebuilt ids minus billed tokens)."""
    bins = histogram_bins(histogram)
    if not bins:
        return f"<p>{escape(title)}: no billed samples.</p>"
    peak = max(c for _, c in bins) or 1
    plot_w, plot_h = W - PAD_L - 8, H - PAD_B - PAD_T
    bar_w = plot_w / len(bins)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
             f'aria-label="{escape(title)}">',
             f'<line x1="{PAD_L}" y1="{PAD_T + plot_h}" x2="{W - 8}" y2="{PAD_T + plot_h}" stroke="#555"/>',
             f'<text x="4" y="{PAD_T + 10}" font-size="11">{peak}</text>',
             f'<text x="4" y="{PAD_T + plot_h}" font-size="11">0</text>']
    step = max(1, len(bins) // 10)
    for i, (label, count) in enumerate(bins):
        x = PAD_L + i * bar_w
        h = plot_h * count / peak
        colour = "#c0392b" if label.startswith(("<", ">")) else ("#2e86c1" if label != "0" else "#27ae60")
        parts.append(f'<rect x="{x + 1:.1f}" y="{PAD_T + plot_h - h:.1f}" width="{max(bar_w - 2, 1):.1f}" '
                     f'height="{h:.1f}" fill="{colour}"><title>{escape(label)}: {count}</title></rect>')
        if i % step == 0 or label.startswith(("<", ">")) or label == "0":
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{H - PAD_B + 14}" font-size="10" '
                         f'text-anchor="middle">{escape(label)}</text>')
    parts.append(f'<text x="{PAD_L + plot_w / 2:.0f}" y="{H - 4}" font-size="11" text-anchor="middle">'
                 "rebuilt ids − billed completion tokens</text></svg>")
    return "".join(parts)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _table(head: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


BILLING_COLUMNS = ["samples", "mean_diff", "mean_abs_diff", "mean_rel_diff", "max_diff", "max_sample_id", "outliers"]


def render_html(report: dict[str, Any], title: str = "Audit report", summary: list[str] | None = None) -> str:
    """The whole page as one string."""
    checks = [[name, c["mode"], c["checked"], c["failed"], c["flagged"],
               "; ".join(f"{e['sample_id']}: {e['detail']}" for e in c["examples"][:3])]
              for name, c in report["checks"].items()]
    providers = report.get("by_provider", {})
    billing_rows = [["(all)"] + [report["billing"][k] for k in BILLING_COLUMNS]]
    billing_rows += [[name] + [b["billing"][k] for k in BILLING_COLUMNS] for name, b in providers.items()]
    per_provider = [[name, b["samples"], b["passed"], b["quarantined"], b["flagged"], b["canonical_share"]]
                    for name, b in providers.items()]
    charts = "".join(f"<h3>{escape(name)}</h3>{histogram_svg(b['billing']['histogram'], name)}"
                     for name, b in providers.items() if b["billing"]["samples"])
    gate = report.get("gate")
    gate_html = "" if gate is None else (
        "<p class=ok>Gate: ok</p>" if gate["ok"]
        else "<p class=bad>Gate FAILED: " + escape("; ".join(gate["violations"])) + "</p>")
    summary_html = "".join(f"<li>{escape(line)}</li>" for line in summary or [])
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{escape(title)}</title><style>"
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:60em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:left;font-size:13px}.ok{color:#27ae60}.bad{color:#c0392b;font-weight:bold}"
        "</style></head><body>"
        f"<h1>{escape(title)}</h1><ul>{summary_html}</ul>{gate_html}"
        "<h2>Checks</h2>" + _table(["check", "mode", "checked", "failed", "flagged", "examples"], checks)
        + "<h2>Providers</h2>"
        + _table(["provider", "samples", "passed", "quarantined", "flagged", "canonical share"], per_provider)
        + "<h2>Billing cross-check</h2>" + _table(["provider"] + BILLING_COLUMNS, billing_rows)
        + "<h2>Billing differences per provider</h2>" + (charts or "<p>No billed samples.</p>")
        + "</body></html>\n"
    )
