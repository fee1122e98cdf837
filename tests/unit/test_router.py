"""The router: every prompt to exactly one source, deterministically; shares, overflow, eligibility, re-routes."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pyarrow as pa
import pytest
from pydantic import ValidationError

from pipeline.base.config import RoutingConfig
from pipeline.base.flight import FLIGHT_SCHEMA, fail_row, rows_to_table, serves
from pipeline.generate.router import build_router, overflow_shares, rank_sources, source_infos
from pipeline.generate.sources.chain import assign_sources, chain_batch_size, close_unserved, reroute_overrides
from pipeline.generate.sources.http.openrouter import merge_outcome


def spilled_from(row: dict) -> str | None:
    return row.get("spilled_from")


def src(name: str, kind: str = "vllm", **kw):
    """A real source schema of that kind (an API source needs a model)."""
    from pipeline.generate.sources.registry import SOURCES as KINDS

    needs = {"model": "m/x"} if "model" in KINDS[kind].config.model_fields and "model" not in kw else {}
    return KINDS[kind].config(name=name, **needs, **kw)


def ds(name: str, sources=None):
    return SimpleNamespace(name=name, sources=sources)


def prompt(i: int, dataset: str = "chat", tools: str = "") -> dict:
    return {"sample_id": f"{dataset}:{i}:{i * 7919 % 10007:04x}", "dataset": dataset, "tools": tools}


SOURCES = [src("vllm"), src("api", "openrouter")]
DATASETS = [ds("chat"), ds("tools")]


def test_each_prompt_goes_to_exactly_one_source_deterministically():
    routing = RoutingConfig.model_validate({"sources": {"vllm": {"weight": 3}, "api": {"weight": 1}}})
    rows = [prompt(i) for i in range(4000)]
    r1 = build_router(SOURCES, DATASETS, routing, len(rows))
    by_source, unroutable = r1.assign(rows)
    assert not unroutable
    ids = [p["sample_id"] for group in by_source.values() for p in group]
    assert sorted(ids) == sorted(p["sample_id"] for p in rows)  # each once
    # A fresh router from the same config, prompts in another order: the same decision per prompt.
    r2 = build_router(SOURCES, DATASETS, RoutingConfig.model_validate(routing.model_dump()), len(rows))
    again, _ = r2.assign(list(reversed(rows)))
    assert {k: sorted(p["sample_id"] for p in v) for k, v in again.items()} == \
        {k: sorted(p["sample_id"] for p in v) for k, v in by_source.items()}
    share = len(by_source["vllm"]) / len(rows)
    assert abs(share - 0.75) < 0.03


def test_removing_a_source_moves_only_its_prompts():
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    ids = [f"d:{i}:h" for i in range(2000)]
    before = {i: rank_sources(i, weights)[0] for i in ids}
    after = {i: rank_sources(i, {"a": 1.0, "c": 1.0})[0] for i in ids}
    moved = [i for i in ids if before[i] != after[i]]
    assert moved and all(before[i] == "b" for i in moved)
    # b's prompts split between a and c by their weights.
    counts = Counter(after[i] for i in moved)
    assert abs(counts["a"] / len(moved) - 0.5) < 0.06


def test_overflow_mode_fills_local_capacity_first():
    infos = source_infos([src("gpu1"), src("gpu2"), src("api", "openrouter")],
                         RoutingConfig.model_validate({
                             "mode": "overflow", "deadline_s": 100,
                             "sources": {"gpu1": {"capacity": 3}, "gpu2": {"capacity": 1},
                                         "api": {"role": "overflow"}}}))
    shares = overflow_shares(1000, infos, 100.0)  # locals serve 400 of 1000 within the deadline
    assert shares == pytest.approx({"gpu1": 0.3, "gpu2": 0.1, "api": 0.6})
    shares = overflow_shares(200, infos, 100.0)  # locals can take everything: the API gets nothing
    assert shares == pytest.approx({"gpu1": 0.75, "gpu2": 0.25, "api": 0.0})
    routing = RoutingConfig.model_validate({"mode": "overflow", "deadline_s": 100,
                                            "sources": {"vllm": {"capacity": 1}, "api": {"role": "overflow"}}})
    router = build_router(SOURCES, DATASETS, routing, 400)
    by_source, _ = router.assign([prompt(i) for i in range(400)])
    assert abs(len(by_source["vllm"]) / 400 - 0.25) < 0.06
    # The API still stands behind the local source for re-routes when locals take everything.
    router = build_router(SOURCES, DATASETS, routing, 50)
    by_source, _ = router.assign([prompt(i) for i in range(50)])
    assert len(by_source["api"]) == 0
    assert all(router.next_source(p, "vllm") == "api" for p in by_source["vllm"])


OVERFLOW = {"mode": "overflow", "deadline_s": 100,
            "sources": {"vllm": {"capacity": 100}, "api": {"role": "overflow"}}}


def test_past_the_deadline_waiting_prompts_spill_to_the_overflow_source():
    tool = '[{"type": "function", "function": {"name": "f"}}]'
    routing = RoutingConfig.model_validate({**OVERFLOW, "tool_prompts_by_dataset": {"tools": "exact_ids"}})
    router = build_router(SOURCES, DATASETS, routing, 50, started_at=1000.0)
    assert router.spill_at == 1100.0
    rows = [flight(i) for i in range(20)]
    assert all(router.route(r) == "vllm" for r in rows)  # capacity x deadline covers every prompt
    assert not any(router.spill(r, "vllm", now=1099.0) for r in rows)  # before the deadline: served locally
    assert all(r["status"] == "ok" for r in rows)
    assert all(router.spill(r, "vllm", now=1100.5) for r in rows)
    assert all((r["status"], r["source"], r["reason"]) == ("reroute", "api", "vllm: past the overflow deadline")
               for r in rows)
    assert all(spilled_from(r) == "vllm" and serves(r, "api") for r in rows)
    # Never spilled: a re-routed prompt, a prompt at the overflow source, one the API may not serve.
    assert not router.spill(flight(1, status="reroute", reason="x: engine error"), "vllm", now=2000.0)
    assert not router.spill(flight(2), "api", now=2000.0)
    assert not router.spill(flight(3, dataset="tools", tools=tool), "vllm", now=2000.0)
    # The API cannot serve a spilled prompt (budget spent): it goes back to its local source, once.
    row = rows[0]
    merge_outcome(row, {"status": "not_generated", "error": "budget exhausted"}, "api", router)
    assert (row["status"], row["source"]) == ("reroute", "vllm") and spilled_from(row) is None
    assert not router.spill(row, "vllm", now=2000.0)
    merge_outcome(row, {"status": "not_generated", "error": "still no budget"}, "api", router)  # not spilled now
    assert row["status"] == "not_generated"
    # Nothing spills without a start time, in shares mode, or with spill_late off.
    assert build_router(SOURCES, DATASETS, routing, 50).spill_at is None
    assert build_router(SOURCES, DATASETS, RoutingConfig(), 50, started_at=1000.0).spill_at is None
    off = RoutingConfig.model_validate({**OVERFLOW, "spill_late": False})
    assert build_router(SOURCES, DATASETS, off, 50, started_at=1000.0).spill_at is None


def test_overflow_config_errors_name_the_missing_piece():
    with pytest.raises(ValidationError, match="deadline_s"):
        RoutingConfig.model_validate({"mode": "overflow", "sources": {"api": {"role": "overflow"}}})
    with pytest.raises(ValidationError, match="role: overflow"):
        RoutingConfig.model_validate({"mode": "overflow", "deadline_s": 10})
    routing = RoutingConfig.model_validate({"mode": "overflow", "deadline_s": 10,
                                            "sources": {"api": {"role": "overflow"}}})
    with pytest.raises(ValueError, match="'vllm' needs a capacity"):
        build_router(SOURCES, DATASETS, routing, 10)
    with pytest.raises(ValueError, match="unknown source 'gpu9'"):
        build_router(SOURCES, DATASETS, RoutingConfig.model_validate({"sources": {"gpu9": {}}}), 10)


def test_dataset_sources_and_tool_rules_limit_eligibility():
    sources = [src("vllm"), src("api", "openrouter", send_tools=False), src("api-tools", "openrouter",
                                                                             send_tools=True)]
    datasets = [ds("chat", ["api", "api-tools"]), ds("tools"), ds("agent")]
    routing = RoutingConfig.model_validate({"tool_prompts": "tools_sent",
                                            "tool_prompts_by_dataset": {"tools": "exact_ids"}})
    router = build_router(sources, datasets, routing, 100)
    tool = '[{"type": "function", "function": {"name": "f"}}]'
    assert router.eligible("chat", False) == ["api", "api-tools"]
    assert router.eligible("tools", True) == ["vllm"]
    assert router.eligible("tools", False) == ["vllm", "api", "api-tools"]
    assert router.eligible("agent", True) == ["vllm", "api-tools"]
    assert router.eligible("chat", True) == ["api-tools"]
    by_source, unroutable = router.assign([prompt(i, "tools", tool) for i in range(50)])
    assert len(by_source["vllm"]) == 50 and not unroutable
    only_api = build_router(sources[1:2], [ds("tools")], RoutingConfig(tool_prompts="exact_ids"), 10)
    _, unroutable = only_api.assign([prompt(1, "tools", tool), prompt(2, "tools")])
    assert [p["sample_id"] for p in unroutable] == [prompt(1, "tools")["sample_id"]]


def flight(i: int, **kw) -> dict:
    row = dict.fromkeys(FLIGHT_SCHEMA.names)
    row.update({"sample_id": f"chat:{i}:h", "dataset": "chat", "row_index": i, "messages": "[]", "tools": "",
                "thinking": True, "prompt_ids": [1, 2, 3], "status": "ok", "stage": "", "reason": "", **kw})
    return row


def test_failed_rows_walk_their_ranking_then_quarantine():
    sources = [src("a"), src("b"), src("c")]
    router = build_router(sources, [ds("chat")], RoutingConfig(max_hops=1), 10)
    row = flight(1)
    order = router.ranking(row)
    assert len(order) == 2 and set(order) <= {"a", "b", "c"}
    fail_row(row, "engine error: boom", order[0], router)
    assert row["status"] == "reroute" and row["source"] == order[1] and row["reason"].startswith(order[0])
    assert serves(row, order[1]) and not serves(row, order[0])
    fail_row(row, "engine error: again", order[1], router)  # max_hops reached
    assert (row["status"], row["stage"], row["source"]) == ("quarantine", "generate", order[1])
    no_reroute = build_router(sources, [ds("chat")], RoutingConfig(reroute=False), 10)
    row = flight(2)
    fail_row(row, "engine error: boom", no_reroute.route(row), no_reroute)
    assert row["status"] == "quarantine"


def test_assign_sources_stage_and_refeed_overrides():
    router = build_router(SOURCES, DATASETS, RoutingConfig(), 10)
    rows = [flight(i) for i in range(6)] + [flight(9, status="quarantine", stage="render", reason="bad")]
    out = assign_sources(rows_to_table(rows), router).to_pylist()
    assert [r["source"] for r in out[:6]] == [router.route(r) for r in rows[:6]]
    assert out[6]["source"] is None and out[6]["status"] == "quarantine"
    forced = assign_sources(rows_to_table(rows[:2]), router, {rows[0]["sample_id"]: "api"}).to_pylist()
    assert forced[0]["source"] == "api" and forced[1]["source"] == router.route(rows[1])
    left = [dict(out[0], status="reroute", source="vllm"), dict(out[1], status="ok")]
    assert reroute_overrides(left) == {out[0]["sample_id"]: "vllm"}
    unroutable = build_router([src("api", "openrouter")], [ds("chat")], RoutingConfig(tool_prompts="exact_ids"), 1)
    out = assign_sources(rows_to_table([flight(1, tools='[{"type": "function"}]')]), unroutable).to_pylist()
    assert (out[0]["status"], out[0]["failure_class"]) == ("not_generated", "config")  # the routing's fault
    assert out[0]["reason"].startswith("route: no source")


def test_http_outcomes_fold_into_flight_rows():
    router = build_router(SOURCES, DATASETS, RoutingConfig(), 10)
    ok = {"status": "ok", "error": "", "source": "api", "source_kind": "openrouter", "provider": "Beta",
          "model": "tiny", "ids_from": "rebuilt", "output_ids": [5, 6, 1], "reasoning": "r", "content": "c",
          "tool_calls": "", "finish_reason": "stop", "truncated": False, "billed_completion_tokens": 3,
          "cost": 0.001, "sampling": "{}", "t_generate_s": 0.2, "prompt_ids": None}
    row = merge_outcome(flight(1, source="api"), ok, "api", router)
    assert row["status"] == "ok" and row["output_ids"] == [5, 6, 1] and row["prompt_ids"] == [1, 2, 3]
    assert (row["provider"], row["ids_from"], row["billed_completion_tokens"]) == ("Beta", "rebuilt", 3)
    bad = {"status": "quarantined", "error": "after 2 attempt(s): 502", "provider": "Alpha"}
    for i in range(2, 12):  # api first in some prompts' order (next: vllm), last in others (quarantine)
        nxt = router.next_source(flight(i), "api")
        row = merge_outcome(flight(i, source="api"), bad, "api", router)
        assert (row["status"], row["source"]) == (("reroute", "vllm") if nxt else ("quarantine", "api"))
    row = merge_outcome(flight(3, source="api"), bad, "api", None)
    assert (row["status"], row["stage"], row["reason"]) == ("quarantine", "generate", "after 2 attempt(s): 502")
    spent = {"status": "not_generated", "error": "budget of 'chat' is spent"}
    row = merge_outcome(flight(4, source="api"), spent, "api", None)
    assert row["status"] == "not_generated"
    table = rows_to_table([row])
    assert isinstance(table, pa.Table) and table.num_rows == 1


def test_chain_batches_widen_with_the_share():
    assert chain_batch_size(16, 1.0) == 16
    assert chain_batch_size(16, 0.5) == 32
    assert chain_batch_size(16, 0.01) == 128
    assert chain_batch_size(16, 0.0) == 16


def test_rows_no_stage_served_are_quarantined_not_written_empty():
    rows = [flight(1, source="gone"), flight(2, source="vllm", output_ids=[5, 1]),
            flight(3, status="reroute", source="vllm", reason="api: 502")]
    out = close_unserved(rows_to_table(rows)).to_pylist()
    assert (out[0]["status"], out[0]["stage"]) == ("quarantine", "generate") and "'gone'" in out[0]["reason"]
    assert out[1]["status"] == "ok" and out[2]["status"] == "reroute"


def test_routing_maps_read_only_their_columns_and_pass_a_served_block_through():
    """close_unserved hands a block whose ok rows were all generated on as the same table (a column scan, no
    conversion); assign_sources takes a block in any column order (converted once) and writes only source."""
    router = build_router([src("api", "openrouter")], [ds("chat")], RoutingConfig(), 4)
    rows = [flight(i) for i in range(3)]
    routed = assign_sources(rows_to_table(rows), router)
    assert routed.column("source").to_pylist() == ["api"] * 3
    served = routed.set_column(routed.schema.get_field_index("output_ids"), "output_ids",
                               pa.array([[1, 2]] * 3, pa.list_(pa.int32())))
    assert close_unserved(served) is served
    shuffled = pa.Table.from_pylist([{k: r[k] for k in reversed(list(r))} for r in rows])  # no schema, columns reversed
    again = assign_sources(shuffled, router)
    assert again.schema == routed.schema and again.to_pylist() == routed.to_pylist()
    out = close_unserved(again).to_pylist()  # nothing generated: every ok row quarantined, named
    assert {(r["status"], r["stage"]) for r in out} == {("quarantine", "generate")}
    assert all("no stage in the chain served source 'api'" in r["reason"] for r in out)
