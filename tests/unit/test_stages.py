"""The Ray Data stages as plain callables (no Ray): render, with the pre-generation length gate."""

from __future__ import annotations

import json

import pyarrow as pa

from pipeline.generate.stages import RenderPrompts


def prompt(i: int, text: str, dataset: str = "chat") -> dict:
    return {"sample_id": f"{dataset}:{i}:h", "dataset": dataset, "row_index": i, "tools": "", "thinking": True,
            "messages": json.dumps([{"role": "user", "content": text}])}


def test_a_prompt_too_long_for_its_dataset_is_quarantined_before_generation():
    """A 200 KB prompt (tens of thousands of tokens) must never reach a source that bills for it."""
    huge = " ".join(f"word{i}" for i in range(40_000))
    rows = [prompt(0, "Name three rivers."), prompt(1, huge), prompt(2, huge, dataset="other")]
    stage = RenderPrompts("deepseek", None, {"chat": 32768})
    out = stage(pa.Table.from_pylist(rows)).to_pylist()
    assert out[0]["status"] == "ok" and 0 < len(out[0]["prompt_ids"]) < 100
    assert (out[1]["status"], out[1]["stage"]) == ("quarantine", "render")
    assert out[1]["reason"].startswith("max_length: prompt of ") and "max_total_tokens 32768" in out[1]["reason"]
    assert out[2]["status"] == "ok" and len(out[2]["prompt_ids"]) > 32768  # no limit configured for "other"


def test_the_writer_hands_the_driver_only_the_tally_columns(tmp_path):
    """The driver counts: no token ids or texts come back from the writer, and the tally figures it needs
    (token count, billing, checks) are exact."""
    from pipeline.base.config import DatasetConfig
    from pipeline.base.flight import TALLY_SCHEMA
    from pipeline.base.layout import RunLayout
    from pipeline.generate.stages import WriteShards
    from pipeline.report.summary import Tally, audit_for
    from tests.unit.test_run_lock import _batch, _flight

    ok, bad, left = _flight("a"), _flight("q", "quarantine"), _flight("n", "not_generated")
    ok.update(output_ids=[5, 6, 7], billed_completion_tokens=3, cost=0.25, source="api", checks_ran=["billing"])
    left["output_ids"] = None
    out = WriteShards(RunLayout(tmp_path))(_batch(ok, bad, left))
    assert out.schema == TALLY_SCHEMA and "output_ids" not in out.schema.names and "content" not in out.schema.names
    rows = {r["sample_id"]: r for r in out.to_pylist()}
    assert rows["a"]["output_tokens"] == 3 and rows["n"]["output_tokens"] is None
    tally = Tally(3, audit_for([DatasetConfig(name="d", path="x.jsonl")]))
    for r in out.to_pylist():
        tally.add(r)
    assert rows["q"]["output_tokens"] == 2 and tally.tokens == 3 + 2 and tally.cost == 0.25
    assert tally.status == {"ok": 1, "quarantine": 1, "not_generated": 1}
    billing = tally.audit.report()["billing"]  # billing_diff reads output_tokens on a tally row
    assert (billing["samples"], billing["output_tokens"], billing["billed_tokens"]) == (1, 3, 3)


def test_cpu_stage_pools_follow_the_sources_and_the_cluster():
    from types import SimpleNamespace

    from pipeline.base.config import PoolConfig
    from pipeline.generate.stages import pool_bounds

    sources = [SimpleNamespace(num_actors=2, max_actors=6), SimpleNamespace(num_actors=4, max_actors=None)]
    assert pool_bounds(PoolConfig(), sources, cluster_cpus=64) == (1, 10)  # 6 + 4 source actors at their most
    assert pool_bounds(PoolConfig(), sources, cluster_cpus=2) == (1, 2)  # more would only queue for CPUs
    assert pool_bounds(PoolConfig(min_actors=3), sources, cluster_cpus=2) == (3, 3)
    assert pool_bounds(PoolConfig(min_actors=1, max_actors=5), sources, cluster_cpus=2) == (1, 5)  # set: kept


def test_render_routes_and_validate_closes_the_chain_as_the_routing_actors_did():
    """The run folds the chain's two ends into its CPU pools: render writes each row's source as
    ``assign_sources`` does (an override wins, an unroutable row is left to do), and validate quarantines an
    ok row no source generated as ``close_unserved`` does, before its checks."""
    from pipeline.base.config import RoutingConfig
    from pipeline.base.flight import rows_to_table
    from pipeline.generate.router import build_router
    from pipeline.generate.sources.chain import assign_sources, close_unserved
    from pipeline.generate.sources.engines.config import VLLMSourceConfig
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig
    from pipeline.generate.stages import ValidateSamples
    from tests.unit.test_run_lock import _flight

    sources = [VLLMSourceConfig(name="local"), OpenRouterSourceConfig(name="api", model="m/x")]
    datasets = [type("D", (), {"name": "chat", "sources": None})(), type("D", (), {"name": "api-only",
                                                                                "sources": ["api"]})()]
    router = build_router(sources, datasets, RoutingConfig(), 40)
    rows = [prompt(i, f"Question {i}?") for i in range(30)] + [prompt(30, "Q?", dataset="api-only"),
                                                                prompt(31, "Q?", dataset="nowhere")]
    overrides = {rows[3]["sample_id"]: "api"}
    plain = RenderPrompts("deepseek", None)(pa.Table.from_pylist(rows))
    routed = RenderPrompts("deepseek", None, None, router, overrides)(pa.Table.from_pylist(rows))
    assert routed.equals(assign_sources(plain, router, overrides))
    got = {r["sample_id"]: r for r in routed.to_pylist()}
    assert {got[r["sample_id"]]["source"] for r in rows[:30]} == {"local", "api"}  # both sources get a share
    assert got[rows[3]["sample_id"]]["source"] == "api" and got[rows[30]["sample_id"]]["source"] == "api"

    served, unserved = _flight("a"), _flight("b")
    served.update(output_ids=[5, 6], source="api")
    unserved.update(output_ids=None, source="gone")
    batch = rows_to_table([served, unserved])
    modes = ("structure", "roundtrip", "roundtrip_rebuilt", "billing", "tool_semantics", "empty_content", "truncated",
             "repetition", "max_length")
    checks = {"d": dict.fromkeys(modes, "off")}
    out = ValidateSamples("deepseek", None, checks, closes_chain=True)(batch).to_pylist()
    closed = close_unserved(batch).to_pylist()
    assert (out[1]["status"], out[1]["reason"]) == (closed[1]["status"], closed[1]["reason"]) == (
        "quarantine", "route: no stage in the chain served source 'gone'")
    assert out[0]["status"] == "ok"
