"""Each prompt ends once, as passed, quarantined (with its reason) or left to do, and a run ends: an engine
answer that cannot be decoded fails that prompt only, a prompt holding numbers no JSON reader takes is
malformed (not "transient" forever), a prompt the routing gives no source is the config's to fix (left to do,
not quarantined for good), a row handed from one source to another is credited to the one that served it, and
a stage actor that dies past its bounded restarts ends the run with one line (exit 3), not a traceback or a
loop."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest

from pipeline.base.config import DatasetConfig, RoutingConfig
from pipeline.base.flight import batch_to_rows, rows_to_table, tally_of
from pipeline.generate.router import build_router
from pipeline.generate.sources.chain import (
    ACTOR_FAULTS,
    StageDied,
    actor_class_of,
    actor_death,
    assign_sources,
    stage_label,
)
from pipeline.generate.sources.engines import base as engine_base
from pipeline.generate.sources.engines.base import UNREADABLE, EngineResult, EngineSource
from pipeline.generate.sources.engines.config import VLLMSourceConfig
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.stages import RenderPrompts
from pipeline.prompts.datasets import iter_dataset
from pipeline.report.summary import Tally, attention_lines, audit_for

TOOL = json.dumps([{"type": "function", "function": {"name": "f"}}])


def prompt(i: int, dataset: str = "chat", tools: str = "") -> dict[str, Any]:
    return {"sample_id": f"{dataset}:{i}:h", "dataset": dataset, "row_index": i, "tools": tools, "thinking": False,
            "messages": json.dumps([{"role": "user", "content": f"hi {i}"}])}


# --------------------------------------------------------------------------- engine output that cannot be read


class ScriptedEngine(EngineSource):
    """An engine whose answers are fixed ids per row (``ids_for(i, profile)``)."""

    def __init__(self, profile: str, cfg: VLLMSourceConfig, router: Any, ids_for: Any) -> None:
        self.ids_for = ids_for
        super().__init__(f"/models/{profile}", profile, {}, cfg, router)

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        return [EngineResult(self.ids_for(i, self.profile), "stop", 0.0) for i, _ in enumerate(rows)]


@pytest.fixture
def offline_profiles(monkeypatch):
    """The sources load the bundled profile, not the (absent) model folder's."""
    load = engine_base.load_profile
    monkeypatch.setattr(engine_base, "load_profile", lambda name, model_dir: load(name, None))


def test_an_engine_answer_with_an_id_past_the_tokenizer_fails_that_prompt_only(offline_profiles):
    """Qwen3's model samples from 151936 ids, its tokenizer decodes 151669: one such id must quarantine that
    prompt (its per-sample seed makes it again), never raise out of the stage and fail the whole run."""
    def ids(i: int, profile: Any) -> list[int]:
        return [9707, 151700 if i == 1 else 11, profile.eot_id]

    rows = RenderPrompts("qwen3", None)(pa.Table.from_pylist([prompt(i) for i in range(4)]))
    out = ScriptedEngine("qwen3", VLLMSourceConfig(name="vllm"), None, ids)(rows).to_pylist()
    assert [r["status"] for r in out] == ["ok", "quarantine", "ok", "ok"]
    bad = out[1]
    assert (bad["stage"], bad["failure_class"], bad["source"]) == ("generate", "sample", "vllm")
    assert bad["reason"].startswith(f"{UNREADABLE}: ") and "151700" in bad["reason"]
    assert all(r["output_ids"] and r["failure_class"] is None for r in (out[0], out[2], out[3]))


def test_an_unreadable_answer_goes_to_the_next_source_when_there_is_one(offline_profiles):
    a, b = VLLMSourceConfig(name="a"), VLLMSourceConfig(name="b")
    router = build_router([a, b], [SimpleNamespace(name="chat", sources=None)], RoutingConfig(), 8)
    rows = batch_to_rows(RenderPrompts("qwen3", None, None, router)(pa.Table.from_pylist([prompt(0)])))
    first = rows[0]["source"]
    out = ScriptedEngine("qwen3", a if first == "a" else b, router,
                         lambda i, p: [151700, p.eot_id])(rows_to_table(rows)).to_pylist()
    assert out[0]["status"] == "reroute" and out[0]["source"] != first
    assert out[0]["reason"].startswith(f"{first}: {UNREADABLE}")


# --------------------------------------------------------------------------- numbers JSON has no form for


def canonical_id(dataset: str, index: int, messages: list, tools: list | None) -> str:
    canon = json.dumps({"m": messages, "t": tools}, sort_keys=True, ensure_ascii=False).encode()
    return f"{dataset}:{index}:{hashlib.sha256(canon).hexdigest()[:12]}"


def test_nan_infinity_and_overflowing_numbers_are_malformed_rows(tmp_path: Path):
    """Python's json reads NaN, Infinity and 1e400 (as inf); the API sources' JSON reader refuses them, so
    such a row would be "left to do" on every run. It is one malformed row at the read, and a well-formed row
    keeps its id."""
    good_tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1.5, "b": 1e300}}}]
    user = [{"role": "user", "content": "x"}]
    lines = [
        json.dumps({"messages": user, "tools": good_tools}),
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": '
        '{"name": "f", "parameters": {"a": NaN}}}]}',
        '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": '
        '{"name": "f", "parameters": {"a": -1e999}}}]}',
        '{"messages": [{"role": "user", "content": "x"}], "tools": "[{\\"type\\": \\"function\\", \\"function\\": '
        '{\\"name\\": \\"f\\", \\"parameters\\": {\\"a\\": Infinity}}}]"}',
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                  "tool_calls": [{"function": {"name": "f", "arguments": '{"a": NaN}'}}]},
                                 {"role": "tool", "content": "1"}, {"role": "user", "content": "y"}]}),
    ]
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join(lines) + "\n")
    got = list(iter_dataset(DatasetConfig(name="odd", path=str(path)), warn=False))
    assert [ok for ok, _ in got] == [True, False, False, False, False]
    assert got[0][1]["sample_id"] == canonical_id("odd", 0, user, good_tools)
    reasons = [r["reason"] for _, r in got[1:]]
    assert "NaN is not a number JSON allows" in reasons[0] and "odd.jsonl line 2" in reasons[0]
    assert "-1e999 is past the range" in reasons[1]
    assert reasons[2].startswith("malformed row: tools is a string but not valid JSON: Infinity")
    assert reasons[3] == "malformed row: message 1 tool call 0 arguments are not valid JSON"
    assert all(r["stage"] == "read" for _, r in got[1:])


def test_a_nan_in_a_json_list_file_is_that_rows_fault_not_the_files(tmp_path: Path):
    path = tmp_path / "rows.json"
    path.write_text('[{"messages": [{"role": "user", "content": "ok"}]},'
                    ' {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function":'
                    ' {"name": "f", "parameters": {"a": NaN}}}]}]')
    got = list(iter_dataset(DatasetConfig(name="j", path=str(path)), warn=False))
    assert [ok for ok, _ in got] == [True, False]
    # read with the same strict rules a JSONL line gets (NaN is no JSON number), the row alone
    assert got[1][1]["reason"] == ("malformed row: row is not valid JSON (rows.json line 1): NaN is not a number "
                                   "JSON allows")


def test_an_http_row_whose_tools_cannot_be_sent_is_quarantined_not_left_to_do():
    """A row that reached the HTTP source with Infinity in its tools (written before the read refused it) is
    the prompt's own fault: quarantined, class sample, no request sent — not "transient" on every run."""
    from pipeline.demo.openrouter_server import CannedBackend, ServerConfig
    from pipeline.generate.ledger import Ledger
    from pipeline.generate.sources.http.openrouter import OpenRouterGenerator
    from pipeline.profiles import load_profile
    from tests.helpers.server import serve_in_thread
    from tests.unit.test_http_engine_faults import MODEL, cfg_, rows_, run

    rows = rows_(3)
    rows[1]["tools"] = '[{"type": "function", "function": {"name": "f", "parameters": {"a": Infinity}}}]'
    rows[2]["messages"] = '[{"role": "user", "content": "x", "n": NaN}]'
    with serve_in_thread(ServerConfig(seed=1, known_models=(MODEL,)), CannedBackend(1, load_profile("deepseek"))) \
            as (url, _server):
        out = run(OpenRouterGenerator(cfg_(url), "deepseek", None, Ledger()), rows)
    assert out["d:0"]["status"] == "ok"
    for sid in ("d:1", "d:2"):
        assert (out[sid]["status"], out[sid]["failure_class"], out[sid]["attempts"]) == ("quarantined", "sample", 0)
        assert out[sid]["error"].startswith("prompt cannot be sent: its messages or tools are not JSON")


# --------------------------------------------------------------------------- routing gives no source


def test_a_prompt_no_source_may_serve_is_left_to_do_as_config_and_the_report_says_so():
    """Tool prompts under ``exact_ids`` in a run with only an API source: the routing's fault. Left to do
    (never quarantined for good: the fixed routing generates them), the reason names the key, and the report
    tells the user what to fix."""
    api = OpenRouterSourceConfig(name="api", model="m/x")
    datasets = [SimpleNamespace(name="tools", sources=None), SimpleNamespace(name="agent", sources=None)]
    routing = RoutingConfig.model_validate({"tool_prompts": "exact_ids",
                                            "tool_prompts_by_dataset": {"agent": "exact_ids"}})
    router = build_router([api], datasets, routing, 4)
    rows = [prompt(0, "tools", TOOL), prompt(1, "tools"), prompt(2, "agent", TOOL)]
    rendered = RenderPrompts("deepseek", None)(pa.Table.from_pylist(rows))
    out = assign_sources(rendered, router).to_pylist()
    assert [r["status"] for r in out] == ["not_generated", "ok", "not_generated"]
    assert [r["failure_class"] for r in out] == ["config", None, "config"]
    assert "routing.tool_prompts is 'exact_ids'" in out[0]["reason"] and "'tools'" in out[0]["reason"]
    assert "routing.tool_prompts_by_dataset['agent'] is 'exact_ids'" in out[2]["reason"]
    tally = Tally(3, audit_for([DatasetConfig(name="tools", path="x"), DatasetConfig(name="agent", path="x")]))
    for r in tally_of(rows_to_table([out[0], out[2]])).to_pylist():
        tally.add(r)
    assert tally.status["not_generated"] == 2 and sum(tally.unrouted.values()) == 2
    lines = attention_lines({"unrouted": dict(tally.unrouted)})
    assert len(lines) == 2 and all("fix the routing" in ln and "prompts left to do" in ln for ln in lines)


# --------------------------------------------------------------------------- a row handed on


def test_a_row_handed_on_is_credited_to_the_source_that_served_it(offline_profiles):
    """An API source spends 3 requests on a row, its budget is spent, the row goes on to an engine that
    serves it: the row must not carry the API's class ("budget") nor count its requests as the engine's."""
    from pipeline.generate.sources.http.openrouter import merge_outcome

    api, eng = OpenRouterSourceConfig(name="api", model="m/x"), VLLMSourceConfig(name="vllm")
    router = build_router([api, eng], [SimpleNamespace(name="chat", sources=None)],
                          RoutingConfig.model_validate({"sources": {"api": {"weight": 100},
                                                                    "vllm": {"weight": 0.01}}}), 4)
    rows = batch_to_rows(RenderPrompts("deepseek", None, None, router)(
        pa.Table.from_pylist([prompt(i) for i in range(4)])))
    assert {r["source"] for r in rows} == {"api"}
    for r in rows:
        merge_outcome(r, {"status": "not_generated", "error": "budget spent", "attempts": 3,
                          "failure_class": "budget"}, "api", router)
    assert {(r["status"], r["source"], r["attempts"], r["failure_class"]) for r in rows} == \
        {("reroute", "vllm", None, None)}
    out = ScriptedEngine("deepseek", eng, router, lambda i, p: [100, p.eot_id])(rows_to_table(rows))
    tally = Tally(4, audit_for([DatasetConfig(name="chat", path="x")]))
    for r in tally_of(out).to_pylist():
        assert (r["status"], r["source"], r["failure_class"]) == ("ok", "vllm", None)
        tally.add(r)
    assert not tally.requests and not tally.asked and tally.served == Counter(vllm=4)


def test_served_clears_an_earlier_failure_class():
    from pipeline.base.flight import served

    row = {"status": "reroute", "reason": "a: boom", "failure_class": "transient"}
    assert served(row, "b")["failure_class"] is None and row["reason"] == "a: boom"


# --------------------------------------------------------------------------- a stage process that dies


def test_stage_actors_restart_and_retry_boundedly():
    """Ray Data 2.60 defaults both to -1 (for ever) when they are absent: the restarts must be set, and finite
    (a dead actor's batch fails); a task's retries stay unbounded, so a lost node's actor can come back."""
    assert 0 < ACTOR_FAULTS["max_restarts"] < 10 and ACTOR_FAULTS["max_task_retries"] == -1


def died(class_name: str) -> Exception:
    from ray.exceptions import ActorDiedError

    e = ActorDiedError()
    e.error_msg = (f"The actor died unexpectedly before finishing this task.\n\tclass_name: {class_name}\n"
                   "\tactor_id: 0a1b")
    return e


def test_a_dead_actor_is_named_by_its_stage_or_its_sources():
    sources = [VLLMSourceConfig(name="v1"), VLLMSourceConfig(name="v2"), OpenRouterSourceConfig(name="api",
                                                                                                model="m/x")]
    from pipeline.generate.sources.registry import source_kind

    vllm_class = source_kind(sources[0]).actor_class_name
    assert actor_class_of(str(died(f"MapWorker(MapBatches({vllm_class}))"))) == vllm_class
    assert stage_label(vllm_class, sources) == f"source 'v1', 'v2' ({vllm_class})"
    assert stage_label("WriteShards", sources) == "stage 'writer' (WriteShards)"
    assert stage_label(None, sources) == "a stage actor"
    wrapped = RuntimeError("execution failed")
    wrapped.__cause__ = died("MapWorker(MapBatches(RenderPrompts))")
    assert actor_death(wrapped) is wrapped.__cause__
    assert actor_death(ValueError("a bug")) is None


def test_a_stage_death_ends_the_stream_as_stage_died_and_other_errors_pass():
    from pipeline.run.job import stage_deaths_end

    def stream(error: Exception):
        yield 1
        raise error

    sources = [VLLMSourceConfig(name="v1")]
    got = []
    with pytest.raises(StageDied, match=r"^stage 'validate' \(ValidateSamples\): its actor process died"):
        for x in stage_deaths_end(stream(died("MapWorker(MapBatches(ValidateSamples))")), sources):
            got.append(x)
    assert got == [1]
    with pytest.raises(KeyError):
        list(stage_deaths_end(stream(KeyError("a bug")), sources))


def test_the_cli_ends_a_stage_death_with_one_line_and_exit_3(monkeypatch, capsys, repo_root, tmp_path):
    from pipeline.run import job
    from pipeline.run.cli import EXIT_LEFT_TO_DO, main

    def dies(cfg, console=None):
        raise StageDied("source 'vllm' (VLLMGenerator): its actor process died more often than its restarts allow")

    from pipeline.base.console import Console

    monkeypatch.setattr(job, "run", dies)
    monkeypatch.setattr(Console, "for_cli", classmethod(lambda cls, **_: cls()))  # capsys's stdout has no fd
    rc = main(["run", str(repo_root / "configs" / "tiny.yaml"), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == EXIT_LEFT_TO_DO == 3
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("stopped: source 'vllm' (VLLMGenerator)") and "rows left to do; re-run: " in err
