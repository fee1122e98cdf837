"""The report tells the truth about money and counts: a breached cap is shown, each spend figure names what it
counts, a rate counts only rows generated, a sample quarantined at extraction is not taken for a trained one,
and report.json stays strict JSON when training diverges."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from pipeline.base.config import ChecksConfig
from pipeline.base.layout import RunLayout, atomic_write_json, atomic_write_table, shard_name
from pipeline.base.records import QUARANTINE_SCHEMA, empty_sample, quarantine_row
from pipeline.checks.audit import AuditAccumulator
from pipeline.generate.ledger import Ledger
from pipeline.prompts.read import current_ids
from pipeline.report.html import render_report_html
from pipeline.report.summary import (
    Tally,
    attention_lines,
    extraction_quarantine,
    format_report,
    source_report,
    throughput,
    with_extraction_quarantine,
)
from pipeline.run.status import collect_status, format_status
from tests.unit.test_current_files import _attempt, _file, cfg  # noqa: F401 - the fixture
from tests.unit.test_report_html import full_report


def _breached() -> dict:
    """A resumed run's report: an earlier attempt spent $4.90 on chat, this one $0.104, under a $5.00 cap."""
    led = Ledger(budgets={"chat": "unlimited", "code": 9000}, budgets_usd={"chat": 5.0, "code": 5.0},
                 spent={"code": 9500}, spent_usd={"chat": 4.90, "code": 0.5})
    rep = led.report()
    rep["datasets"]["chat"] |= {"cost": 5.004, "spent_usd": 5.004, "overrun_usd": 0.004, "in_doubt_usd": 0.01}
    rep["violations"] = ["dataset 'chat': spent $5.004000 > budget $5.000000"]
    r = full_report()
    r["this_attempt"] = {"cost_usd": 0.104, "tokens": 12000, "generated": 80}
    r["spend"] = {"api": rep}
    r["sources"]["api"]["left_to_do"] = {}
    r["audit"]["samples"] = 0
    return r


def test_a_breached_cap_needs_attention_in_the_console_and_the_page():
    r = _breached()
    lines = attention_lines(r)
    assert "  ! source api: dataset chat spent $5.0040 > cap $5.0000 ($0.0040 billed beyond what its requests " \
           "reserved)" in lines
    assert "  ! source api: dataset code spent 9500 tokens > cap 9000 tokens" in lines
    assert any("chat: $0.0100 in doubt" in ln for ln in lines)
    page = render_report_html(r)
    assert "dataset chat spent $5.0040 &gt; cap $5.0000" in page
    # a violation the final figures no longer show is still named, in the ledger's words
    quiet = _breached()
    quiet["spend"]["api"]["datasets"] = {}
    assert attention_lines(quiet) == ["  ! source api: budget exceeded: dataset 'chat': spent $5.004000 > budget "
                                      "$5.000000"]


def test_the_spend_table_and_card_show_dollars_beside_their_caps():
    r = _breached()
    del r["spend"]["api"]["datasets"]["code"]
    page = render_report_html(r)
    card = re.search(r"<div class=cv>([^<]*)</div><div class=cl>API spend \(ledger total, all attempts\)", page)
    assert card and card.group(1) == "$5.0040"  # was $5.00: under the cap by the look of it
    assert "<th>budget $</th><th>spent $ (ledger total, all attempts)</th>" in page
    assert "<td>api</td><td>chat</td><td>–</td><td>0</td><td>5.0000</td><td>5.0040</td><td>0.0100</td>" \
           "<td>0.0040</td>" in page and "OVER THE CAP" in page


def test_the_console_gives_one_readable_spend_line_per_dataset():
    r = _breached()
    names = [f"dataset_number_{i}" for i in range(8)]
    led = Ledger(budgets=dict.fromkeys(names, "unlimited"), budgets_usd=dict.fromkeys(names, 1.0),
                 spent_usd=dict.fromkeys(names, 0.25))
    r["spend"]["many"] = led.report()
    text = format_report(r, Path("/out"))
    for name in names:  # the JSON was cut at 300 characters: the last datasets were never shown
        assert f"  spend many {name}: $0.2500 of a $1.0000 cap, 0 tokens (ledger total, all attempts)" in text
    assert "  spend api chat: $5.0040 of a $5.0000 cap, 0 tokens, $0.0100 in doubt" in text
    assert '{"' not in text


def test_each_spend_figure_names_what_it_counts():
    text = format_report(_breached(), Path("/out"))
    assert "  tokens generated 12000 (in passed samples, all attempts)" in text
    assert "  this attempt 80 rows generated, 12000 tokens, $0.1040 billed in its rows\n" in text
    again = _breached()
    again["this_attempt"]["replayed"] = {"samples": 5, "tokens": 600, "cost_usd": 0.005}
    assert "  this attempt 80 rows generated, 12000 tokens, $0.1040 billed in its rows; replayed from the journal: " \
           "5 rows, 600 tokens, $0.0050 (billed in an earlier attempt)" in format_report(again, Path("/out"))
    assert "replayed from the journal (this attempt, paid before)" in render_report_html(again)
    again["this_attempt"]["replayed"] = {"samples": 0, "tokens": 0, "cost_usd": 0.0}
    assert "billed in its rows; replayed from the journal: 0\n" in format_report(again, Path("/out"))
    assert "replayed from the journal" not in render_report_html(again)
    assert "  API spend    $5.5040 (ledger total, all attempts)" in text
    page = render_report_html(_breached())
    assert "API spend (ledger total, all attempts)" in page
    assert "Dollars in passed samples, all attempts" in render_report_html(
        _breached() | {"costs": {"by_dataset": {"chat": {"samples": 1, "usd": 0.1}}}})


def test_the_rate_counts_rows_generated_not_rows_left_to_do():
    t = Tally(1000, AuditAccumulator(ChecksConfig()))
    for _ in range(10):
        t.add({"status": "ok", "source": "api", "output_ids": [1] * 100, "cost": 0.01})
    for _ in range(990):  # a spent budget ends these at once
        t.add({"status": "not_generated", "source": "api", "failure_class": "budget"})
    rates = throughput(t, 10.0)
    assert rates["samples_per_s"] == 1.0 and rates["tokens_per_s"] == 100.0  # was 100 samples/s
    assert throughput(t, 0.0)["samples_per_s"] is None


def test_responses_replayed_from_the_journal_count_as_done_not_as_this_attempts_generation():
    """A resume replays what a killed attempt paid for: those rows are done, but generated (and billed) then, not
    now: they are counted apart, in no rate, no token or dollar figure of this attempt, and no request count."""
    t = Tally(30, AuditAccumulator(ChecksConfig()))
    for _ in range(10):
        t.add({"status": "ok", "source": "api", "ids_from": "rebuilt", "attempts": 1, "output_tokens": 100,
               "cost": 0.01})
    for _ in range(15):  # replayed: no request sent for them in this attempt
        t.add({"status": "ok", "source": "api", "ids_from": "rebuilt", "attempts": 0, "output_tokens": 50,
               "cost": 0.02})
    for _ in range(5):  # a local engine's rows carry no attempts
        t.add({"status": "ok", "source": "vllm", "ids_from": "engine", "attempts": None, "output_tokens": 10})
    assert t.done == 30 and t.served == {"api": 10, "vllm": 5} and t.replayed == {"api": 15}
    assert t.tokens == 1050 and t.cost == pytest.approx(0.1)
    assert (t.replayed_tokens, t.replayed_cost) == (750, pytest.approx(0.3))
    assert t.requests == {"api": 10} and t.asked == {"api": 10}
    rates = throughput(t, 10.0)
    assert rates["samples_per_s"] == 1.5 and rates["tokens_per_s"] == 105.0
    t.progress(final=True)
    assert t.series[-1]["done"] == 30 and t.series[-1]["served"] == {"api": 10, "vllm": 5}
    assert t.snapshot.tokens == 1050 and t.snapshot.cost == pytest.approx(0.1)
    report = source_report([SimpleNamespace(name="api", kind="openrouter"), SimpleNamespace(name="vllm",
                                                                                            kind="vllm")], t)
    assert report["api"]["served"] == 10 and report["api"]["replayed"] == 15 and "replayed" not in report["vllm"]
    text = format_report(_breached() | {"sources": report, "throughput": rates}, Path("/out"))
    assert "  source api (openrouter) generated 10, 15 replayed from the journal" in text


def test_replayed_rows_are_marked_through_the_flight_path(tmp_path):
    """The signal the tally reads survives the real path: an HTTP source in the flight contract replays what an
    earlier actor journaled (``attempts`` 0), the writer's tally columns carry it, and the tally counts those
    rows apart from the ones generated now. A journaled response that no longer reads back is left to do, class
    ``journal``, and the report says what to do about it."""
    import asyncio

    from pipeline.base.config import SamplingConfig
    from pipeline.base.flight import rows_to_table, tally_of
    from pipeline.demo.openrouter_server import CannedBackend, ServerConfig
    from pipeline.generate.sources.http.openrouter import OpenRouterFlight
    from pipeline.profiles import load_profile
    from tests.helpers.server import serve_in_thread
    from tests.unit.test_http_engine_faults import cfg_, rows_

    def flight_run(url: str, rows: list[dict]) -> pa.Table:
        flight = OpenRouterFlight(None, "deepseek", SamplingConfig(), cfg_(url, name="api"), ledger=Ledger(),
                                  layout=RunLayout(tmp_path))

        async def go() -> pa.Table:
            try:
                return await flight(rows_to_table([{**r, "status": "ok"} for r in rows]))
            finally:
                await flight.inner.close()

        return asyncio.run(go())

    rows = rows_(6)
    with serve_in_thread(ServerConfig(seed=3), CannedBackend(1, load_profile("deepseek"))) as (url, server):
        flight_run(url, rows[:3])
        (path,) = RunLayout(tmp_path).responses.glob("*.jsonl")
        lines = path.read_bytes().splitlines(keepends=True)
        lines[2] = json.dumps({**json.loads(lines[2]), "content": 5}).encode() + b"\n"
        path.write_bytes(b"".join(lines))
        out = flight_run(url, rows)
        assert server.counts["requests"] == 6  # 3, then the 3 never asked: none of the journaled ones again
    t = Tally(6, AuditAccumulator(ChecksConfig()))
    for row in tally_of(out).to_pylist():
        t.add(row)
    assert t.done == 6 and t.served == {"api": 3} and t.replayed == {"api": 2}
    assert t.requests == {"api": 3} and t.left == {("api", "journal"): 1}
    ok = [r for r in out.to_pylist() if r["status"] == "ok"]
    assert t.tokens == sum(len(r["output_ids"]) for r in ok if r["attempts"]) and t.replayed_tokens > 0
    lines = attention_lines({"sources": source_report([SimpleNamespace(name="api", kind="openrouter")], t)})
    assert len(lines) == 1 and lines[0].startswith("  ! source api: 1 prompts left to do, the responses "
                                                   "journaled (and paid for) for them unreadable — first: ")
    assert f"{path}, the line at byte" in lines[0] and "content must be a string or null" in lines[0]
    assert "repair or delete that line and re-run" in lines[0]


def test_report_json_is_strict_json_when_training_diverges(tmp_path):
    path = tmp_path / "report.json"
    atomic_write_json(path, {"training": {"metrics": {"step": 80, "loss": float("nan"), "acc_0": float("inf"),
                                                      "acc_1": 0.5}}, "series": [1.0, float("-inf")]})

    def strict(c: str) -> None:
        raise ValueError(c)

    data = json.loads(path.read_text(), parse_constant=strict)
    assert data["training"]["metrics"] == {"step": 80, "loss": None, "acc_0": None, "acc_1": 0.5,
                                          "non_finite": {"loss": "nan", "acc_0": "inf"}}
    assert data["series"] == [1.0, None]
    r = _breached() | {"training": data["training"]}
    line = next(ln for ln in format_report(r, Path("/o")).splitlines() if ln.startswith("  training"))
    assert "loss n/a acc/position [n/a 0.50]" in line and "not finite" in line


@pytest.fixture
def extracted(cfg, tmp_path):  # noqa: F811 - the fixture imported above
    """Three rows passed generation; the extraction then quarantined one of them (too long to train on)."""
    path = _file(tmp_path / "three.jsonl", [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]})
                                            for i in range(3)])
    from pipeline.base.config import DatasetConfig

    cfg.datasets = [DatasetConfig(name="chat", path=str(path))]
    _, made = _attempt(cfg)
    layout = RunLayout(cfg.output_dir)
    layout.quarantine.mkdir(parents=True, exist_ok=True)
    row = quarantine_row(empty_sample({"sample_id": made[0], "dataset": "chat", "row_index": 0}), "extract",
                         "too_long: 9000 tokens")
    atomic_write_table(pa.Table.from_pylist([row], schema=QUARANTINE_SCHEMA), layout.quarantine / shard_name([made[0]]))
    return cfg


def test_a_sample_quarantined_at_extraction_is_counted_apart_everywhere(extracted):
    report, _ = _attempt(extracted)
    assert report["passed"] == 3 and report["quarantined_at_extraction"] == 1
    current = {d.name: current_ids(d, RunLayout(extracted.output_dir)) for d in extracted.datasets}
    assert extraction_quarantine(RunLayout(extracted.output_dir), current) == {"chat": 1}
    # the count made before the extraction ran is replaced by the one after it
    assert with_extraction_quarantine(report, {"chat": 2})["by_dataset"]["chat"]["quarantined_at_extraction"] == 2
    assert report["by_dataset"]["chat"]["quarantined_at_extraction"] == 1
    text = format_report(report | {"throughput": {}, "seconds": {}}, Path("/o"))
    assert "  passed generation 3" in text
    assert "  quarantined at extraction (not trained on) 1 of those passed" in text
    page = render_report_html(report)
    assert "quarantined at extraction (not trained on)" in page and ">passed generation<" in page
    s = collect_status(extracted)
    assert s["totals"]["passed"] == 3 and s["quarantined_at_extraction"] == 1
    assert s["datasets"]["chat"]["quarantined_at_extraction"] == 1
    assert "3 passed generation (1 of them quarantined at extraction, not trained on)" in format_status(s)
