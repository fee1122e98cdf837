"""One Ray Data run over two sources: the tiny target behind a vLLM CPU actor and behind the local
OpenRouter-compatible server (transformers backend). Every prompt is served exactly once, by the source the
router named (or, when that source fails, by the next one), and with greedy decoding the actor's ids equal
those of the same engine called outside Ray (``tiny_llm``).

Starts one vLLM engine (the actor) besides the session's ``tiny_llm``. A second, vLLM-free run checks a
source whose engine fails to start: its prompts move to the next source, or are quarantined, never lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.base.config import ChecksConfig, DatasetConfig, RoutingConfig, SourceRoute
from pipeline.demo.openrouter_server import ServerConfig, TransformersBackend
from pipeline.generate.router import build_router
from pipeline.generate.sources.chain import map_routed, reroute_overrides
from pipeline.generate.sources.engines.config import TransformersSourceConfig, VLLMSourceConfig
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.stages import RenderPrompts
from pipeline.profiles import load_profile
from pipeline.prompts.datasets import load_dataset
from pipeline.run.config import RunConfig
from tests.helpers.server import serve_in_thread

pytestmark = pytest.mark.slow

SAMPLING = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 24, "seed": 0}
FAULT = "[[fault:always-502]] Name three rivers in Europe."


@pytest.fixture(scope="module")
def api_url(tiny_target: Path):
    backend = TransformersBackend(str(tiny_target))
    with serve_in_thread(ServerConfig(), backend) as (url, _server):
        yield url
    backend.close()


@pytest.fixture(scope="module")
def mixed_run(repo_root: Path, tiny_target: Path, ray_session, api_url):
    import ray.data

    datasets = [DatasetConfig(name=n, path=str(repo_root / "data/prompts" / f"{n}.jsonl"), max_rows=k)
                for n, k in (("chat", 8), ("tools", 3))]
    prompts = [p for d in datasets for p in load_dataset(d)[0]]
    sources = [
        OpenRouterSourceConfig(name="api", base_url=api_url, model="tiny/deepseek-tiny", api_key_required=False,
                               num_actors=1, num_cpus=0.25, batch_size=8, max_attempts=2, backoff_base_s=0.05,
                               backoff_max_s=0.1),
        VLLMSourceConfig(name="vllm-cpu", num_actors=1, num_cpus=1, batch_size=8, dtype="float32",
                         max_model_len=2048),
    ]
    routing = RoutingConfig(tool_prompts_by_dataset={"tools": "exact_ids"})
    router = build_router(sources, datasets, routing, len(prompts) + 1)
    # A prompt the API always fails (502), addressed to the API first: it must end on vLLM, not in quarantine.
    candidates = ({"sample_id": f"chat:{100 + i}:fault", "dataset": "chat", "row_index": 100 + i, "tools": "",
                   "messages": json.dumps([{"role": "user", "content": FAULT}]), "thinking": True}
                  for i in range(200))
    fault = next(p for p in candidates if router.ranking(p) == ["api", "vllm-cpu"])
    prompts.append(fault)

    ds = ray.data.from_items(prompts, override_num_blocks=3)
    ds = ds.map_batches(RenderPrompts, fn_constructor_args=("deepseek", str(tiny_target)), batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25)
    ds = map_routed(ds, sources, model_dir=str(tiny_target), profile="deepseek", sampling=SAMPLING, router=router)
    rows = ds.take_all()
    return prompts, router, fault, rows


def direct(llm, prompt_ids: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=SAMPLING["max_tokens"], skip_special_tokens=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_every_prompt_is_served_once_by_its_routed_source(mixed_run):
    prompts, router, fault, rows = mixed_run
    assert sorted(r["sample_id"] for r in rows) == sorted(p["sample_id"] for p in prompts)
    assert all(r["status"] == "ok" for r in rows), [(r["sample_id"], r["reason"]) for r in rows
                                                     if r["status"] != "ok"]
    assert reroute_overrides(rows) == {}
    by_id = {r["sample_id"]: r for r in rows}
    for p in prompts:
        served = by_id[p["sample_id"]]["source"]
        assert served == ("vllm-cpu" if p is fault else router.route(p))
    # transient failures on every attempt: handed to the next source, with the reason it was handed on
    assert by_id[fault["sample_id"]]["reason"].startswith("api: transient failures, 2 attempt(s)")
    assert all(r["source"] == "vllm-cpu" for r in rows if r["dataset"] == "tools")  # exact ids only
    assert {r["source"] for r in rows} == {"api", "vllm-cpu"}


def test_samples_record_their_provenance(mixed_run):
    _, _, _, rows = mixed_run
    for r in rows:
        sampling = json.loads(r["sampling"])
        assert sampling["temperature"] == 0.0 and sampling["max_tokens"] == 24
        if r["source"] == "vllm-cpu":
            assert (r["source_kind"], r["provider"], r["ids_from"]) == ("vllm", "vllm", "engine")
        else:
            assert (r["source_kind"], r["ids_from"]) == ("openrouter", "rebuilt")
            assert r["provider"] in ServerConfig().providers and r["model"]
            assert r["billed_completion_tokens"] > 0


def test_actor_ids_equal_the_engine_called_outside_ray(mixed_run, tiny_llm, tiny_target):
    _, _, _, rows = mixed_run
    rows = sorted(rows, key=lambda r: r["sample_id"])
    expected = direct(tiny_llm, [r["prompt_ids"] for r in rows])
    for r, ids in zip(rows, expected, strict=True):
        if r["source"] == "vllm-cpu":
            assert r["output_ids"] == ids, r["sample_id"]
    # The API's ids are rebuilt from its text (another engine, transformers, behind it): the same greedy answer,
    # though where the model wrote a non-canonical tokenization the rebuilt ids are the canonical ones.
    profile = load_profile("deepseek", str(tiny_target))
    api = [(r, ids) for r, ids in zip(rows, expected, strict=True) if r["source"] == "api"]
    assert api
    for r, ids in api:
        assert profile.decode(r["output_ids"]) == profile.decode(ids), r["sample_id"]


def shard_rows(folder: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_a_source_that_fails_to_start_loses_no_prompt(repo_root, tiny_target, ray_session, tmp_path):
    from pipeline.run.job import run

    lenient = ChecksConfig(**dict.fromkeys(("structure", "roundtrip_rebuilt", "tool_semantics", "repetition",
                                            "max_length"), "flag"))  # the tiny model's text is not the point
    broken = TransformersSourceConfig(name="hf-broken", dtype="no_such_dtype", num_cpus=0.25, batch_size=4)
    working = TransformersSourceConfig(name="hf", dtype="float32", num_cpus=0.5, batch_size=4)

    def go(reroute: bool) -> tuple[dict, list[dict], list[dict]]:
        out = tmp_path / f"reroute-{reroute}"
        cfg = RunConfig(
            output_dir=str(out), model={"profile": "deepseek", "path": str(tiny_target)}, training=None,
            sampling={"temperature": 0.0, "max_tokens": 8},
            datasets=[DatasetConfig(name="chat", path=str(repo_root / "data/prompts/chat.jsonl"), max_rows=4,
                                    checks=lenient)],
            sources=[broken, working],  # every prompt ranks hf-broken first: hf (role overflow) only catches
            routing=RoutingConfig(reroute=reroute, sources={"hf": SourceRoute(role="overflow")}),
        )
        report = run(cfg)
        return report, shard_rows(out / "samples"), shard_rows(out / "quarantine")

    report, samples, quarantine = go(reroute=True)
    assert (report["rows_in"], report["passed"], report["quarantined"], report["not_generated"]) == (4, 4, 0, 0)
    assert not quarantine and {r["source"] for r in samples} == {"hf"} and all(r["output_ids"] for r in samples)
    error = report["sources"]["hf-broken"]["start_error"]
    assert error.startswith("AttributeError: ") and "no_such_dtype" in error
    assert report["sources"]["hf"]["start_error"] is None

    report, samples, quarantine = go(reroute=False)  # no source to hand them to: left to do, a re-run does them
    assert (report["rows_in"], report["passed"], report["quarantined"], report["not_generated"]) == (4, 0, 0, 4)
    assert not samples and not quarantine
    assert report["sources"]["hf-broken"]["start_error"] == error
    assert report["sources"]["hf-broken"]["left_to_do"] == {"engine": 4}
    from pipeline.report.summary import attention_lines

    (line,) = attention_lines(report)
    assert line.startswith(f"  ! source hf-broken: engine failed to start: {error[:40]}") and "4 prompts left" in line


def test_overflow_spills_prompts_a_late_local_engine_has_not_started(repo_root, tiny_target, ray_session, api_url,
                                                                     tmp_path):
    """The local source's declared capacity claims every prompt, but the deadline passes while its engine
    loads: the API takes them all. With no API budget the spilled prompts come back and the local engine
    serves them late. Either way every prompt is served exactly once."""
    from pipeline.run.job import run

    lenient = ChecksConfig(**dict.fromkeys(("structure", "roundtrip_rebuilt", "tool_semantics", "repetition",
                                            "max_length"), "flag"))

    def go(budget: int | None) -> tuple[dict, list[dict]]:
        out = tmp_path / f"spill-{budget}"
        api = OpenRouterSourceConfig(name="api", base_url=api_url, model="tiny/deepseek-tiny", api_key_required=False,
                                     num_actors=1, num_cpus=0.25, batch_size=4,
                                     default_budget="unlimited" if budget is None else budget)
        cfg = RunConfig(
            output_dir=str(out), model={"profile": "deepseek", "path": str(tiny_target)}, training=None,
            sampling={"temperature": 0.0, "max_tokens": 8},
            datasets=[DatasetConfig(name="chat", path=str(repo_root / "data/prompts/chat.jsonl"), max_rows=6,
                                    checks=lenient)],
            sources=[api, TransformersSourceConfig(name="hf", dtype="float32", num_cpus=0.5, batch_size=4)],
            routing=RoutingConfig(mode="overflow", deadline_s=0.001,
                                  sources={"hf": SourceRoute(capacity=1e6), "api": SourceRoute(role="overflow")}),
        )
        report = run(cfg)
        assert (report["rows_in"], report["passed"], report["quarantined"], report["not_generated"]) == (6, 6, 0, 0)
        samples = shard_rows(out / "samples")
        assert sorted(r["sample_id"] for r in samples) == sorted({r["sample_id"] for r in samples})
        return report, samples

    report, samples = go(budget=None)
    assert {r["source"] for r in samples} == {"api"} and all(r["ids_from"] != "engine" for r in samples)
    assert report["sources"]["hf"] == {"kind": "transformers", "served": 0, "spilled": 6, "left_to_do": {},
                                       "start_error": None, "engine_error": None}
    assert report["sources"]["api"]["served"] == 6

    report, samples = go(budget=0)
    assert {r["source"] for r in samples} == {"hf"} and all(r["ids_from"] == "engine" for r in samples)
    assert report["sources"]["hf"]["served"] == 6 and report["sources"]["hf"]["spilled"] == 0
