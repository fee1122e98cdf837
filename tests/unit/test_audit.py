"""Run report and `audit`: known samples give known figures; shards on disk reproduce them; bad shards are named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base.config import ChecksConfig
from pipeline.base.records import QUARANTINE_SCHEMA, SAMPLE_SCHEMA, quarantine_row
from pipeline.checks.audit import (
    AuditAccumulator,
    ShardError,
    audit_samples,
    check_schema,
    gate,
    main,
    read_samples,
    sample_shards,
    summary_lines,
)
from pipeline.checks.audit_html import histogram_bins, render_html
from pipeline.checks.validate import validate_sample
from tests.unit.test_validate import CFG, WEATHER, P, _noncanonical, api_sample, engine_sample, good_ids

LONG = " ".join(f"step {i} of the plan" for i in range(60))


def known_samples() -> list[dict[str, Any]]:
    """Five billed samples (diffs 0, +1, -1 on prov-a; 0, +65 on prov-b), two engine ones, one loop."""
    return [
        api_sample("a-0", diff=0, provider="prov-a"),
        api_sample("a-1", reasoning=LONG, diff=1, provider="prov-a"),
        api_sample("a-2", reasoning=LONG, diff=-1, provider="prov-a", dataset="math"),
        api_sample("b-0", diff=0, provider="prov-b"),
        api_sample("b-1", reasoning=LONG + " " + LONG, diff=65, provider="prov-b"),
        engine_sample("e-0", good_ids()),
        engine_sample("e-1", _noncanonical()),
        engine_sample("e-2", good_ids(reasoning="Again and again and again. " * 12)),
    ]


def accumulate(samples: list[dict[str, Any]], cfg: ChecksConfig = CFG) -> AuditAccumulator:
    acc = AuditAccumulator(cfg)
    for s in samples:
        acc.add(s, validate_sample(s, P, cfg))
    return acc


def test_report_figures_on_known_samples() -> None:
    samples = known_samples()
    r = accumulate(samples).report()
    # b-1's rebuilt ids are 65 tokens off its bill (over both thresholds): quarantined by default.
    assert (r["samples"], r["passed"], r["quarantined"], r["flagged"]) == (8, 6, 2, 1)
    assert r["checks"]["repetition"] == {"mode": "quarantine", "checked": 8, "failed": 1, "flagged": 0,
                                         "examples": [r["checks"]["repetition"]["examples"][0]]}
    assert r["checks"]["repetition"]["examples"][0]["sample_id"] == "e-2"
    billing = r["checks"]["billing"]
    assert (billing["mode"], billing["checked"], billing["failed"], billing["flagged"]) == ("quarantine", 5, 1, 0)
    assert billing["examples"][0]["sample_id"] == "b-1"
    assert (r["checks"]["roundtrip"]["flagged"], r["checks"]["structure"]["failed"]) == (1, 0)
    assert r["ids_from"] == {"engine": 3, "rebuilt": 5}

    billed = sum(s["billed_completion_tokens"] for s in samples[:5])
    b = r["billing"]
    assert b["samples"] == 5 and b["billed_tokens"] == billed
    assert b["output_tokens"] == sum(len(s["output_ids"]) for s in samples[:5])
    assert b["mean_diff"] == pytest.approx(65 / 5)
    assert b["mean_abs_diff"] == pytest.approx(67 / 5)
    assert b["mean_rel_diff"] == pytest.approx(67 / billed)
    assert (b["max_abs_diff"], b["max_diff"], b["max_sample_id"]) == (65, 65, "b-1")
    assert (b["outliers"], b["outlier_ids"]) == (1, ["b-1"])
    assert b["histogram"] == {"-1": 1, "0": 2, "1": 1, "65": 1}

    assert r["canonical_share"] == pytest.approx(7 / 8)
    assert r["canonical"]["engine"] == {"checked": 3, "canonical": 2, "share": pytest.approx(2 / 3)}
    assert r["canonical"]["rebuilt"]["share"] == 1.0

    a, pb, eng = r["by_provider"]["prov-a"], r["by_provider"]["prov-b"], r["by_provider"]["vllm"]
    assert (a["samples"], a["billing"]["mean_diff"], a["billing"]["mean_abs_diff"]) == (3, 0, pytest.approx(2 / 3))
    assert (a["billing"]["outliers"], a["billing"]["max_abs_diff"]) == (0, 1)
    assert (pb["billing"]["mean_diff"], pb["billing"]["max_sample_id"], pb["billing"]["outliers"]) == (32.5, "b-1", 1)
    assert (eng["billing"]["samples"], eng["billing"]["mean_diff"], eng["quarantined"]) == (0, None, 1)
    assert (pb["quarantined"], a["quarantined"]) == (1, 0)
    flag = accumulate(samples, ChecksConfig(billing="flag")).report()  # the mode before billing quarantined
    assert (flag["passed"], flag["quarantined"], flag["flagged"]) == (7, 1, 2)
    assert r["by_dataset"]["math"]["samples"] == 1 and r["by_dataset"]["chat"]["samples"] == 7


def test_billing_figures_exist_even_with_the_check_off() -> None:
    r = accumulate(known_samples(), ChecksConfig(billing="off")).report()
    assert r["checks"]["billing"]["checked"] == 0
    assert (r["billing"]["samples"], r["billing"]["outliers"], r["billing"]["max_sample_id"]) == (5, 1, "b-1")


def test_merged_workers_report_like_one() -> None:
    samples = known_samples()
    one = accumulate(samples).report()
    merged = accumulate(samples[:3]).merge(accumulate(samples[3:6])).merge(accumulate(samples[6:])).report()
    assert merged == one


def test_gate_counts_quarantine_failures_by_default_and_detections_when_limited() -> None:
    r = accumulate(known_samples()).report()
    g = gate(r, CFG)
    assert not g["ok"] and g["violations"] == ["billing: 1 > 0", "repetition: 1 > 0"]
    # Flag-mode detections are free by default: only quarantine-mode ones (failed) count.
    assert g["checks"]["roundtrip"] == {"counts": "failed", "count": 0, "max": 0, "ok": True}
    flag = ChecksConfig(billing="flag")
    assert gate(accumulate(known_samples(), flag).report(), flag)["violations"] == ["repetition: 1 > 0"]
    cfg = ChecksConfig(billing="flag", max_failures={"repetition": 1, "billing": 0})
    assert gate(accumulate(known_samples(), cfg).report(), cfg)["violations"] == ["billing: 1 > 0"]


def test_summary_lines_read_like_a_data_report() -> None:
    r = accumulate(known_samples()).report()
    r["gate"] = gate(r, CFG)
    text = "\n".join(summary_lines(r))
    assert "8 responses checked: 6 passed, 2 quarantined, 1 flagged" in text
    assert "structure: 0 structural issues in 8 checked" in text
    assert "canonical share: 87.50% (engine 2/3, rebuilt 5/5)" in text
    assert "rebuilt token counts match billing within 13.4 tokens on average" in text
    assert "max +65 (sample b-1); 1 outlier" in text
    assert "  prov-a: 3 billed" in text
    assert "gate: FAILED (billing: 1 > 0; repetition: 1 > 0)" in text


# -- shards -------------------------------------------------------------------


def write_shard(path: Path, rows: list[dict[str, Any]], schema: pa.Schema = SAMPLE_SCHEMA) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_audit_of_a_known_shard_reproduces_its_figures(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    samples = [s for s in known_samples() if s["sample_id"] != "e-2"]
    write_shard(tmp_path / "run" / "samples" / "part-a.parquet", samples[:4])
    write_shard(tmp_path / "run" / "samples" / "part-b.parquet", samples[4:])
    quarantined = known_samples()[-1]
    write_shard(tmp_path / "run" / "quarantine" / "part-q.parquet",
                [quarantine_row(quarantined, "validate", "repetition")], QUARANTINE_SCHEMA)
    out_json, out_html = tmp_path / "report.json", tmp_path / "report.html"
    checks = tmp_path / "checks.yaml"
    checks.write_text("billing: flag\n")  # the shard was validated with billing flagging: b-1 passed

    rc = main([str(tmp_path / "run"), "--json", str(out_json), "--html", str(out_html), "--checks", str(checks)])
    assert rc == 0
    report = json.loads(out_json.read_text())
    expected = accumulate(samples, ChecksConfig(billing="flag")).report()
    for key in ("samples", "passed", "quarantined", "billing", "by_provider", "canonical_share", "checks"):
        assert report[key] == expected[key], key
    assert report["samples"] == 7 and report["billing"]["max_sample_id"] == "b-1"
    assert report["gate"]["ok"] and len(report["shards"]) == 2
    assert report["skipped_quarantine_shards"] == [str(tmp_path / "run" / "quarantine" / "part-q.parquet")]
    assert "7 responses checked: 7 passed, 0 quarantined" in capsys.readouterr().out

    html = out_html.read_text()
    assert html.count("<svg") == 2 and "prov-a" in html and "prov-b" in html
    assert "<script" not in html and " src=" not in html and "<link" not in html


def test_audit_gate_fails_on_a_bad_sample_and_limits_are_configurable(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    bad = engine_sample("bad-1", good_ids()[:-1], truncated=False)  # no end-of-turn, not truncated
    shard = write_shard(tmp_path / "one.parquet", [api_sample("ok-1"), bad])
    assert main([str(shard)]) == 1
    assert "gate: FAILED (structure: 1 > 0)" in capsys.readouterr().out
    assert main([str(shard), "--max-failures", "structure=1"]) == 0
    checks = tmp_path / "checks.yaml"
    checks.write_text("structure: flag\n")
    assert main([str(shard), "--checks", str(checks)]) == 0
    checks.write_text("structure: flag\nmax_failures: {structure: 0}\n")
    assert main([str(shard), "--checks", str(checks)]) == 1


def test_audit_gates_on_billing_by_default(tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "s.parquet", [api_sample("x", diff=-30, provider="cheap-fp4")])
    assert main([str(shard)]) == 1  # billing quarantines by default: one failure is over the gate
    assert main([str(shard), "--max-failures", "billing=1"]) == 0
    checks = tmp_path / "checks.yaml"
    checks.write_text("billing: flag\n")
    assert main([str(shard), "--checks", str(checks)]) == 0
    assert main([str(shard), "--checks", str(checks), "--max-failures", "billing=0"]) == 1


def test_audit_gates_on_rebuild_by_its_mode(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A row whose rebuilt ids the text and bill do not pin down: the rebuild check's mode is the dataset's, and
    the gate knows the check like any other (a limit by name, flag-mode detections free without one)."""
    doubtful = api_sample("d", reasoning=None, diff=-5)  # thinking on, none returned, 5 billed tokens not in ids
    shard = write_shard(tmp_path / "d.parquet", [api_sample("ok-1"), doubtful])
    assert main([str(shard)]) == 1
    assert "gate: FAILED (rebuild: 1 > 0)" in capsys.readouterr().out
    assert main([str(shard), "--max-failures", "rebuild=1"]) == 0
    checks = tmp_path / "checks.yaml"
    checks.write_text("rebuild: flag\n")
    assert main([str(shard), "--checks", str(checks), "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["checks"]["rebuild"] == {**report["checks"]["rebuild"], "mode": "flag", "failed": 0, "flagged": 1}
    assert (report["passed"], report["quarantined"], report["flagged"]) == (2, 0, 1)
    assert main([str(shard), "--checks", str(checks), "--max-failures", "rebuild=0"]) == 1
    checks.write_text("rebuild: off\n")
    assert main([str(shard), "--checks", str(checks), "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["checks"]["rebuild"]["checked"] == 0 and report["passed"] == 2


def test_tool_samples_audit_clean(tmp_path: Path) -> None:
    from pipeline.profiles.base import tool_call

    call = tool_call("get_weather", {"city": "Oslo"}, "call_0")
    shard = write_shard(tmp_path / "t.parquet", [api_sample("t", content="", calls=[call], tools=WEATHER,
                                                            finish="tool_calls")])
    report = audit_samples(read_samples([shard]), P, CFG)
    assert report["gate"]["ok"] and report["passed"] == 1


def _rows() -> list[dict[str, Any]]:
    return [api_sample("m-1"), api_sample("m-2")]


def test_missing_column_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    schema = pa.schema([f for f in SAMPLE_SCHEMA if f.name != "output_ids"])
    rows = [{k: v for k, v in r.items() if k != "output_ids"} for r in _rows()]
    write_shard(tmp_path / "m.parquet", rows, schema)
    assert main([str(tmp_path)]) == 2
    assert "missing column 'output_ids'" in capsys.readouterr().err


@pytest.mark.parametrize("column, arrow_type, convert", [
    ("output_ids", pa.string(), lambda v: json.dumps(v)),
    ("billed_completion_tokens", pa.float64(), float),
    ("output_ids", pa.list_(pa.float32()), lambda v: [float(x) for x in v]),
])
def test_wrong_type_is_named(tmp_path: Path, column: str, arrow_type: pa.DataType, convert: Any) -> None:
    schema = SAMPLE_SCHEMA.set(SAMPLE_SCHEMA.get_field_index(column), pa.field(column, arrow_type))
    rows = [{**r, column: convert(r[column])} for r in _rows()]
    shard = write_shard(tmp_path / "w.parquet", rows, schema)
    with pytest.raises(ShardError, match=rf"column '{column}' has type .*expected"):
        check_schema(shard)


def test_compatible_widths_are_accepted(tmp_path: Path) -> None:
    """int64 ids or large strings read back as the same Python values: not an error."""
    schema = SAMPLE_SCHEMA.set(SAMPLE_SCHEMA.get_field_index("output_ids"),
                               pa.field("output_ids", pa.list_(pa.int64())))
    schema = schema.set(schema.get_field_index("content"), pa.field("content", pa.large_string()))
    shard = write_shard(tmp_path / "c.parquet", _rows(), schema)
    assert audit_samples(read_samples([shard]), P, CFG)["passed"] == 2


def test_null_in_a_required_column_is_named(tmp_path: Path) -> None:
    rows = _rows()
    rows[1]["output_ids"] = None
    shard = write_shard(tmp_path / "n.parquet", rows)
    with pytest.raises(ShardError, match=r"row 1: column 'output_ids' is null"):
        list(read_samples([shard]))


def test_unusable_paths(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ShardError, match="not a readable Parquet file"):
        sample_shards(tmp_path)
    with pytest.raises(ShardError, match="no such file"):
        sample_shards(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no sample shards" in capsys.readouterr().err
    assert main([str(tmp_path / "empty"), "--max-failures", "structure"]) == 2
    assert main(["--bogus-flag"]) == 2


# -- HTML ---------------------------------------------------------------------


def test_histogram_bins_fold_far_outliers_into_edge_bins() -> None:
    hist = {"0": 900, "1": 50, "-1": 40, "2": 9, "5000": 1}
    bins = histogram_bins(hist)
    assert sum(c for _, c in bins) == 1000
    assert bins[-1] == (">5", 1) and dict(bins)["0"] == 900
    wide = histogram_bins({str(d): 1 for d in range(-300, 301)})
    assert len(wide) <= 41 and sum(c for _, c in wide) == 601 and ".." in wide[len(wide) // 2][0]
    assert histogram_bins({}) == []


def test_html_escapes_names_and_handles_no_billing() -> None:
    s = engine_sample("<script>", good_ids())
    s["provider"] = "<b>evil</b>"
    html = render_html(accumulate([s]).report(), title="t & co")
    assert "<b>evil</b>" not in html and "&lt;b&gt;evil&lt;/b&gt;" in html and "t &amp; co" in html
    assert "No billed samples." in html


def test_the_run_audit_judges_each_dataset_by_its_own_checks():
    """Two datasets with different billing thresholds: each sample's outlier call uses its own dataset's."""
    from pipeline.base.config import ChecksConfig, DatasetConfig
    from pipeline.checks.validate import Verdict
    from pipeline.report.summary import audit_for

    strict = ChecksConfig(billing="off", billing_abs_threshold=1, billing_rel_threshold=0.0)
    loose = ChecksConfig(billing="off", billing_abs_threshold=100, billing_rel_threshold=5.0)
    audit = audit_for([DatasetConfig(name="a", path="a.jsonl", checks=strict),
                       DatasetConfig(name="b", path="b.jsonl", checks=loose)])
    for ds in ("a", "b"):
        sample = {"sample_id": f"{ds}:1", "dataset": ds, "provider": "p", "output_ids": list(range(20)),
                  "billed_completion_tokens": 10, "ids_from": "rebuilt"}
        audit.add(sample, Verdict(failed={}, flagged={}, ran=[]))
    rep = audit.report()
    assert rep["by_dataset"]["a"]["billing"]["outliers"] == 1
    assert rep["by_dataset"]["b"]["billing"]["outliers"] == 0
    assert rep["by_dataset"]["a"]["checks"]["billing"]["mode"] == "off"
