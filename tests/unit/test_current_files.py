"""Prompt files edited between attempts (a malformed row repaired, ``max_rows`` lowered, a dataset removed): the
accounting is over the rows the files give now; rows of other ids stay on disk, set aside and reported, and the
folder still resumes and finishes (no ``ConservationError``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.base.config import DatasetConfig
from pipeline.base.layout import RunLayout, atomic_write_table, shard_name
from pipeline.base.records import SAMPLE_SCHEMA, empty_sample, read_ids
from pipeline.prompts.read import TO_DO, index_dataset, read_finished_ids, todo_rows
from pipeline.report.summary import Tally, account, audit_for, format_report
from pipeline.run.job import run_summary
from pipeline.run.status import collect_status, format_status, is_finished
from tests.helpers.configs import formats_config

GOOD = '{"messages": [{"role": "user", "content": "a"}]}'


@pytest.fixture
def cfg(repo_root: Path, tmp_path: Path):
    cfg = formats_config(repo_root, tmp_path)
    cfg.training = None
    return cfg


def _file(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{ln}\n" for ln in lines))
    return path


def _attempt(cfg) -> tuple[dict, list[str]]:
    """One attempt as ``job._run`` makes it, without Ray: the index pass, every row left generated (a sample
    written as the shard writer writes it), then the report's figures checked for conservation."""
    layout = RunLayout(cfg.output_dir)
    layout.samples.mkdir(parents=True, exist_ok=True)
    done = read_finished_ids(layout)
    counts: Counter = Counter()
    made = []
    for d in cfg.datasets:
        counts.update(index_dataset(d, layout, done, {}))
        for row in list(todo_rows(d, done, index=layout.prompt_index(d.name))):
            s = empty_sample(row) | {"source": "x", "output_ids": [1, 2]}
            atomic_write_table(pa.Table.from_pylist([s], schema=SAMPLE_SCHEMA),
                               layout.samples / shard_name([s["sample_id"]]))
            made.append(row["sample_id"])
    counts.pop(TO_DO)
    counts["resumed_done"] = len(done)
    tally = Tally(0, audit_for(cfg.datasets))
    tally.status["ok"] += len(made)
    return run_summary(cfg, layout, tally, counts), made


def _figures(report: dict) -> dict:
    return {k: report[k] for k in ("rows_in", "passed", "quarantined", "not_generated", "not_in_current_files")}


def test_a_repaired_row_is_to_do_and_the_resume_finishes(cfg, tmp_path):
    path = _file(tmp_path / "edit.jsonl", [GOOD, '{"messages": [{"role": "user"'])  # row 1 cut short
    cfg.datasets = [DatasetConfig(name="chat", path=str(path))]
    report, made = _attempt(cfg)
    assert len(made) == 1 and report["quarantined"] == 1 and report["passed"] == 1
    bad_id = next(iter(read_ids(RunLayout(cfg.output_dir).quarantine)))

    _file(path, [GOOD, '{"messages": [{"role": "user", "content": "b"}]}'])  # the user repairs row 1
    s = collect_status(cfg)
    assert s["totals"] == {"rows": 2, "passed": 1, "quarantined": 0, "to_do": 1}
    assert s["not_in_current_files"] == {"samples": 0, "quarantined": 1}
    assert "not in the current files: 0 samples, 1 quarantined" in format_status(s) and not is_finished(s)

    report, made = _attempt(cfg)  # raised ConservationError (rows in 2 != passed 2 + quarantined 1)
    assert len(made) == 1 and made[0] != bad_id
    assert _figures(report) == {"rows_in": 2, "passed": 2, "quarantined": 0, "not_generated": 0,
                                "not_in_current_files": {"samples": 0, "quarantined": 1}}
    assert report["quarantine_by_stage"] == {} and report["by_dataset"]["chat"] == {
        "rows": 2, "passed": 2, "quarantined": 0, "quarantined_at_extraction": 0}
    assert "not in the current files: 0 samples, 1 quarantined" in format_report(report | {
        "throughput": {}, "seconds": {}}, Path(cfg.output_dir))
    assert bad_id in read_ids(RunLayout(cfg.output_dir).quarantine)  # set aside, never deleted
    s = collect_status(cfg)
    assert s["totals"] == {"rows": 2, "passed": 2, "quarantined": 0, "to_do": 0} and is_finished(s)
    assert _attempt(cfg)[1] == []  # and every later resume finishes too, with nothing to do


def test_lowering_max_rows_counts_only_the_rows_within_it(cfg, tmp_path):
    path = _file(tmp_path / "four.jsonl", [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]})
                                           for i in range(4)])
    cfg.datasets = [DatasetConfig(name="chat", path=str(path), max_rows=4)]
    assert _attempt(cfg)[0]["passed"] == 4

    cfg.datasets = [DatasetConfig(name="chat", path=str(path), max_rows=2)]
    s = collect_status(cfg)
    assert s["totals"] == {"rows": 2, "passed": 2, "quarantined": 0, "to_do": 0}
    assert s["not_in_current_files"] == {"samples": 2, "quarantined": 0}
    report, made = _attempt(cfg)  # raised ConservationError (rows in 2 != passed 4)
    assert made == [] and _figures(report) == {"rows_in": 2, "passed": 2, "quarantined": 0, "not_generated": 0,
                                               "not_in_current_files": {"samples": 2, "quarantined": 0}}

    cfg.datasets = [DatasetConfig(name="chat", path=str(path), max_rows=None)]  # raised again: counted again
    s = collect_status(cfg)
    assert s["totals"] == {"rows": 4, "passed": 4, "quarantined": 0, "to_do": 0}
    assert s["not_in_current_files"] == {"samples": 0, "quarantined": 0} and "not in the current" not in \
        format_status(s)


def test_a_removed_dataset_is_set_aside(cfg, tmp_path):
    a = _file(tmp_path / "a.jsonl", [GOOD])
    b = _file(tmp_path / "b.jsonl", [GOOD, '{"messages": [{"role": "user"'])
    cfg.datasets = [DatasetConfig(name="a", path=str(a)), DatasetConfig(name="b", path=str(b))]
    assert _figures(_attempt(cfg)[0])["rows_in"] == 3
    cfg.datasets = cfg.datasets[:1]
    s = collect_status(cfg)
    assert s["totals"] == {"rows": 1, "passed": 1, "quarantined": 0, "to_do": 0} and list(s["datasets"]) == ["a"]
    assert s["not_in_current_files"] == {"samples": 1, "quarantined": 1}
    assert _figures(_attempt(cfg)[0]) == {"rows_in": 1, "passed": 1, "quarantined": 0, "not_generated": 0,
                                          "not_in_current_files": {"samples": 1, "quarantined": 1}}


def test_account_counts_an_id_quarantined_at_extraction_as_passed():
    samples = pa.table({"sample_id": ["d:0:x", "d:1:y", "old:0:z"], "dataset": ["d", "d", "old"]})
    quarantine = [{"sample_id": "d:0:x", "dataset": "d", "stage": "extract"},  # passed, then quarantined
                  {"sample_id": "d:2:w", "dataset": "d", "stage": "read"},
                  {"sample_id": "old:0:z", "dataset": "old", "stage": "extract"},  # a set-aside sample's
                  {"sample_id": "d:3:gone", "dataset": "d", "stage": "read"}]  # repaired since
    acc = account(samples, quarantine, {"d": pa.array(["d:0:x", "d:1:y", "d:2:w", "d:3:v"])})
    assert acc.rows == {"d": 4} and acc.passed == {"d": 2} and acc.held == {"d": {"d:2:w": "read"}}
    assert acc.to_do == {"d": 1} and acc.aside == {"samples": 1, "quarantined": 1}
    assert acc.extracted_out == {"d": 1}  # passed generation, never trained on (the set-aside one not counted)
    assert [r["sample_id"] for r in acc.quarantine] == ["d:0:x", "d:2:w"]
