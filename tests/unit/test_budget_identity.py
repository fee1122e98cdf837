"""Budgets follow the source's identity (model, endpoint, budget scope), not its name: renaming a source
between attempts keeps what it spent; changing budget_scope is the explicit reset."""

from __future__ import annotations

import json

from pipeline.base.layout import RunLayout
from pipeline.run.config import RunConfig
from pipeline.run.job import restored_spend


def cfg_(tmp_path, name: str = "api", **src) -> RunConfig:
    source = {"kind": "openrouter", "name": name, "model": "tiny", "base_url": "http://127.0.0.1:9/api/v1",
              "api_key_required": False, "budgets": {"d": 1000}, **src}
    return RunConfig(output_dir=str(tmp_path), model={"profile": "deepseek"},
                     datasets=[{"name": "d", "path": "d.jsonl"}], sources=[source])


def test_a_renamed_source_keeps_its_spend_and_a_new_scope_starts_afresh(tmp_path):
    layout = RunLayout(tmp_path)
    first = cfg_(tmp_path)
    assert restored_spend(first, layout, first.sources[0]) == ({}, {}, {})
    layout.ledger("api").write_text(json.dumps({"#format": 2, "tokens": {"d": 300}, "usd": {"d": 0.5}}))
    assert restored_spend(first, layout, first.sources[0])[:2] == ({"d": 300}, {"d": 0.5})

    renamed = cfg_(tmp_path, name="api-v2")  # same model and endpoint: the same account
    spent, usd, held = restored_spend(renamed, layout, renamed.sources[0])
    assert (spent, usd) == ({"d": 300}, {"d": 0.5}) and held == {"d": 300}
    assert json.loads((tmp_path / "sources.json").read_text()) == {
        "api": [first.sources[0].identity()], "api-v2": [first.sources[0].identity()]}

    reset = cfg_(tmp_path, name="api-v3", budget_scope="2026-12 top-up")  # the explicit reset
    assert restored_spend(reset, layout, reset.sources[0]) == ({}, {}, {})
    other = cfg_(tmp_path, name="api-v4", model="another-model")
    assert restored_spend(other, layout, other.sources[0]) == ({}, {}, {})


def test_a_name_that_moved_to_another_model_keeps_its_old_spend_with_the_old_identity(tmp_path):
    layout = RunLayout(tmp_path)
    x = cfg_(tmp_path, name="a", model="model-x")
    restored_spend(x, layout, x.sources[0])
    layout.ledger("a").write_text(json.dumps({"d": 400}))
    moved = cfg_(tmp_path, name="a", model="model-y")  # "a" now asks model Y ...
    restored_spend(moved, layout, moved.sources[0])
    newcomer = cfg_(tmp_path, name="b", model="model-x")  # ... and a new "b" asks model X: X's spend follows it
    assert restored_spend(newcomer, layout, newcomer.sources[0])[0] == {"d": 400}


def test_two_api_sources_with_one_identity_are_refused():
    import pytest
    from pydantic import ValidationError

    src = {"kind": "openrouter", "model": "m", "base_url": "http://127.0.0.1:9/v1", "api_key_required": False,
           "budgets": {"d": 10}}
    with pytest.raises(ValidationError, match="budget_scope"):
        RunConfig(output_dir="o", model={"profile": "deepseek"}, datasets=[{"name": "d", "path": "d.jsonl"}],
                  sources=[{**src, "name": "a"}, {**src, "name": "b"}])
    RunConfig(output_dir="o", model={"profile": "deepseek"}, datasets=[{"name": "d", "path": "d.jsonl"}],
              sources=[{**src, "name": "a"}, {**src, "name": "b", "budget_scope": "second"}])


def test_spend_restored_from_the_samples_counts_each_written_row_of_the_source(tmp_path):
    """Billed tokens in samples/ (read as columns) and quarantine/, per dataset, for one source: rows of other
    sources, unbilled (0, -1: no usage) and null figures add nothing; a sample written twice counts twice (the
    restored spend errs high, never low)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.run.job import spent_by_dataset

    layout = RunLayout(tmp_path)
    layout.samples.mkdir(parents=True)
    layout.quarantine.mkdir()
    rows = [("d", "api", 10), ("d", "api", 0), ("e", "api", 5), ("d", "other", 1000), ("d", "api", -1),
            ("d", "api", None), ("e", None, 7)]
    pq.write_table(pa.table({"dataset": [r[0] for r in rows], "source": [r[1] for r in rows],
                             "billed_completion_tokens": pa.array([r[2] for r in rows], pa.int64())}),
                   layout.samples / "part-a.parquet")
    pq.write_table(pa.table({"dataset": ["d"], "source": ["api"], "billed_completion_tokens": [10]}),
                   layout.samples / "part-b.parquet")  # the same sample again
    pq.write_table(pa.table({"dataset": ["e"], "source": ["api"],
                             "detail": [json.dumps({"billed_completion_tokens": 3})]}),
                   layout.quarantine / "part-q.parquet")
    assert spent_by_dataset(layout, "api") == {"d": 20, "e": 8}
    assert spent_by_dataset(layout, "other") == {"d": 1000}
