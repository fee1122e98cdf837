"""Local engine sources on the tiny target: exact ids, per-sample seeds, failures that lose no row.

Uses the session's one vLLM engine (``tiny_llm``) handed to the source stage,
and a transformers model; no further vLLM engine is started. An engine that
fails to start is checked on a model folder holding only a tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from pipeline.base.config import DatasetConfig, RoutingConfig, SamplingConfig
from pipeline.base.flight import FLIGHT_SCHEMA, batch_to_rows, rows_to_table
from pipeline.generate.router import build_router
from pipeline.generate.sources.chain import engine_resources, release_placement_groups
from pipeline.generate.sources.engines.base import START_FAILED, start_error_text
from pipeline.generate.sources.engines.config import SGLangSourceConfig, TransformersSourceConfig, VLLMSourceConfig
from pipeline.generate.sources.engines.transformers_source import TransformersGenerator
from pipeline.generate.sources.engines.vllm_source import VLLMGenerator
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.stages import RenderPrompts
from pipeline.prompts.datasets import load_dataset

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 24, "seed": 0}
SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 16, "seed": 5}
VLLM = VLLMSourceConfig(name="vllm-cpu", max_model_len=2048, dtype="float32")
HF = TransformersSourceConfig(name="hf", max_model_len=2048, dtype="float32")


@pytest.fixture(scope="module")
def flight_rows(repo_root: Path, tiny_target: Path) -> list[dict]:
    prompts = []
    for name, fmt in (("chat", "messages"), ("tools", "messages")):
        rows, _ = load_dataset(DatasetConfig(name=name, path=str(repo_root / "data/prompts" / f"{name}.jsonl"),
                                             format=fmt, max_rows=3))
        prompts += rows
    rendered = RenderPrompts("deepseek", str(tiny_target))(pa.Table.from_pylist(prompts))
    return batch_to_rows(rendered)


def fresh(rows: list[dict]) -> list[dict]:
    return json.loads(json.dumps(rows))


def direct(llm, rows: list[dict], sampling: dict) -> list[tuple[list[int], str]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=sampling["temperature"], top_p=sampling["top_p"],
                            max_tokens=sampling["max_tokens"], skip_special_tokens=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in rows], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def test_vllm_stage_keeps_exact_ids_and_isolates_a_bad_prompt(tiny_llm, tiny_target, flight_rows):
    rows = fresh(flight_rows)
    oov = dict(fresh(flight_rows[:1])[0], sample_id="chat:99:oov")
    oov["prompt_ids"] = oov["prompt_ids"] + [10**7]  # rejected by the engine: the whole batch call raises
    other = dict(fresh(flight_rows[:1])[0], sample_id="chat:98:api", source="api")  # routed elsewhere
    stage = VLLMGenerator(str(tiny_target), "deepseek", GREEDY, VLLM, llm=tiny_llm)
    out = stage(rows_to_table(rows + [oov, other])).to_pylist()
    by_id = {r["sample_id"]: r for r in out}
    assert len(out) == len(rows) + 2
    assert by_id["chat:99:oov"]["status"] == "quarantine" and by_id["chat:99:oov"]["stage"] == "generate"
    assert "out of vocabulary" in by_id["chat:99:oov"]["reason"]
    assert by_id["chat:98:api"]["output_ids"] is None and by_id["chat:98:api"]["source"] == "api"
    expected = direct(tiny_llm, rows, GREEDY)
    for r, (ids, finish) in zip(rows, expected, strict=True):
        s = by_id[r["sample_id"]]
        assert s["status"] == "ok" and s["output_ids"] == ids and len(ids) > 0 and s["finish_reason"] == finish
        assert (s["source"], s["source_kind"], s["provider"], s["ids_from"]) == ("vllm-cpu", "vllm", "vllm", "engine")
        assert s["model"] == tiny_target.name and s["finish_reason"] in ("stop", "length")
        assert json.loads(s["sampling"])["temperature"] == 0.0 and "request_seed" in json.loads(s["sampling"])


def test_vllm_failure_is_rerouted_when_the_router_names_a_next_source(tiny_llm, tiny_target, flight_rows):
    sources = [VLLMSourceConfig(name="vllm-cpu"), OpenRouterSourceConfig(name="api", model="m")]
    router = build_router(sources, [SimpleNamespace(name="chat", sources=None)], RoutingConfig(), 10)
    base = fresh(flight_rows[:1])[0]
    # A prompt whose order is vllm-cpu then api, so vLLM's failure hands it on.
    row = next(dict(base, sample_id=f"chat:{i}:oov") for i in range(100)
               if router.ranking({**base, "sample_id": f"chat:{i}:oov"}) == ["vllm-cpu", "api"])
    row["prompt_ids"] = row["prompt_ids"] + [10**7]
    row["source"] = "vllm-cpu"
    stage = VLLMGenerator(str(tiny_target), "deepseek", GREEDY, VLLM, router=router, llm=tiny_llm)
    (out,) = stage(rows_to_table([row])).to_pylist()
    assert (out["status"], out["source"], out["stage"]) == ("reroute", "api", "generate")
    assert out["reason"].startswith("vllm-cpu: engine error")


def test_vllm_seeded_samples_do_not_depend_on_their_batch(tiny_llm, tiny_target, flight_rows):
    stage = VLLMGenerator(str(tiny_target), "deepseek", SAMPLED, VLLM, llm=tiny_llm)
    together = stage(rows_to_table(fresh(flight_rows))).to_pylist()
    alone = stage(rows_to_table(fresh(flight_rows[2:3]))).to_pylist()
    assert alone[0]["output_ids"] == together[2]["output_ids"]
    assert len({tuple(r["output_ids"]) for r in together}) > 1


def test_engine_time_is_split_over_a_batch_by_tokens_and_adds_up_to_the_call(tiny_llm, tiny_target, flight_rows):
    """#27: each sample carries its share of the engine's busy time (``engine_s``, device-seconds): the shares
    add up to the time the stage spent generating, in proportion to the tokens each sample made it process."""
    import time

    rows = fresh(flight_rows)
    oov = dict(fresh(flight_rows[:1])[0], sample_id="chat:99:oov")
    oov["prompt_ids"] = oov["prompt_ids"] + [10**7]  # the batch call raises: rows are retried one at a time
    stage = VLLMGenerator(str(tiny_target), "deepseek", GREEDY, VLLM.model_copy(update={"gpu_hour_usd": 2.0}),
                          llm=tiny_llm)
    t0 = time.perf_counter()
    out = stage(rows_to_table(rows)).to_pylist()
    wall = time.perf_counter() - t0
    shares = [r["engine_s"] for r in out]
    assert all(s > 0 for s in shares) and 0.8 * wall <= sum(shares) <= wall
    per_token = [r["engine_s"] / (len(r["prompt_ids"]) + len(r["output_ids"])) for r in out]
    assert max(per_token) == pytest.approx(min(per_token), rel=1e-9)  # one batch: the same price per token
    # Retried one at a time after a failed batch call: each sample pays its own call, the bad row pays nothing
    # (it is quarantined), and the failed call's time is not put on anyone.
    t0 = time.perf_counter()
    out = stage(rows_to_table(fresh(flight_rows[:2]) + [oov])).to_pylist()
    wall = time.perf_counter() - t0
    by_id = {r["sample_id"]: r for r in out}
    assert by_id["chat:99:oov"]["status"] == "quarantine" and by_id["chat:99:oov"]["engine_s"] in (None, 0.0)
    ok = [r["engine_s"] for r in out if r["status"] == "ok"]
    assert len(ok) == 2 and all(s > 0 for s in ok) and sum(ok) < wall


def test_transformers_greedy_ids_equal_vllm_greedy_ids(tiny_llm, tiny_target, flight_rows):
    rows = fresh(flight_rows[:2] + flight_rows[3:5])  # chat and tool-calling prompts
    stage = TransformersGenerator(str(tiny_target), "deepseek", GREEDY, HF)
    out = stage(rows_to_table(rows)).to_pylist()
    assert [(r["output_ids"], r["finish_reason"]) for r in out] == direct(tiny_llm, rows, GREEDY)
    for r in out:
        assert (r["status"], r["source"], r["source_kind"], r["ids_from"]) == ("ok", "hf", "transformers", "engine")
        assert r["truncated"] == (r["finish_reason"] == "length")


def test_transformers_seeds_and_context_limit(tiny_target, flight_rows):
    rows = fresh(flight_rows[:2])
    stage = TransformersGenerator(str(tiny_target), "deepseek", SAMPLED, HF)
    first = stage(rows_to_table(fresh(rows))).to_pylist()
    again = stage(rows_to_table(fresh(rows[::-1]))).to_pylist()[::-1]
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    renamed = stage(rows_to_table([dict(fresh(rows)[0], sample_id="chat:0:other")])).to_pylist()
    assert renamed[0]["output_ids"] != first[0]["output_ids"]  # the seed follows the sample id
    short = TransformersGenerator(str(tiny_target), "deepseek", SAMPLED, HF.model_copy(update={"max_model_len": 8}))
    out = short(rows_to_table(fresh(rows))).to_pylist()
    assert all(r["status"] == "quarantine" and "does not fit max_model_len 8" in r["reason"] for r in out)


def test_engine_that_fails_to_start_fails_over_its_rows_not_the_run(tmp_path):
    from pipeline.profiles.deepseek import deepseek_tokenizer_dir

    folder = tmp_path / "no-weights"  # the profile loads (tokenizer), the engine does not (no config, no weights)
    folder.mkdir()
    shutil.copy(deepseek_tokenizer_dir() / "tokenizer.json", folder)
    sources = [TransformersSourceConfig(name="hf"), OpenRouterSourceConfig(name="api", model="m")]
    router = build_router(sources, [SimpleNamespace(name="chat", sources=None)], RoutingConfig(), 10)
    rows = []
    for i in range(8):
        row = dict.fromkeys(FLIGHT_SCHEMA.names)
        row.update(sample_id=f"chat:{i}:h", dataset="chat", row_index=i, messages="[]", tools="", thinking=True,
                   prompt_ids=[1, 2, 3], status="ok", stage="", reason="")
        rows.append(dict(row, source=router.route(row)))
    assert {r["source"] for r in rows} == {"hf", "api"}

    with pytest.raises(Exception) as raised:  # on_error raise keeps the old contract: the actor dies, Ray decides
        TransformersGenerator(str(folder), "deepseek", GREEDY, HF.model_copy(update={"on_error": "raise"}))
    stage = TransformersGenerator(str(folder), "deepseek", GREEDY, HF, router=router)
    assert stage.start_error == start_error_text(raised.value) and "no-weights" in stage.start_error
    out = stage(rows_to_table(rows)).to_pylist()
    assert [r["sample_id"] for r in out] == [r["sample_id"] for r in rows]  # nothing dropped
    for before, r in zip(rows, out, strict=True):
        assert r["output_ids"] is None
        if before["source"] == "hf":  # handed on, reason naming the start failure
            assert (r["status"], r["stage"], r["source"]) == ("reroute", "generate", "api")
            assert r["reason"] == f"hf: {START_FAILED}: {stage.start_error}"
            assert (r["start_error_source"], r["start_error"]) == ("hf", stage.start_error)
        else:  # another source's row passes untouched
            assert (r["status"], r["source"], r["reason"]) == ("ok", "api", "")
            assert r["start_error_source"] is None and r["start_error"] is None

    alone = TransformersGenerator(str(folder), "deepseek", GREEDY, HF)  # no next source: left to do, not lost
    out = alone(rows_to_table([dict(r, source="hf") for r in rows])).to_pylist()
    assert all((r["status"], r["stage"], r["source"], r["failure_class"]) == ("not_generated", "generate", "hf",
                                                                              "engine") for r in out)
    assert all(r["reason"] == f"{START_FAILED}: {alone.start_error}" for r in out)
    assert (out[0]["start_error_source"], out[0]["start_error"]) == ("hf", alone.start_error)


def unload(stage: TransformersGenerator) -> None:
    """Empty the engine's weights in place, as a crashed or unloaded engine leaves them."""
    for p in stage.model.parameters():
        p.data = p.data.new_empty(0)


def test_an_engine_that_fails_every_prompt_leaves_them_to_do_and_serves_no_more(tiny_target, flight_rows):
    """A batch that fails, each prompt alone too, says the engine is broken, not the prompts: they are left to
    do (a re-run does them), and the actor leaves every later row to do without asking the engine again."""
    stage = TransformersGenerator(str(tiny_target), "deepseek", GREEDY, HF)
    unload(stage)  # the engine's weights are gone: every generate call raises
    out = stage(rows_to_table(fresh(flight_rows[:3]))).to_pylist()
    assert [r["sample_id"] for r in out] == [r["sample_id"] for r in flight_rows[:3]]
    assert all((r["status"], r["stage"], r["source"], r["failure_class"]) == ("not_generated", "generate", "hf",
                                                                              "engine") for r in out)
    assert stage.halted and stage.halted.startswith("engine error: ") and "each alone too" in stage.halted
    assert all(r["reason"] == stage.halted and r["output_ids"] is None for r in out)
    stage.model = None  # a later batch never reaches the engine (it would raise another error here)
    later = stage(rows_to_table(fresh(flight_rows[3:5]))).to_pylist()
    assert all((r["status"], r["failure_class"], r["reason"]) == ("not_generated", "engine", stage.halted)
               for r in later)

    single = TransformersGenerator(str(tiny_target), "deepseek", GREEDY, HF)
    unload(single)
    (one,) = single(rows_to_table(fresh(flight_rows[:1]))).to_pylist()  # one prompt alone: the engine or it?
    assert (one["status"], one["failure_class"]) == ("not_generated", "engine") and single.halted is None
    assert one["reason"].startswith("engine error: ")


def test_start_errors_are_one_capped_line_without_tokens(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_s3cretvalue")
    err = OSError("401 for https://hf.co/x with token hf_s3cretvalue\n  header Bearer abc.def " + "x" * 2000)
    text = start_error_text(err)
    assert text.startswith("OSError: 401 for") and "\n" not in text and len(text) <= 500
    assert "hf_s3cretvalue" not in text and "abc.def" not in text


def test_engine_resources_per_tensor_parallel_layout(ray_session):
    """CPU engines hold CPUs only; one GPU engine holds its GPUs; vLLM TP > 1 gets a STRICT_PACK placement
    group of TP GPU bundles that its Ray-spawned TP workers join; SGLang's actor holds all TP GPUs itself."""
    import ray
    from ray.util.placement_group import remove_placement_group

    assert engine_resources(VLLMSourceConfig(num_cpus=1)) == {"num_cpus": 1.0}
    assert engine_resources(VLLMSourceConfig(num_gpus=1)) == {"num_cpus": 1.0, "num_gpus": 1.0}
    sglang = SGLangSourceConfig(num_gpus=8, tensor_parallel_size=8)
    assert engine_resources(sglang, ray_tp=False) == {"num_cpus": 1.0, "num_gpus": 8.0}
    tp4 = engine_resources(VLLMSourceConfig(num_gpus=1, tensor_parallel_size=4, num_cpus=2))
    assert tp4["num_cpus"] == 0 and tp4["num_gpus"] == 0  # the bundles, not the actor, hold the devices
    args = tp4["ray_remote_args_fn"]()  # what Ray Data calls for each new actor
    pg = args["scheduling_strategy"].placement_group
    try:
        assert pg.bundle_specs == [{"GPU": 1.0, "CPU": 1.0}] * 4
        assert args["scheduling_strategy"].placement_group_capture_child_tasks
        assert ray.util.placement_group_table(pg)["strategy"] == "STRICT_PACK"
        # the groups outlive their actors: the driver removes every one it made once the dataset has run
        second = tp4["ray_remote_args_fn"]()["scheduling_strategy"].placement_group
        assert release_placement_groups() == 2
        assert {ray.util.placement_group_table(g)["state"] for g in (pg, second)} == {"REMOVED"}
        assert release_placement_groups() == 0
    finally:
        if ray.util.placement_group_table(pg)["state"] != "REMOVED":
            remove_placement_group(pg)  # a CPU cluster can never place it


def test_engine_pool_scales_up_to_max_actors_each_starting_once(repo_root, clean_target, ray_session, ray_head):
    """num_actors 1, max_actors 2: a queue of batches behind one busy engine makes Ray Data add the second
    actor; each actor starts its engine once (no restarts) and serves several batches; every prompt once."""
    import ray.data
    from ray.util.state import list_actors

    from pipeline.generate.sources.chain import map_routed

    actor_class = "MapWorker(MapBatches(TransformersGenerator))"

    def engine_actors() -> dict[str, object]:
        # the session's own head, by its address: a machine running other Ray jobs has more than one Ray
        found = list_actors(address=ray_head.dashboard, filters=[("class_name", "=", actor_class)], detail=True,
                            limit=10_000, raise_on_missing_output=False)
        return {a.actor_id: a for a in found}

    before = set(engine_actors())
    d = DatasetConfig(name="chat", path=str(repo_root / "data/prompts/chat.jsonl"))
    prompts = load_dataset(d)[0]
    src = TransformersSourceConfig(name="hf", dtype="float32", num_cpus=0.5, batch_size=2, num_actors=1,
                                   max_actors=2)
    router = build_router([src], [d], RoutingConfig(), len(prompts))
    ds = ray.data.from_items(prompts, override_num_blocks=len(prompts) // 2)
    ds = ds.map_batches(RenderPrompts, fn_constructor_args=("deepseek", str(clean_target)), batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25)
    ds = map_routed(ds, [src], model_dir=str(clean_target), profile="deepseek",
                    sampling=SamplingConfig(**{**GREEDY, "max_tokens": 64}), router=router)
    rows = ds.take_all()
    assert sorted(r["sample_id"] for r in rows) == sorted(p["sample_id"] for p in prompts)
    assert all(r["status"] == "ok" and r["output_ids"] for r in rows)
    new = {k: a for k, a in engine_actors().items() if k not in before}
    # Ray Data adds the second actor only when its autoscaler sees the queue backed up in time; on a loaded
    # machine the one actor may drain it first. What is ours to hold: never past max_actors, each engine
    # started once, every prompt back once.
    assert 1 <= len(new) <= 2, f"expected 1..max_actors=2 actors, got {len(new)}"
    assert all(a.num_restarts == 0 for a in new.values())
    assert len(prompts) // src.batch_size > len(new)  # more batches than engine start-ups
