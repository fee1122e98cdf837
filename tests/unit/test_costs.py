"""Cost per sample (#27): engine time split over a batch by tokens, device counts per source, and the spend
tables per dataset and source that the report and `status` print."""

from __future__ import annotations

import math

import pytest

from pipeline.generate.sources.engines.base import busy_shares
from pipeline.generate.sources.engines.config import SGLangSourceConfig, TransformersSourceConfig, VLLMSourceConfig
from pipeline.report.costs import cost_line, cost_table, cost_table_of, engine_prices, sample_usd


def test_busy_time_is_split_by_tokens_and_adds_up():
    shares = busy_shares(10.0, [10, 30, 5], [[1] * 10, [1] * 30, None])
    assert shares == pytest.approx([2.5, 7.5, 0.0])  # 20 and 60 of 80 tokens; the failed row pays nothing
    assert math.fsum(shares) == pytest.approx(10.0, rel=1e-12)
    assert busy_shares(3.0, [4, 4], [None, None]) == [0.0, 0.0]  # nothing came back: nothing attributed
    assert busy_shares(0.0, [], []) == []


def test_devices_per_actor_follow_the_gpus_it_holds():
    assert VLLMSourceConfig().devices() == 1.0  # a CPU engine: the actor itself
    assert VLLMSourceConfig(num_gpus=1).devices() == 1.0
    assert VLLMSourceConfig(num_gpus=1, tensor_parallel_size=8).devices() == 8.0  # the TP bundles' GPUs
    assert SGLangSourceConfig(num_gpus=8, tensor_parallel_size=8).devices() == 8.0
    assert TransformersSourceConfig(num_gpus=0.5).devices() == 0.5  # a shared GPU is half a device
    with pytest.raises(ValueError):
        VLLMSourceConfig(gpu_hour_usd=-1.0)
    with pytest.raises(ValueError):
        VLLMSourceConfig(gpu_hour_usd=float("inf"))


ROWS = [
    {"sample_id": "a:0", "dataset": "shop", "source": "api", "output_ids": [1, 2, 3], "cost": 0.002, "engine_s": 0.0},
    {"sample_id": "a:1", "dataset": "shop", "source": "gpu", "output_ids": [1] * 5, "cost": 0.0, "engine_s": 1800.0},
    {"sample_id": "b:0", "dataset": "math", "source": "gpu", "output_ids": [1] * 2, "cost": 0.0, "engine_s": 3600.0},
    {"sample_id": "b:1", "dataset": "math", "source": "cpu", "output_ids": [1], "cost": None, "engine_s": 360.0},
]


def test_spend_per_dataset_and_source_adds_up_and_prices_only_priced_engines():
    prices = {"gpu": 2.0, "cpu": None}
    t = cost_table(ROWS, prices)
    assert t["by_dataset"]["shop"]["usd"] == pytest.approx(0.002 + 1.0)  # half a GPU-hour at $2
    assert t["by_dataset"]["math"]["usd"] == pytest.approx(2.0)  # the CPU engine's time is hours, not dollars
    assert t["by_dataset"]["math"]["unpriced_device_hours"] == pytest.approx(0.1)
    assert t["by_source"]["gpu"]["device_hours"] == pytest.approx(1.5) and t["by_source"]["gpu"]["samples"] == 2
    assert t["by_source"]["api"]["billed_usd"] == pytest.approx(0.002)
    for key in ("usd", "billed_usd", "device_hours", "samples", "output_tokens"):
        assert sum(v[key] for v in t["by_dataset"].values()) == pytest.approx(t["total"][key])
        assert sum(v[key] for v in t["by_source"].values()) == pytest.approx(t["total"][key])
    assert sum(sample_usd(r, prices) for r in ROWS) == pytest.approx(t["total"]["usd"])
    assert t["by_dataset"]["shop"]["usd_per_mtok"] == pytest.approx(1.002 / 8 * 1e6)


def test_bad_cells_count_as_nothing_spent_never_raise():
    rows = [{"dataset": "d", "source": "s", "cost": "NaN?", "engine_s": float("nan"), "output_ids": None},
            {"dataset": None, "source": None, "cost": -3.0, "engine_s": "x"}, {}]
    t = cost_table(rows, {"s": 1.0})
    assert t["total"]["samples"] == 3 and t["total"]["usd"] == 0.0 and t["total"]["output_tokens"] == 0


def test_engine_prices_and_cost_lines():
    cfgs = [VLLMSourceConfig(name="a", gpu_hour_usd=3.5), TransformersSourceConfig(name="b")]
    assert engine_prices(cfgs) == {"a": 3.5, "b": None}
    t = cost_table(ROWS, {"gpu": 2.0, "cpu": None})
    assert cost_line("shop", t["by_dataset"]["shop"]) == (
        "shop: $0.0020 billed + 0.5000 device-h ($1.0000) = $1.0020, 2 samples, $501.00/1k samples")
    assert cost_line("math", cost_table(ROWS[3:], {})["by_dataset"]["math"]) == (
        "math: 0.1000 device-h = $0.0000, 1 samples")
    assert cost_line("none", cost_table([], {})["total"]) == "none: nothing spent = $0.0000, 0 samples"


def _shard(path, rows, schema=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def test_a_shard_from_before_engine_time_reads_as_unknown_and_other_gaps_still_refuse(tmp_path):
    from pipeline.base.config import UnreadableFile
    from pipeline.base.records import read_rows

    _shard(tmp_path / "samples" / "a.parquet", [{"sample_id": "x", "dataset": "d", "cost": 0.5}])
    assert read_rows(tmp_path / "samples", ["sample_id", "cost", "engine_s"]) == [
        {"sample_id": "x", "cost": 0.5, "engine_s": None}]
    with pytest.raises(UnreadableFile, match="without the columns \\['source'\\]"):
        read_rows(tmp_path / "samples", ["sample_id", "source", "engine_s"])


def test_status_and_report_give_spend_per_dataset_priced_by_the_source(repo_root, tmp_path):
    from pipeline.base.layout import RunLayout
    from pipeline.base.records import SAMPLE_SCHEMA, empty_sample
    from pipeline.report.summary import cost_lines
    from pipeline.run.config import load_config
    from pipeline.run.status import collect_status, format_status

    cfg = load_config(repo_root / "configs" / "tiny_formats.yaml", base_dir=repo_root, check_paths=False)
    cfg.output_dir = str(tmp_path / "out")
    (tmp_path / "model").mkdir()
    cfg.model.path = str(tmp_path / "model")
    cfg.sources[0].gpu_hour_usd = 3.0
    rows = []
    for i, (d, secs) in enumerate([("chat", 1200.0), ("chat", 600.0), ("math", 1800.0)]):
        r = empty_sample({"sample_id": f"{d}:{i}", "dataset": d, "row_index": i, "messages": "[]", "thinking": False,
                          "prompt_ids": [1, 2], "prompt_assistant_mask": [0, 0]})
        rows.append({**r, "source": "vllm-cpu", "output_ids": [5, 6, 7], "engine_s": secs})
    _shard(RunLayout(cfg.output_dir).samples / "s.parquet", rows, SAMPLE_SCHEMA)
    s = collect_status(cfg)
    assert s["costs"]["by_dataset"]["chat"]["device_hours"] == pytest.approx(0.5)
    assert s["costs"]["by_dataset"]["chat"]["usd"] == pytest.approx(1.5)
    assert s["costs"]["by_dataset"]["math"]["usd"] == pytest.approx(1.5)
    text = format_status(s)
    assert "cost by dataset: chat: 0.5000 device-h ($1.5000) = $1.5000, 2 samples" in text
    assert "cost by source" not in text  # one source: the dataset line says it all
    two = {"by_dataset": s["costs"]["by_dataset"], "by_source": {"a": s["costs"]["total"], "b": s["costs"]["total"]}}
    assert [line.split(":")[0] for line in cost_lines(two)] == ["  cost by dataset", "  cost by source"]
    assert cost_lines(None) == [] and cost_lines({"by_dataset": "junk"}) == []


def test_the_arrow_reading_and_cost_table_agree_with_the_row_ones(tmp_path):
    """status reads samples as one Arrow table (read_sample_table, cost_table_of): the same first copy of each
    id, the same count of copies left out and the same spend as read_samples and cost_table over rows, with
    nulls, NaN, negatives, an old shard without engine_s and an id written in two shards."""
    import pyarrow as pa

    from pipeline.base.config import UnreadableFile
    from pipeline.base.records import SAMPLE_SCHEMA, read_sample_table, read_samples

    cols = ["sample_id", "dataset", "source", "billed_completion_tokens", "cost", "engine_s", "output_ids"]
    schema = pa.schema([SAMPLE_SCHEMA.field(c) for c in cols])
    first = [{"sample_id": f"s{i}", "dataset": "shop" if i % 3 else "math", "source": ["api", "gpu", None][i % 3],
              "billed_completion_tokens": [12, -1, None][i % 3], "cost": [0.25, None, float("nan"), -1.0][i % 4],
              "engine_s": [0.0, 900.0, None][i % 3], "output_ids": [[1] * (i % 5), None][i % 7 == 0]}
             for i in range(40)]
    _shard(tmp_path / "samples" / "a.parquet", first, schema)
    again = [dict(first[3], cost=99.0), {**first[0], "sample_id": "t0", "engine_s": 7200.0}]
    _shard(tmp_path / "samples" / "b.parquet", again, schema)  # s3 again (left out), one new id
    old = [{"sample_id": "u0", "dataset": "math", "source": "gpu", "billed_completion_tokens": 3, "cost": 0.5,
            "output_ids": [1, 2]}]
    _shard(tmp_path / "samples" / "c.parquet", old, pa.schema([f for f in schema if f.name != "engine_s"]))
    rows, dropped = read_samples(tmp_path / "samples", cols)
    table, dropped_t = read_sample_table(tmp_path / "samples", cols)
    assert dropped == dropped_t == 1 and len(rows) == table.num_rows == 42
    def same(a, b):
        return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))

    for r, t in zip(rows, table.to_pylist(), strict=True):
        assert r.keys() == t.keys() and all(same(r[k], t[k]) for k in r), (r, t)
    prices = {"gpu": 2.0, "cpu": None}
    want, got = cost_table(rows, prices), cost_table_of(table, prices)
    assert got.keys() == want.keys() and got["by_dataset"].keys() == want["by_dataset"].keys()
    for part in ("by_dataset", "by_source"):
        assert got[part].keys() == want[part].keys()
        for name in want[part]:
            assert got[part][name] == pytest.approx(want[part][name])
    assert got["total"] == pytest.approx(want["total"])
    no_ids, _ = read_sample_table(tmp_path / "samples", ["dataset", "cost"])
    assert no_ids.column_names == ["dataset", "cost"]
    _shard(tmp_path / "samples" / "d.parquet", [{"sample_id": "v", "dataset": "d", "source": "s",
                                                 "billed_completion_tokens": "many", "cost": 0.1, "engine_s": 0.0,
                                                 "output_ids": None}])
    with pytest.raises(UnreadableFile, match="d.parquet: a shard whose columns are not of the sample types"):
        read_sample_table(tmp_path / "samples", cols)
