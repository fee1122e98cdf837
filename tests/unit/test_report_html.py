"""report.html: pure figure functions, the throughput snapshots behind one of them, the never-failing
writer, and the page as headless Chromium lays it out (`scripts/setup.sh --tests` installs Chromium)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pipeline.base.config import ChecksConfig
from pipeline.base.layout import RunLayout
from pipeline.checks.audit import AuditAccumulator
from pipeline.report.html import FIGURE_IDS, nice_ticks, render_report_html, write_report_html
from pipeline.report.summary import Tally, format_report
from pipeline.report.throughput import record, windowed_rates

SVG = re.compile(r"<svg\b.*?</svg>", re.S)


def metrics_rows(steps: int = 30, k: int = 3) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        r = {"step": s, "epoch": 0, "loss": 10.0 / s, "lr": 1e-3 * min(1.0, s / 5), "tokens_per_s": 1000.0 + s}
        for i in range(k):
            r[f"loss_{i}"] = (3 + i) / s
            r[f"acc_{i}"] = min(0.9, s / 40) * (0.8 ** i)
        rows.append(r)
    return rows


def full_report() -> dict:
    series: list[dict] = []
    for i in range(1, 80):
        record(series, i * 0.75, 3 * i, 150 * i, {"vllm": 2 * i, "api": i})
    record(series, 60.0, 240, 12000, {"vllm": 160, "api": 80}, final=True)
    billing = {"samples": 782, "mean_abs_diff": 0.4, "outliers": 2,
               "histogram": {"-40": 1, "-1": 60, "0": 600, "1": 100, "2": 20, "250": 1}}
    return {
        "rows_in": 250, "passed": 240, "quarantined": 6, "not_generated": 4, "tokens_generated": 12000,
        "quarantine_reasons": {"roundtrip": 3, "malformed row": 2, "api: HTTP 400 context length exceeded": 1},
        "quarantine_by_stage": {"read": 2, "validate": 3, "generate": 1}, "flagged": {"truncated": 5},
        "this_attempt": {"cost_usd": 0.12}, "by_dataset": {"chat": {"rows": 250, "passed": 240, "quarantined": 6}},
        "sources": {"vllm": {"kind": "vllm", "served": 160, "spilled": 3, "left_to_do": {}, "start_error": None},
                    "api": {"kind": "openrouter", "served": 80, "spilled": 0, "left_to_do": {"budget": 4},
                            "start_error": None, "requests": 90, "retried": 10}},
        "spend": {"api": {"datasets": {"chat": {"budget": 9000, "spent": 9000, "cost": 0.12}}, "halted": None}},
        "audit": {"checks": {"billing": {"mode": "flag", "checked": 80, "failed": 0, "flagged": 2}},
                  "billing": billing,
                  "by_provider": {"Alpha": {"billing": dict(billing, samples=50)},
                                  "Beta": {"billing": dict(billing, samples=30)}}},
        "throughput": {"samples_per_s": 4.0, "tokens_per_s": 200.0, "series": series},
        "seconds": {"read": 0.1, "generate": 60.0, "extract+train": 30.0, "total": 95.0},
        "training": {"metrics": {"step": 30}, "export_dir": "/out/drafter/export",
                     "heldout": {"samples": 6, "k": 3, "acceptance_length": 2.1, "per_position": [0.6, 0.35, 0.15],
                                 "by_dataset": [{"name": "chat", "samples": 4, "drafts": 40, "acceptance_length": 2.4,
                                                 "se": 0.1, "per_position": [0.7, 0.45, 0.25], "few": False},
                                                {"name": "code", "samples": 2, "drafts": 20, "acceptance_length": 1.5,
                                                 "se": 0.2, "per_position": [0.4, 0.1, 0.0], "few": True}]}},
    }


# value.json as `python -m pipeline value` writes it (the fields report.html reads)
VALUE = {"steps": 40, "mix": {"chat": 0.6, "code": 0.4}, "datasets": {
    "chat": {"points": [{"usd": 0.0, "acceptance": 1.8}, {"usd": 0.5, "acceptance": 2.2},
                        {"usd": 1.0, "acceptance": 2.3}],
             "fit_line": [[0.0, 1.8], [0.5, 2.18], [1.0, 2.31]]},
    "code": {"points": [{"usd": 0.0, "acceptance": 2.0}, {"usd": 2.0, "acceptance": 2.3}], "fit_line": []}}}


def svgs(page: str) -> dict[str, ET.Element]:
    """Every figure of the page by id, each parsed as XML (so each is well-formed on its own)."""
    out = {}
    for m in SVG.finditer(page):
        el = ET.fromstring(m.group(0))
        out[el.get("id")] = el
    return out


NS = "{http://www.w3.org/2000/svg}"


def test_every_figure_is_drawn_from_a_full_report():
    page = render_report_html(full_report(), metrics_rows(), subtitle="/out")
    figs = svgs(page)
    assert set(FIGURE_IDS) <= set(figs)
    assert {"fig-billing-provider-0", "fig-billing-provider-1"} <= set(figs)
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # nothing fetched from elsewhere
    assert "<script" not in page and "<link" not in page and "<img" not in page
    for fig_id, el in figs.items():
        assert el.find(f"{NS}title").text, fig_id
    # bars: one per quarantine reason, one per held-out position; lines: one per TTT position / source
    reasons = figs["fig-quarantine-reasons"].findall(f"{NS}rect")
    assert len(reasons) == 3
    assert [r.find(f"{NS}title").text for r in figs["fig-heldout"].findall(f"{NS}rect")] == [
        "draft 1: 60.0%", "draft 2: 35.0%", "draft 3: 15.0%"]
    lines = {fig: [p.get("data-series") for p in figs[fig].iter(f"{NS}polyline")]
             for fig in ("fig-train-loss", "fig-train-acc", "fig-throughput", "fig-throughput-cumulative")}
    assert lines["fig-train-loss"] == lines["fig-train-acc"] == ["position 0", "position 1", "position 2"]
    assert lines["fig-throughput"] == ["api", "vllm", "all rows"]
    assert lines["fig-throughput-cumulative"] == ["api", "vllm"]
    billing = [r.find(f"{NS}title").text for r in figs["fig-billing"].findall(f"{NS}rect")]
    assert "0: 600" in billing and any(t.startswith("<") for t in billing) and any(t.startswith(">") for t in billing)


def test_the_heldout_figure_sets_the_served_figure_beside_the_simulated_one():
    report = full_report()
    report["training"]["served"] = {"k": 3, "prompts": 6, "acceptance_length": 2.0, "per_position": [0.6, 0.3, 0.1],
                                    "drafts": 40}
    fig = svgs(render_report_html(report, []))["fig-heldout"]
    assert [r.find(f"{NS}title").text for r in fig.findall(f"{NS}rect")] == [
        "1 sim: 60.0%", "1 vLLM: 60.0%", "2 sim: 35.0%", "2 vLLM: 30.0%", "3 sim: 15.0%", "3 vLLM: 10.0%"]
    assert "served by vLLM 2.000" in fig.find(f"{NS}title").text


def test_the_billing_section_tables_spend_per_dataset_and_source():
    from pipeline.report.costs import cost_table

    report = full_report()
    rows = [{"dataset": "chat", "source": "api", "cost": 0.25, "output_ids": [1, 2]},
            {"dataset": "code", "source": "vllm", "engine_s": 7200.0, "output_ids": [1]}]
    report["costs"] = cost_table(rows, {"vllm": 2.5})
    page = render_report_html(report, [])
    assert "<th>device-hours</th>" in page and "<th>API billed $</th>" in page
    assert "<td>dataset</td><td>code</td><td>1</td><td>1</td><td>0</td><td>2</td><td>5</td><td>5</td>" in page
    assert "<td>source</td><td>api</td><td>1</td><td>2</td><td>0.25</td>" in page
    assert "device-hours" not in render_report_html(full_report(), [])  # an older report: no table, no error


def test_an_empty_or_partial_report_still_draws_every_figure_with_a_reason():
    for report in ({}, {"training": {"skipped": "training is off"}, "throughput": {"series": [{"t": 1.0}]}}):
        page = render_report_html(report, [])
        figs = svgs(page)
        assert set(FIGURE_IDS) <= set(figs)
    assert "training is off" in "".join(figs["fig-heldout"].itertext())
    assert "no training metrics" in "".join(figs["fig-train-loss"].itertext())


def test_text_is_escaped():
    report = full_report()
    report["quarantine_reasons"] = {"<script>alert(1)</script> & more": 1}
    page = render_report_html(report, [])
    assert "<script>" not in page and "&lt;script&gt;" in page
    svgs(page)  # still well-formed XML


def test_nice_ticks_cover_the_range_with_round_steps():
    assert nice_ticks(0, 6.9) == [0, 2, 4, 6, 8]
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0, 2072) == [0, 500, 1000, 1500, 2000, 2500]
    assert nice_ticks(5, 5) == [5, 6, 7, 8, 9, 10]  # a flat series still gets an axis


def test_throughput_snapshots_are_throttled_thinned_and_final():
    series: list[dict] = []
    for i in range(10_000):  # a batch every 0.1 s for 1000 s
        record(series, i * 0.1, i, 10 * i, {"a": i, "b": 0}, max_points=50)
    record(series, 1000.0, 10_000, 100_000, {"a": 10_000}, final=True, max_points=50)
    assert 20 <= len(series) <= 100
    assert series[0]["t"] == 0.0 and series[-1] == {"t": 1000.0, "done": 10_000, "tokens": 100_000,
                                                   "served": {"a": 10_000}}
    assert all(b["t"] > a["t"] for a, b in zip(series, series[1:], strict=False))
    assert "b" not in series[-2]["served"]  # sources with nothing served are left out


def test_windowed_rates():
    pts = [(0.0, 0), (1.0, 10), (2.0, 20), (3.0, 20), (4.0, 20)]
    assert windowed_rates(pts, 2.0) == [(1.0, 10.0), (2.0, 10.0), (3.0, 5.0), (4.0, 0.0)]


def test_the_tally_records_snapshots_and_the_console_does_not_print_them():
    tally = Tally(10, AuditAccumulator(ChecksConfig()))
    tally.served["vllm"] += 3
    tally.status["ok"] += 3
    tally.progress(final=True)
    assert len(tally.series) == 1 and tally.series[0]["done"] == 3 and tally.series[0]["served"] == {"vllm": 3}
    r = {"rows_in": 10, "passed": 3, "quarantined": 0, "quarantine_by_stage": {}, "not_generated": 0, "flagged": {},
         "tokens_generated": 0, "this_attempt": {"cost_usd": 0.0}, "seconds": {}, "audit": {"samples": 0},
         "throughput": {"samples_per_s": 1.0, "tokens_per_s": 2.0, "series": tally.series}}
    text = format_report(r, Path("/out"))
    assert "'samples_per_s': 1.0" in text and "series" not in text


def test_write_report_html_writes_beside_report_json_and_never_raises(tmp_path, caplog):
    layout = RunLayout(tmp_path)
    layout.drafter.mkdir()
    layout.metrics.write_text("".join(json.dumps(r) + "\n" for r in metrics_rows()) + '{"step": 31, "lo')  # torn
    assert write_report_html(layout, full_report()) == tmp_path / "report.html"
    assert set(FIGURE_IDS) <= set(svgs(layout.report_html.read_text()))
    assert write_report_html(layout, {"sources": ["not", "a", "dict"]}) is None  # logged, not raised
    assert "report.html not written" in caplog.text
    assert write_report_html(RunLayout(tmp_path / "missing" / "folder"), full_report()) is None


# ----------------------------------------------------------------------------- in a real browser

MEASURE = """<script>
const out = {};
for (const svg of document.querySelectorAll('svg[id]')) {
  const box = svg.getBoundingClientRect();
  out[svg.id] = {w: box.width, h: box.height, title: svg.querySelector('title').textContent,
                 marks: svg.querySelectorAll('rect:not(.none), polyline').length};
}
const pre = document.createElement('pre');
pre.id = 'measured';
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script>"""


def chromium() -> str:
    exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if exe is None:  # not a skip: a page nobody opened is not a tested page
        pytest.fail("Chromium not found: `bash scripts/setup.sh --tests` installs it "
                    "(apt-get install -y --no-install-recommends chromium)")
    return exe


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_chromium_lays_out_every_figure(tmp_path):
    layout = RunLayout(tmp_path)
    layout.drafter.mkdir()
    layout.metrics.write_text("".join(json.dumps(r) + "\n" for r in metrics_rows()))
    layout.value.mkdir()
    layout.value_report.write_text(json.dumps(VALUE))
    assert write_report_html(layout, full_report())
    page = layout.report_html.read_text()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", MEASURE + "</body>"))

    res = run_chromium(tmp_path, "--window-size=1050,1000", "--dump-dom", probe.as_uri())
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r'<pre id="measured">(.*?)</pre>', res.stdout, re.S)
    assert m, res.stdout[-2000:]
    figs = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                      .replace("&gt;", ">"))
    assert set(FIGURE_IDS) <= set(figs)
    for fig_id in FIGURE_IDS:
        f = figs[fig_id]
        assert f["w"] > 300 and f["h"] > 80, (fig_id, f)  # laid out at a readable size
        assert f["marks"] > 0, (fig_id, f)  # bars or lines drawn
        assert f["title"], fig_id
    assert figs["fig-heldout"]["title"].startswith("Held-out acceptance per draft position")
    assert figs["fig-heldout-datasets"]["title"].startswith("Held-out acceptance per dataset")
    assert figs["fig-heldout-datasets"]["marks"] == 2  # a bar per dataset

    shot = tmp_path / "report.png"
    res = run_chromium(tmp_path, "--window-size=1050,3800", f"--screenshot={shot}", layout.report_html.as_uri())
    assert res.returncode == 0 and shot.stat().st_size > 20_000, res.stderr[-2000:]


def test_value_curves_and_the_plan_have_their_section():
    """The value curves figure says how to make it until value.json exists; then it draws each dataset's points
    and its fit line as value.json carries them, and the plan's first line and rows follow it."""
    empty = svgs(render_report_html(full_report(), []))["fig-value-curves"]
    assert "python -m pipeline value" in ET.tostring(empty, encoding="unicode")
    plan = {"datasets": [{"dataset": "chat", "add_usd": 1.5, "add_samples": 30, "usd_per_sample": 0.05,
                          "gain": 0.12, "room": 100, "extrapolated": False}],
            "lines": ["[plan] $1.5 more: predicted mix acceptance 2.300 -> 2.420 (+0.120 ± 0.040)"]}
    page = render_report_html(full_report(), [], value=VALUE, plan=plan)
    fig = svgs(page)["fig-value-curves"]
    drawn = {p.get("data-series"): p.get("points").split() for p in fig.iter(f"{NS}polyline")}
    assert set(drawn) == {"chat", "chat fit", "code"} and len(drawn["chat fit"]) == 3
    assert "chat 60%" in ET.tostring(fig, encoding="unicode")
    assert "$1.5 more: predicted mix acceptance 2.300 -&gt; 2.420" in page and "<td>30</td>" in page


def test_a_value_or_plan_file_of_another_shape_is_said_not_raised():
    bad_value = {"steps": 1, "datasets": {"chat": 5}}
    fig = svgs(render_report_html(full_report(), [], value=bad_value))["fig-value-curves"]
    assert "not drawn" in ET.tostring(fig, encoding="unicode")
    page = render_report_html(full_report(), [], plan={"datasets": ["not a row"]})
    assert "value/plan.json not shown" in page


def test_rows_set_aside_and_an_engine_that_left_prompts_are_named_for_attention():
    report = full_report() | {"not_in_current_files": {"samples": 3, "quarantined": 1}}
    report["sources"] = {"vllm": {"kind": "vllm", "served": 0, "left_to_do": {"engine": 5},
                                  "engine_error": "engine error: RuntimeError: boom (on every prompt of a batch)"}}
    page = render_report_html(report, [])
    assert "not in the current files: 3 samples, 1 quarantined" in page
    assert "source vllm: engine error: RuntimeError: boom" in page and "5 prompts left to do" in page
    assert "not in the current files" not in render_report_html(full_report(), [])
