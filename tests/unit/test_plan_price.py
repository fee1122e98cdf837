"""The plan's price of a sample is every dollar billed for its dataset over the samples that reach training, so
the caps it writes pay for the rows its ``max_rows`` reads; a sample quarantined at extraction is not a passed
one; and the value curves never predict acceptance past k + 1, nor print a ceiling the points never showed."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.base.config import DatasetConfig
from pipeline.base.layout import RunLayout, atomic_write_table, shard_name
from pipeline.base.records import QUARANTINE_SCHEMA, SAMPLE_SCHEMA, empty_sample, quarantine_row
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.prompts.read import index_dataset, read_finished_ids, todo_rows
from pipeline.run.plan import fragment, room
from pipeline.run.value import ValueOptions, dataset_bills, dataset_prices, value_lines, value_report
from pipeline.value.curves import Curve, fit_curve
from pipeline.value.plan import Buyable, make_plan
from tests.helpers.configs import formats_config


@pytest.fixture
def cfg(repo_root: Path, tmp_path: Path):
    cfg = formats_config(repo_root, tmp_path)
    cfg.training = None
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                            for i in range(200)))
    cfg.datasets = [DatasetConfig(name="chat", path=str(path), max_rows=100)]
    cfg.sources = [OpenRouterSourceConfig.model_validate(
        {"kind": "openrouter", "name": "api", "model": "m", "base_url": "http://127.0.0.1:9/v1",
         "api_key_required": False, "budgets": {"chat": "unlimited"}, "budgets_usd": {"chat": 1.0}})]
    return cfg


def _rows(cfg) -> list[dict]:
    layout = RunLayout(cfg.output_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    done = read_finished_ids(layout)
    d = cfg.datasets[0]
    index_dataset(d, layout, done, {})
    return list(todo_rows(d, done, index=layout.prompt_index(d.name)))


def _write(layout: RunLayout, samples: list[dict], quarantined: list[tuple[dict, str]]) -> None:
    """Samples and quarantine rows as the shard writers write them (a quarantine row keeps the sample's bill)."""
    layout.samples.mkdir(parents=True, exist_ok=True)
    layout.quarantine.mkdir(parents=True, exist_ok=True)
    if samples:
        atomic_write_table(pa.Table.from_pylist(samples, schema=SAMPLE_SCHEMA),
                           layout.samples / shard_name([s["sample_id"] for s in samples]))
    if quarantined:
        rows = [quarantine_row(s, stage, f"{stage}: failed") for s, stage in quarantined]
        atomic_write_table(pa.Table.from_pylist(rows, schema=QUARANTINE_SCHEMA),
                           layout.quarantine / shard_name([r["sample_id"] for r in rows]))


def _billed(row: dict, usd: float) -> dict:
    return empty_sample(row) | {"source": "api", "cost": usd, "output_ids": [1, 2, 3]}


def test_a_sample_is_priced_at_every_dollar_billed_over_the_samples_that_reach_training():
    # rows: $0.05 in 50 passed samples, $0.05 in 50 quarantined rows; the ledger counted $0.12 (a bill whose row
    # was never written); 10 of the passed were quarantined at extraction
    prices = dataset_prices({("api", "a"): 0.10, ("vllm", "a"): 0.02}, {("api", "a"): 0.12}, {"a": 40})
    assert prices["a"]["billed_usd"] == pytest.approx(0.14)
    assert prices["a"]["usd_per_sample"] == pytest.approx(0.14 / 40)
    assert dataset_prices({("api", "b"): 0.1}, {}, {"b": 0})["b"]["usd_per_sample"] is None


def test_the_caps_pay_for_the_rows_max_rows_reads(cfg):
    """At a 50% pass rate (the other half billed, then quarantined by validation) the plan prices a sample at
    twice its own bill: the cap it writes holds the rows its max_rows reads, not half of them."""
    layout = RunLayout(cfg.output_dir)
    rows = _rows(cfg)
    passed, failed = rows[:50], rows[50:]
    _write(layout, [_billed(r, 0.001) for r in passed], [(_billed(r, 0.001), "validate") for r in failed])
    layout.ledger("api").write_text(json.dumps({"#format": 2, "tokens": {"chat": 0}, "usd": {"chat": 0.10}}))
    bill = dataset_bills(cfg, layout)["chat"]
    assert bill["billed_usd"] == pytest.approx(0.10) and bill["usable_samples"] == 50
    assert bill["usd_per_sample"] == pytest.approx(0.002)  # was $0.001: the passed samples' own bill
    rooms = room(cfg, layout)
    assert rooms["chat"] == {"rows": 200, "read": 100, "passed": 50, "samples_left": 50}
    plan = make_plan([Buyable("chat", bill["usd_per_sample"], 0.045, rooms["chat"]["samples_left"],
                              Curve(2.0, 2.0, 1.0), (), 0.001)], 0.10, 1.0, 2.0)
    row = plan["datasets"][0]
    frag = fragment(cfg, layout, plan, rooms, {("api", "chat"): 0.05}, {("api", "chat"): 150})
    to_read = frag["datasets"]["chat"]["max_rows"] - rooms["chat"]["read"]
    cap_room = frag["sources"]["api"]["budgets_usd"]["chat"] - 0.10
    assert row["add_samples"] == 50 and to_read == 100
    assert cap_room >= to_read * 0.001  # the rows max_rows reads, each billed $0.001, fit under the cap


def test_only_the_dollars_of_samples_that_pass_move_the_curve():
    """Half of a price spent on rows that fail teaches nothing: the same dollars gain what half of them would at
    the samples' own bill."""
    curve = Curve(2.0, 2.0, 1.0)
    dear = make_plan([Buyable("a", 0.002, 1.0, None, curve, (), 0.001)], 0.5, 1.0, 3.0)
    cheap = make_plan([Buyable("a", 0.001, 1.0, None, curve)], 0.25, 1.0, 3.0)
    assert dear["datasets"][0]["add_samples"] == cheap["datasets"][0]["add_samples"] == 250
    assert dear["predicted"]["gain"] == pytest.approx(cheap["predicted"]["gain"])


def test_a_sample_quarantined_at_extraction_is_read_but_not_passed(cfg):
    layout = RunLayout(cfg.output_dir)
    rows = _rows(cfg)[:4]
    samples = [_billed(r, 0.001) for r in rows]
    _write(layout, samples, [(samples[0], "extract"), (samples[1], "extract")])
    assert room(cfg, layout)["chat"] == {"rows": 200, "read": 4, "passed": 2, "samples_left": 98}
    bill = dataset_bills(cfg, layout)["chat"]
    assert bill["usable_samples"] == 2 and bill["usd_per_sample"] == pytest.approx(0.002)


STRAIGHT = ([0.0, 1.0, 2.0, 4.0], [2.0, 2.25, 2.5, 3.0], [0.02] * 4)  # still rising in a line at k = 3


def test_the_fit_never_passes_k_plus_one():
    free = fit_curve(*STRAIGHT)
    assert isinstance(free, Curve) and free.a0 + free.gain > 100  # unbounded, the fit promised ~1003
    held = fit_curve(*STRAIGHT, ceiling=4.0)
    assert isinstance(held, Curve) and held.capped and not held.measured
    assert held.a0 + held.gain == pytest.approx(4.0)
    assert all(held(s) <= 4.0 + 1e-12 for s in (0, 1, 10, 1e3, 1e9))
    assert Curve(2.0, 1000.0, 4000.0, ceiling=4.0)(1e9) == 4.0  # a curve from elsewhere is clamped too
    bent = fit_curve([0.0, 1.0, 2.0, 4.0], [2.0, 2.6, 2.8, 2.9], [0.02] * 4, ceiling=4.0)
    assert isinstance(bent, Curve) and bent.measured  # a curve that bends under the ceiling is left as it fits


def _arm(ds, frac, acc, k=3):
    heldout = {"acceptance_length": acc, "by_dataset": [{"name": "chat", "acceptance_length": acc, "se": 0.02,
                                                         "drafts": 500}]}
    if k is not None:
        heldout["k"] = k
    return {"arm": {"name": f"{ds}@{frac}", "dataset": ds, "fraction": frac, "seed": 0}, "heldout": heldout,
            "spend": {"chat": {"usd": 4.0 * frac, "tokens": int(4e6 * frac), "samples": int(400 * frac)}}}


@pytest.mark.parametrize("k", [3, None])
def test_value_lines_say_an_unmeasured_ceiling_is_unmeasured(k):
    results = [_arm(None, 1.0, 3.0, k), _arm("chat", 0.0, 2.0, k), _arm("chat", 0.25, 2.25, k),
               _arm("chat", 0.5, 2.5, k)]
    training = [{"sample_id": f"s{i}", "dataset": "chat", "usd": 0.01, "tokens": 10000} for i in range(400)]
    rep = value_report(results, training, 500, ValueOptions(), 0.1)
    curve = Curve.from_dict(rep["datasets"]["chat"]["curves"]["usd"])
    line = value_lines(rep)[1]
    assert "unmeasured" in line and "at most" not in line and "half of it by" not in line
    if k is not None:
        assert rep["ceiling"] == 4.0 and curve.a0 + curve.gain <= 4.0 + 1e-9 and "ceiling of 4" in line


def test_value_json_prices_a_sample_from_the_bills():
    results = [_arm(None, 1.0, 3.0), _arm("chat", 0.0, 2.0), _arm("chat", 0.5, 2.6), _arm("chat", 0.25, 2.4)]
    training = [{"sample_id": f"s{i}", "dataset": "chat", "usd": 0.01, "tokens": 100} for i in range(400)]
    bills = dataset_prices({("api", "chat"): 9.0}, {}, {"chat": 450})
    d = value_report(results, training, 500, ValueOptions(), 0.1, bills=bills)["datasets"]["chat"]
    assert d["usd_per_sample"] == pytest.approx(0.02) and d["usd_per_training_sample"] == pytest.approx(0.01)
    assert Counter(type(v) for v in (d["billed_usd"], d["usable_samples"])) == Counter({float: 1, int: 1})
