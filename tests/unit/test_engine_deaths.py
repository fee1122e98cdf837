"""The notes that find a prompt killing its engine's process (pipeline.generate.sources.engines.deaths), on the
engine source's own row plumbing: a process death is a ``BaseException`` that escapes the source (its
``_attempt`` catches only ``Exception``), and the next process is a fresh source on the same folder, as Ray's
restart of the actor would be. tests/integration/test_stage_deaths.py runs the same on real Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.base.config import SamplingConfig
from pipeline.base.flight import FLIGHT_SCHEMA, rows_to_table
from pipeline.base.layout import RunLayout
from pipeline.generate.sources.engines.base import EngineResult, EngineSource
from pipeline.generate.sources.engines.config import TransformersSourceConfig
from pipeline.generate.sources.engines.deaths import (
    ALONE_DEATHS,
    KILLER,
    DeathNotes,
    alone_order,
    clear_batch_notes,
)


class Died(BaseException):
    """The process dying under the engine (a segfault, the OOM killer)."""


def source(layout: RunLayout, dies_on: set[str] | None, calls: list[list[str]]) -> EngineSource:
    """A fresh process's source whose engine dies on any call holding an id of ``dies_on`` (None: on every
    call)."""

    class Engine(EngineSource):
        def generate_rows(self, rows):
            ids = [r["sample_id"] for r in rows]
            calls.append(ids)
            if dies_on is None or dies_on & set(ids):
                raise Died
            return [EngineResult([int(self.profile.eot_id)], "stop", 0.0) for _ in rows]

    return Engine("", "deepseek", SamplingConfig(), TransformersSourceConfig(name="hf", num_gpus=0), layout=layout)


def batch(ids: list[str]):
    return rows_to_table([dict.fromkeys(FLIGHT_SCHEMA.names) | {"sample_id": i, "dataset": "c", "status": "ok",
                                                               "prompt_ids": [1, 2, 3], "thinking": False}
                          for i in ids])


def serve_until_done(layout: RunLayout, ids: list[str], dies_on: set[str] | None, processes: int = 5,
                     calls: list[list[str]] | None = None) -> tuple[dict[str, dict] | None, int]:
    """Ray's restarts: the same batch to a fresh process after each death, ``processes`` in all. Returns the
    rows (None when every process died) and the deaths."""
    calls = [] if calls is None else calls
    for deaths in range(processes):
        try:
            out = source(layout, dies_on, calls)(batch(ids))
        except Died:
            continue
        return {r["sample_id"]: r for r in out.to_pylist()}, deaths
    return None, processes


def test_a_prompt_that_kills_the_process_costs_three_deaths_then_is_quarantined(tmp_path: Path):
    layout = RunLayout(tmp_path)
    calls: list[list[str]] = []
    out, deaths = serve_until_done(layout, ["a", "b", "k", "c"], {"k"}, calls=calls)
    assert deaths == 1 + ALONE_DEATHS
    assert out is not None and out["k"]["status"] == "quarantine" and out["k"]["failure_class"] == "sample"
    assert out["k"]["reason"].startswith(KILLER) and out["k"]["output_ids"] is None
    assert [out[i]["status"] for i in "abc"] == ["ok"] * 3
    assert ["k"] not in calls[-3:]  # the last process never sent it
    assert not list(layout.engine_deaths.glob("*/batch-*.json"))
    # a later batch with it: quarantined unsent, nothing dies
    calls.clear()
    out, deaths = serve_until_done(layout, ["k", "d"], {"k"}, calls=calls)
    assert deaths == 0 and calls == [["d"]] and out["k"]["status"] == "quarantine"
    calls.clear()
    out, deaths = serve_until_done(layout, ["k"], {"k"}, calls=calls)  # a batch of it alone: the engine not called
    assert deaths == 0 and calls == [] and out["k"]["status"] == "quarantine"


def test_an_engine_that_dies_on_every_prompt_quarantines_none(tmp_path: Path):
    """Its deaths come before it served anything: the engine is broken, not its prompts. Every process dies,
    the run would end (StageDied) with the rows left to do, never quarantined for good."""
    layout = RunLayout(tmp_path)
    out, deaths = serve_until_done(layout, ["a", "b", "c"], None, processes=12)
    assert out is None and deaths == 12
    notes = DeathNotes(layout, "hf")
    assert [notes.is_killer(i) for i in "abc"] == [False] * 3
    # each death but the batch's (the first) was one row's, alone; the last is counted by a process to come
    assert sum(notes.alone_deaths(i) for i in "abc") == 12 - 2


def test_one_death_alone_is_not_the_prompts_fault(tmp_path: Path):
    """A process lost once while serving a row alone (a node, another tenant's memory): the row is served by
    the next process, not quarantined."""
    layout = RunLayout(tmp_path)
    flaky = {"b"}
    calls: list[list[str]] = []

    class Once(set):  # dies on "b" the first two times it is sent (batch, then alone), then serves it
        def __and__(self, other):
            hit = set.__and__(self, other)
            if hit and sum("b" in c for c in calls) > 2:
                return set()
            return hit

    out, deaths = serve_until_done(layout, ["a", "b"], Once(flaky), calls=calls)
    assert deaths == 2 and out is not None and out["b"]["status"] == "ok"
    assert DeathNotes(layout, "hf").alone_deaths("b") == 1 and not DeathNotes(layout, "hf").is_killer("b")


def test_a_run_start_clears_batch_notes_and_keeps_the_counts(tmp_path: Path):
    layout = RunLayout(tmp_path)
    notes = DeathNotes(layout, "hf")
    notes.serving(["a", "b"], "a", after_served=True)  # a process was killed with the batch (a driver's ^C)
    assert clear_batch_notes(layout) == 1
    assert notes.arrive(["a", "b"]) is False and notes.alone_deaths("a") == 0  # no death counted
    notes.serving(["a", "b"], "a", after_served=True)
    assert notes.arrive(["a", "b"]) is True and notes.alone_deaths("a") == 1
    notes.done(["a", "b"])
    assert clear_batch_notes(layout) == 0 and notes.alone_deaths("a") == 1


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", '{"serving": 3}', '{"serving": "zz"}', "\udcff"])
def test_a_torn_or_foreign_note_counts_no_death_against_a_prompt(tmp_path: Path, text: str):
    notes = DeathNotes(RunLayout(tmp_path), "hf")
    notes.folder.mkdir(parents=True)
    notes.batch_path(["a"]).write_text(text, errors="surrogateescape")
    notes.arrive(["a"])
    assert notes.alone_deaths("a") == 0
    notes.sample_path("a").write_text('{"deaths_alone": true, "after_served": "x"}')
    assert notes.alone_deaths("a") == 0 and not notes.is_killer("a")


def test_alone_order_puts_one_clean_row_first_then_the_suspects():
    rows = ["a", "b", "c", "d"]
    assert alone_order(rows, {}, str) == rows
    assert alone_order(rows, {"c": 1, "d": 2}, str) == ["a", "d", "c", "b"]
    assert alone_order(["c", "d"], {"c": 1, "d": 2}, str) == ["d", "c"]


def test_an_engine_found_dead_ends_its_process_in_a_run(tmp_path: Path, monkeypatch):
    """vLLM's engine core dying shows in the actor as ``EngineDeadError`` on every later call: in a run the actor
    exits, so Ray restarts it with a fresh engine and the notes above do the rest. Outside a run (no folder) the
    rows are left to do, as before."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from pipeline.generate.sources.engines import base
    from pipeline.generate.sources.engines.config import VLLMSourceConfig
    from pipeline.generate.sources.engines.vllm_source import VLLMGenerator

    exits: list[int] = []

    def exit_(code: int) -> None:
        exits.append(code)
        raise Died

    monkeypatch.setattr(base.os, "_exit", exit_)

    class DeadCore(VLLMGenerator):  # the real class's verdict on the real error; the engine itself never starts
        def generate_rows(self, rows):
            raise EngineDeadError()

    cfg = VLLMSourceConfig(name="v", num_gpus=0)
    assert DeadCore("", "deepseek", SamplingConfig(), cfg, llm=object()).engine_dead(EngineDeadError())
    assert not DeadCore("", "deepseek", SamplingConfig(), cfg, llm=object()).engine_dead(RuntimeError("a request"))
    in_run = DeadCore("", "deepseek", SamplingConfig(), cfg, llm=object(), layout=RunLayout(tmp_path))
    with pytest.raises(Died):
        in_run(batch(["a", "b"]))
    assert exits == [1] and DeathNotes(RunLayout(tmp_path), "v").arrive(["a", "b"])  # the batch's death noted
    out = DeadCore("", "deepseek", SamplingConfig(), cfg, llm=object())(batch(["a", "b"])).to_pylist()
    assert [r["status"] for r in out] == ["not_generated"] * 2 and exits == [1]
