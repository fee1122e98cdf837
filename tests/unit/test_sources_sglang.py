"""SGLang source on CPU: everything around the engine call, with response dicts shaped as sglang.Engine returns."""

from __future__ import annotations

import json

import pytest

from pipeline.base.config import ChecksConfig, SamplingConfig
from pipeline.base.records import empty_sample
from pipeline.checks.validate import check_structure
from pipeline.generate.sources.engines.base import fill_from_engine, request_seed
from pipeline.generate.sources.engines.config import SGLangSourceConfig
from pipeline.generate.sources.engines.sglang_source import (
    SGLangGenerator,
    engine_kwargs,
    result_from_response,
    sampling_params,
    sglang_available,
)
from pipeline.profiles import load_profile


@pytest.fixture(scope="module")
def profile():
    return load_profile("deepseek")


def meta(finish: dict, n: int, **kw) -> dict:
    """meta_info as SGLang's tokenizer manager builds it for a finished request (skip_tokenizer_init)."""
    return {"id": "5f0c2d8e9a7b4c1e", "finish_reason": finish, "prompt_tokens": 21, "weight_version": "default",
            "total_retractions": 0, "completion_tokens": n, "cached_tokens": 0, "e2e_latency": 0.183, **kw}


def response_ids(profile, reasoning: str, content: str) -> list[int]:
    return profile.tokenizer.encode(reasoning) + [profile.think_end_id] + profile.tokenizer.encode(content) \
        + [profile.eot_id]


def sample_row(thinking: bool = True) -> dict:
    row = empty_sample({"sample_id": "chat:3:ab12", "dataset": "chat", "row_index": 3,
                        "messages": json.dumps([{"role": "user", "content": "hi"}]), "tools": "",
                        "thinking": thinking, "prompt_ids": [0, 5, 6, 7], "prompt_assistant_mask": [0, 0, 0, 0]})
    return row


def test_stop_response_becomes_a_valid_sample(profile):
    ids = response_ids(profile, "The user greets me.", "Hello! How can I help?")
    resp = {"output_ids": ids, "meta_info": meta({"type": "stop", "matched": profile.eot_id}, len(ids))}
    res = result_from_response(resp, 9.0)
    assert (res.ids, res.finish, res.seconds, res.error) == (ids, "stop", 0.183, None)
    row = sample_row()
    fill_from_engine(row, profile, res.ids, res.finish, res.seconds)
    assert row["reasoning"].strip() == "The user greets me." and row["content"].strip() == "Hello! How can I help?"
    assert row["truncated"] is False and row["finish_reason"] == "stop"
    assert check_structure(row, profile, ChecksConfig()) is None


def test_trimmed_stop_id_is_restored_from_meta_info(profile):
    ids = response_ids(profile, "Short.", "Yes.")
    resp = {"output_ids": ids[:-1], "meta_info": meta({"type": "stop", "matched": profile.eot_id}, len(ids))}
    assert result_from_response(resp, 0.0).ids == ids
    # A stop string match (text, not an id) leaves the ids as returned.
    resp = {"output_ids": ids[:-1], "meta_info": meta({"type": "stop", "matched": "\n\n"}, len(ids) - 1)}
    assert result_from_response(resp, 0.0).ids == ids[:-1]


def test_length_abort_and_malformed_responses(profile):
    ids = profile.tokenizer.encode("a long chain of thought that never")
    res = result_from_response({"output_ids": ids, "meta_info": meta({"type": "length", "length": len(ids)},
                                                                     len(ids))}, 0.5)
    assert res.finish == "length" and res.ids == ids
    row = sample_row()
    fill_from_engine(row, profile, res.ids, res.finish, res.seconds)
    assert row["truncated"] is True and check_structure(row, profile, ChecksConfig()) is None
    abort = {"output_ids": [], "meta_info": meta({"type": "abort", "message": "The input (9000 tokens) is longer "
                                                  "than the model's context length (4096 tokens).",
                                                  "status_code": 400, "err_type": "BadRequestError"}, 0)}
    res = result_from_response(abort, 0.5)
    assert res.ids is None and "context length" in res.error
    assert "no finish reason" in result_from_response({"output_ids": ids, "meta_info": {}}, 0.0).error
    # Output ids under meta_info (some front ends) are found too; the latency falls back when absent.
    nested = {"meta_info": {"finish_reason": {"type": "length", "length": 3}, "output_ids": [4, 5, 6]}}
    res = result_from_response(nested, 0.7)
    assert (res.ids, res.seconds) == ([4, 5, 6], 0.7)


def test_engine_and_sampling_arguments():
    cfg = SGLangSourceConfig(num_gpus=8, tensor_parallel_size=8, dtype="bfloat16", max_model_len=32768,
                             mem_fraction_static=0.85)
    kw = engine_kwargs("/models/kimi", cfg, seed=7, sampled=True)
    assert kw["model_path"] == "/models/kimi" and kw["tp_size"] == 8 and kw["skip_tokenizer_init"] is True
    assert kw["context_length"] == 32768 and kw["random_seed"] == 7 and kw["mem_fraction_static"] == 0.85
    assert kw["enable_deterministic_inference"] is True  # per-sample seeds need SGLang's seeded sampler
    greedy = engine_kwargs("/m", SGLangSourceConfig(), seed=0, sampled=False)
    assert "enable_deterministic_inference" not in greedy and greedy["tp_size"] == 1
    s = SamplingConfig(temperature=0.7, top_p=0.95, max_tokens=512, seed=3)
    p = sampling_params(s, "chat:1:aa", 500, [1], seeded=True)
    assert p["max_new_tokens"] == 500 and p["stop_token_ids"] == [1] and p["no_stop_trim"] is True
    assert p["sampling_seed"] == request_seed("chat:1:aa", 3) != sampling_params(s, "chat:2:bb", 500, [1],
                                                                                   True)["sampling_seed"]
    greedy_s = s.model_copy(update={"temperature": 0.0})
    assert "sampling_seed" not in sampling_params(greedy_s, "chat:1:aa", 10, [1], seeded=False)


@pytest.mark.skipif(sglang_available(), reason="sglang is installed here")
def test_missing_sglang_is_a_clear_start_error_not_an_import_failure():
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8, "seed": 0}
    cfg = SGLangSourceConfig(name="sglang-gpu")
    stage = SGLangGenerator("/models/tiny", "deepseek", sampling, cfg)  # its rows fail over
    assert stage.start_error.startswith("RuntimeError: ") and "sglang package is not installed" in stage.start_error
    stage.shutdown()  # no engine: nothing to stop, no error
    with pytest.raises(RuntimeError, match="sglang package is not installed"):
        SGLangGenerator("/models/tiny", "deepseek", sampling, cfg.model_copy(update={"on_error": "raise"}))
