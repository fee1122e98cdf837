"""A source actor whose process dies on a batch (a segfault, the OOM killer) is brought back and the batch re-run
a bounded number of times, then the run ends naming the source (``StageDied``: exit 3) — on Ray Data's
defaults it was restarted and re-run for ever."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.base.config import RoutingConfig, SamplingConfig
from pipeline.base.flight import FLIGHT_SCHEMA
from pipeline.generate.router import build_router
from pipeline.generate.sources import chain
from pipeline.generate.sources.chain import ACTOR_FAULTS, StageDied, map_source
from pipeline.generate.sources.engines.config import TransformersSourceConfig


def test_a_batch_that_kills_its_engine_actor_ends_the_run_after_bounded_retries(ray_session, tmp_path: Path,
                                                                                 monkeypatch):
    import ray.data

    from pipeline.run.job import stage_deaths_end

    marker = tmp_path / "deaths"
    marker.touch()

    class Crashing:  # defined here: Ray pickles it by value into the actor
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __call__(self, batch):
            # a bound of its own (8 deaths), so that unbounded restarts make this test fail rather than hang
            if "c:3" in batch.column("sample_id").to_pylist() and marker.read_text().count("died") < 8:
                with open(marker, "a") as f:
                    f.write("died\n")
                os._exit(1)  # the process dies, as under a segfault or the OOM killer
            return batch

    kind = SimpleNamespace(spends=False, layout="engine", actor_class=lambda: Crashing,
                           actor_class_name=Crashing.__name__)
    monkeypatch.setattr(chain, "source_kind", lambda src: kind)
    src = TransformersSourceConfig(name="hf", num_gpus=0, num_cpus=0.5, batch_size=2)
    router = build_router([src], [SimpleNamespace(name="c", sources=None)], RoutingConfig(), 8)
    rows = [dict.fromkeys(FLIGHT_SCHEMA.names) | {"sample_id": f"c:{i}", "dataset": "c", "status": "ok"}
            for i in range(8)]
    ds = ray.data.from_items(rows, override_num_blocks=4)
    ds = map_source(ds, src, model_dir="/none", profile="deepseek", sampling=SamplingConfig(), router=router)
    t0 = time.monotonic()
    with pytest.raises(StageDied, match=r"^source 'hf' \(Crashing\): its actor process died"):
        for _ in stage_deaths_end(ds.iter_batches(batch_format="pyarrow", batch_size=None), [src]):
            pass
    deaths = marker.read_text().count("died")
    assert deaths == 1 + ACTOR_FAULTS["max_restarts"], deaths  # the actor came back 4 times, then the run ended
    assert time.monotonic() - t0 < 180


def test_a_prompt_that_kills_its_engine_process_is_found_and_quarantined(ray_session, tmp_path: Path, monkeypatch):
    """The notes of ``engines/deaths.py`` on real Ray: a prompt whose engine call kills the process (alone too)
    costs three deaths (its batch, then itself alone twice) and is quarantined as its own fault; the other rows
    of its batch and of the run are served; a later run quarantines it unsent, whatever its batch."""
    import ray.data

    from pipeline.base.layout import RunLayout
    from pipeline.generate.sources.engines.base import EngineResult, EngineSource
    from pipeline.generate.sources.engines.deaths import ALONE_DEATHS, KILLER, DeathNotes, clear_batch_notes
    from pipeline.run.job import stage_deaths_end

    calls = tmp_path / "calls"
    calls.touch()

    class Killing(EngineSource):  # defined here: Ray pickles it by value into the actor
        def generate_rows(self, rows):
            ids = [r["sample_id"] for r in rows]
            with open(calls, "a") as f:
                f.write(" ".join(ids) + ("  died" if "c:3" in ids else "") + "\n")
            if "c:3" in ids and calls.read_text().count("died") < 8:  # a bound, so a regression fails, not hangs
                os._exit(1)  # the engine's crash takes the process, as a segfault would
            return [EngineResult([int(self.profile.eot_id)], "stop", 0.0) for _ in rows]

    kind = SimpleNamespace(spends=False, layout="engine", actor_class=lambda: Killing,
                           actor_class_name=Killing.__name__)
    monkeypatch.setattr(chain, "source_kind", lambda src: kind)
    src = TransformersSourceConfig(name="hf", num_gpus=0, num_cpus=0.5, batch_size=4)
    layout = RunLayout(tmp_path / "run")

    def run(ids: list[str]) -> dict[str, dict]:
        router = build_router([src], [SimpleNamespace(name="c", sources=None)], RoutingConfig(), len(ids))
        rows = [dict.fromkeys(FLIGHT_SCHEMA.names) | {"sample_id": i, "dataset": "c", "status": "ok",
                                                       "prompt_ids": [1, 2, 3], "thinking": False} for i in ids]
        ds = ray.data.from_items(rows, override_num_blocks=len(ids) // 4)
        ds = map_source(ds, src, model_dir="", profile="deepseek", sampling=SamplingConfig(), router=router,
                        layout=layout)  # "": the profile's packaged tokenizer
        out = {}
        for batch in stage_deaths_end(ds.iter_batches(batch_format="pyarrow", batch_size=None), [src]):
            out |= {r["sample_id"]: r for r in batch.to_pylist()}
        return out

    out = run([f"c:{i}" for i in range(8)])
    assert calls.read_text().count("died") == 1 + ALONE_DEATHS  # its batch once, then itself alone twice
    # Alone: after the others in the first pass (nothing pointed at it yet), second in the next (after one row
    # that shows the fresh engine serves); then never again. The others are served again after each death (what
    # a dead process served is lost with it).
    assert [c for c in calls.read_text().splitlines() if "c:3" in c] == ["c:0 c:1 c:2 c:3  died"] + \
        ["c:3  died"] * ALONE_DEATHS
    alone = sorted(c for c in calls.read_text().splitlines() if len(c) == 3)
    assert alone == ["c:0", "c:0", "c:0", "c:1", "c:1", "c:2", "c:2"], alone
    assert sorted(out) == [f"c:{i}" for i in range(8)]
    killed = out.pop("c:3")
    assert killed["status"] == "quarantine" and killed["failure_class"] == "sample", killed
    assert killed["reason"].startswith(KILLER) and f"alone {ALONE_DEATHS} times" in killed["reason"]
    assert {r["status"] for r in out.values()} == {"ok"}
    assert {r["output_ids"] == [] or r["output_ids"] is not None for r in out.values()} == {True}
    assert not list(layout.engine_deaths.glob("*/batch-*.json"))  # every batch came back: no note left
    assert DeathNotes(layout, "hf").alone_deaths("c:3") == ALONE_DEATHS

    # A later run: no note of a batch survives its start, and the prompt's count does; in another batch it is
    # quarantined unsent, no process dies.
    assert clear_batch_notes(layout) == 0
    before = calls.read_text()
    out = run(["c:3", "c:8", "c:9", "c:10"])
    assert calls.read_text()[len(before):].split() == ["c:8", "c:9", "c:10"]
    assert out["c:3"]["status"] == "quarantine" and out["c:3"]["reason"].startswith(KILLER)
    assert [out[i]["status"] for i in ("c:8", "c:9", "c:10")] == ["ok"] * 3
