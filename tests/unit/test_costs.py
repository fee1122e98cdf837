"""Cost per sample (#27): engine time split over a batch by tokens, device counts per source, and the spend
tables per dataset and source that the report and `status` print."""

from __future__ import annotations

import math

import pytest

from pipeline.config import SGLangSourceConfig, TransformersSourceConfig, VLLMSourceConfig
from pipeline.costs import cost_line, cost_table, engine_prices, sample_usd
from pipeline.sources.engine import busy_shares


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
