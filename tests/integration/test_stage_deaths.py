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
