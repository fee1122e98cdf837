"""Local engine sources generate under the configured sampling only, and say so truthfully.

- transformers: a model folder's ``generation_config.json`` (repetition_penalty, min_new_tokens, ...) does not
  change the ids (transformers would fill unset fields from it; vLLM and SGLang do not);
- vLLM: every finish reason of 0.32 is mapped (``repetition`` an answer cut off, ``error`` left to do, ``abort``
  the prompt's failure) and the profile's end of turn stops an answer;
- SGLang: a sample sent no seed records ``request_seed`` null; ``extra_engine_args`` cannot override what the
  adapter owns (refused at config load, naming the key).
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from pydantic import ValidationError

from pipeline.base.config import ConfigError, DatasetConfig
from pipeline.base.flight import FLIGHT_SCHEMA, batch_to_rows, rows_to_table
from pipeline.generate.sources.engines.base import request_seed
from pipeline.generate.sources.engines.config import (
    SGLANG_OWNED_ARGS,
    SGLangSourceConfig,
    TransformersSourceConfig,
    VLLMSourceConfig,
)
from pipeline.generate.sources.engines.sglang_source import SGLangGenerator, engine_kwargs
from pipeline.generate.sources.engines.transformers_source import TransformersGenerator
from pipeline.generate.stages import RenderPrompts
from pipeline.profiles.deepseek import deepseek_tokenizer_dir
from pipeline.prompts.datasets import load_dataset
from pipeline.run.config import load_config

GREEDY = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "seed": 0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 16, "seed": 7}
TOKENIZER_DIR = str(deepseek_tokenizer_dir())  # a model folder the profile loads (the engines here are scripted)


def flight_row(i: int, prompt_ids: list[int], source: str = "") -> dict[str, Any]:
    row = dict.fromkeys(FLIGHT_SCHEMA.names)
    row.update(sample_id=f"chat:{i}:h", dataset="chat", row_index=i, messages="[]", tools="", thinking=False,
               prompt_ids=prompt_ids, status="ok", stage="", reason="", source=source)
    return row


# --------------------------------------------------------------------------- transformers


def with_generation_config(src: Path, dst: Path, extra: dict[str, Any]) -> Path:
    """``src``'s model folder (files linked) whose generation_config.json adds ``extra``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**config, **extra}))
    return dst


def test_transformers_ids_ignore_the_folders_generation_config(repo_root, clean_target, tmp_path):
    """A folder asking for repetition_penalty 1.3 and min_new_tokens 30 gives the clean folder's ids: only the
    configured sampling applies, as in vLLM (which ignores those fields when it is sent SamplingParams)."""
    prompts, _ = load_dataset(DatasetConfig(name="chat", path=str(repo_root / "data/prompts/chat.jsonl"),
                                            format="messages", max_rows=3))
    rendered = batch_to_rows(RenderPrompts("deepseek", str(clean_target))(pa.Table.from_pylist(prompts)))
    leaky = with_generation_config(clean_target, tmp_path / "leaky",
                                   {"repetition_penalty": 1.3, "min_new_tokens": 30, "no_repeat_ngram_size": 2})
    cfg = TransformersSourceConfig(name="hf", max_model_len=2048, dtype="float32")
    out = {}
    for folder in (clean_target, leaky):
        stage = TransformersGenerator(str(folder), "deepseek", GREEDY, cfg)
        assert stage.start_error is None
        assert stage.model.generation_config.repetition_penalty in (None, 1.0)
        rows = stage(rows_to_table(json.loads(json.dumps(rendered)))).to_pylist()
        out[folder] = [(r["status"], r["output_ids"], r["finish_reason"]) for r in rows]
    clean = out[clean_target]
    assert all(status == "ok" for status, _, _ in clean)
    assert any(finish == "stop" and len(ids) < 30 for _, ids, finish in clean)  # min_new_tokens would show
    assert out[leaky] == clean


# --------------------------------------------------------------------------- vLLM


class ScriptedLLM:
    """A ``vllm.LLM`` stand-in answering each prompt with fixed ids and finish reason, keeping the params sent."""

    def __init__(self, answers: list[tuple[list[int], str]]) -> None:
        self.answers = answers
        self.params: list[Any] = []

    def generate(self, prompts: list[Any], params: list[Any], use_tqdm: bool = False) -> list[Any]:
        self.params += params
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, finish_reason=finish)])
                for ids, finish in self.answers[: len(prompts)]]


def test_vllm_finish_reasons_and_end_of_turn_stop():
    """vLLM 0.32 finishes with stop, length, abort, error or repetition: ``repetition`` keeps its ids flagged
    truncated (no end of turn), ``error`` (retryable, the engine's) leaves the row to do, ``abort`` quarantines
    the prompt; every request stops on the profile's end of turn."""
    pytest.importorskip("vllm")
    from vllm.v1.engine import FINISH_REASON_STRINGS

    from pipeline.generate.sources.engines.vllm_source import VLLMGenerator

    assert set(FINISH_REASON_STRINGS) == {"stop", "length", "abort", "error", "repetition"}
    llm = ScriptedLLM([([7, 8, 1], "stop"), ([7, 7, 7, 7], "repetition"), ([7, 9], "error"), ([7], "abort")])
    stage = VLLMGenerator(TOKENIZER_DIR, "deepseek", GREEDY, VLLMSourceConfig(name="v"), llm=llm)
    out = stage(rows_to_table([flight_row(i, [0, 5, 6]) for i in range(4)])).to_pylist()
    stop, rep, err, abort = out
    assert (stop["status"], stop["finish_reason"], stop["truncated"]) == ("ok", "stop", False)
    assert (rep["status"], rep["output_ids"], rep["finish_reason"], rep["truncated"]) == \
        ("ok", [7, 7, 7, 7], "repetition", True)
    assert (err["status"], err["failure_class"], err["output_ids"]) == ("not_generated", "engine", None)
    assert "'error'" in err["reason"] and stage.halted is None
    assert (abort["status"], abort["failure_class"]) == ("quarantine", "sample")
    eot = stage.profile.eot_id
    assert [p.stop_token_ids for p in llm.params] == [[eot]] * 4


# --------------------------------------------------------------------------- SGLang


class FakeEngine:
    """Answers as ``sglang.Engine.generate`` does with skip_tokenizer_init; keeps what it was started and sent."""

    started: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        FakeEngine.started.append(kwargs)

    def generate(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        FakeEngine.sent += sampling_params
        return [{"output_ids": [7, 1], "meta_info": {"finish_reason": {"type": "stop", "matched": 1},
                                                     "e2e_latency": 0.1}} for _ in input_ids]

    def shutdown(self) -> None:
        pass


@pytest.fixture
def fake_sglang(monkeypatch):
    module = types.ModuleType("sglang")
    module.__spec__ = importlib.machinery.ModuleSpec("sglang", None)
    module.Engine = FakeEngine
    monkeypatch.setitem(sys.modules, "sglang", module)
    FakeEngine.started, FakeEngine.sent = [], []
    return FakeEngine


def test_sglang_records_a_seed_only_when_it_sent_one(fake_sglang):
    """``deterministic: false`` at temperature > 0 sends no per-sample seed: the sample's provenance says
    ``request_seed`` null, not a seed that never reached the engine. By default the seed is sent and recorded."""
    recorded = {}
    for deterministic in (None, False):
        cfg = SGLangSourceConfig(name="sg", deterministic=deterministic)
        stage = SGLangGenerator(TOKENIZER_DIR, "deepseek", SAMPLED, cfg)
        assert stage.start_error is None
        (row,) = stage(rows_to_table([flight_row(3, [0, 5, 6])])).to_pylist()
        assert row["status"] == "ok" and row["output_ids"] == [7, 1]
        recorded[deterministic] = (json.loads(row["sampling"])["request_seed"], fake_sglang.sent.pop())
    seed, params = recorded[None]
    assert params["sampling_seed"] == seed == request_seed("chat:3:h", SAMPLED["seed"])
    assert fake_sglang.started[0]["enable_deterministic_inference"] is True
    seed, params = recorded[False]
    assert "sampling_seed" not in params and seed is None
    assert "enable_deterministic_inference" not in fake_sglang.started[1]


@pytest.mark.parametrize("key", sorted(SGLANG_OWNED_ARGS))
def test_sglang_extra_engine_args_cannot_override_owned_keys(key):
    with pytest.raises(ValidationError, match=rf"extra_engine_args\.{key} is owned by the adapter"):
        SGLangSourceConfig(name="sg", extra_engine_args={key: 1})


def test_sglang_extra_engine_args_pass_through_and_refusal_at_config_load(tmp_path):
    cfg = SGLangSourceConfig(name="sg", extra_engine_args={"kv_cache_dtype": "fp8_e5m2", "chunked_prefill_size": 1})
    kw = engine_kwargs("/m", cfg, seed=3, sampled=True)
    assert kw["kv_cache_dtype"] == "fp8_e5m2" and kw["random_seed"] == 3 and kw["skip_tokenizer_init"] is True

    (tmp_path / "chat.jsonl").write_text("{}\n")
    run = {"output_dir": "out", "model": {"profile": "deepseek", "path": "models/tiny", "build_tiny": True},
           "datasets": [{"name": "chat", "path": "chat.jsonl", "format": "messages"}],
           "sources": [{"kind": "sglang", "name": "sg",
                        "extra_engine_args": {"preferred_sampling_params": '{"repetition_penalty": 1.3}'}}]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    with pytest.raises(ConfigError, match=r"extra_engine_args\.preferred_sampling_params is owned by the adapter"):
        load_config(path, base_dir=tmp_path)
