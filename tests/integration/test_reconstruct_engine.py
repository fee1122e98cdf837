"""Engine oracle: ids rebuilt from vLLM's text equal vLLM's own output ids on the tiny target.

The tiny target (random Llama on the DeepSeek-V4 tokenizer) writes ``</think>``,
end-of-turn and tool-call markers at random, so its responses hold reasoning
splits, raw tool-call markers and truncations. Its text is split as a reasoning
parser would (``profile.split_text``), rebuilt, and compared with the engine's
ids. Random models often emit non-canonical id sequences (ids a fresh encode
would merge differently); exactness is required on the canonical ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.profiles import load_profile
from pipeline.profiles.base import tool_call
from tests.helpers.oracle import oracle_report

pytestmark = pytest.mark.slow

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

PROMPTS: list[tuple[list[dict[str, Any]], Any, bool]] = [
    ([{"role": "user", "content": "What is 17 * 23? Think step by step."}], None, True),
    ([{"role": "user", "content": "Write a haiku about rain."}], None, False),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"},
      {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Japan? 日本"}], None, True),
    ([{"role": "user", "content": "What's the weather in Paris and in Tokyo?"}], WEATHER, True),
    ([{"role": "user", "content": "Weather in Oslo?"},
      {"role": "assistant", "content": "", "tool_calls": [tool_call("get_weather", '{"city": "Oslo"}', "call_0")]},
      {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 3}"}], WEATHER, True),
    ([{"role": "user", "content": "def add(a, b):\n    return a + b\n# explain this code"}], None, True),
    ([{"role": "user", "content": "Call a tool if useful: weather in Rome."}], WEATHER, False),
    ([{"role": "user", "content": "Résumé of the café's 😀 menu, please."}], None, True),
]
SEEDS_PER_PROMPT = 50


def _token_budget(llm: Any) -> int:
    return int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)


def _unchunked_batches(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive batches whose prompts all prefill in the first step.

    A prompt prefilled in chunks makes vLLM rewind a seeded request's generator
    (``Generator.set_offset``), which the CPU generator does not support.
    """
    batches, lo, used = [], 0, 0
    for i, n in enumerate(lengths):
        if used + n > budget and i > lo:
            batches.append((lo, i))
            lo, used = i, 0
        used += n
    batches.append((lo, len(lengths)))
    return batches


@pytest.fixture(scope="module")
def engine_run(tiny_llm: Any, tiny_target: Path) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    profile = load_profile("deepseek", str(tiny_target))
    rendered = [profile.render_prompt(m, t, th) for m, t, th in PROMPTS]
    prompts, params, thinking = [], [], []
    for k, r in enumerate(rendered):
        for seed in range(SEEDS_PER_PROMPT):
            prompts.append(TokensPrompt(prompt_token_ids=r.ids))
            params.append(SamplingParams(temperature=1.0, top_p=1.0, max_tokens=64 if seed % 2 else 96,
                                         seed=1000 * k + seed, skip_special_tokens=False,
                                         spaces_between_special_tokens=False))
            thinking.append(r.thinking)
    outputs = []
    for lo, hi in _unchunked_batches([len(r["prompt_token_ids"]) for r in prompts], _token_budget(tiny_llm)):
        outputs += tiny_llm.generate(prompts[lo:hi], params[lo:hi], use_tqdm=False)
    samples = [{"output_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                "finish_reason": o.outputs[0].finish_reason, "thinking": th,
                "prompt_ids": list(o.prompt_token_ids)} for o, th in zip(outputs, thinking, strict=True)]
    return {"profile": profile, "rendered": rendered, "samples": samples}


def test_prompt_ids_equal_what_the_engine_was_given(engine_run: dict[str, Any], tiny_llm: Any) -> None:
    assert engine_run["profile"].chat_template is not None  # the folder's template rendered these
    builtin = load_profile("deepseek")
    hf = tiny_llm.get_tokenizer()
    for (messages, tools, thinking), r in zip(PROMPTS, engine_run["rendered"], strict=True):
        assert r.ids == builtin.render_prompt(messages, tools, thinking).ids
        got = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                     thinking=thinking)
        assert list(got["input_ids"] if hasattr(got, "keys") else got) == r.ids
    for i, s in enumerate(engine_run["samples"]):
        assert s["prompt_ids"] == engine_run["rendered"][i // SEEDS_PER_PROMPT].ids


def test_engine_chat_path_renders_the_profile_prompt(tiny_llm: Any, tiny_target: Path) -> None:
    from vllm import SamplingParams

    profile = load_profile("deepseek", str(tiny_target))
    for messages, tools, thinking in PROMPTS[:4]:
        out = tiny_llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False, tools=tools,
                            chat_template_kwargs={"thinking": thinking})
        assert list(out[0].prompt_token_ids) == profile.render_prompt(messages, tools, thinking).ids


def test_rebuild_matches_engine_ids(engine_run: dict[str, Any]) -> None:
    profile, samples = engine_run["profile"], engine_run["samples"]
    report = oracle_report(profile, samples)
    print("\nengine oracle:", json.dumps({k: v for k, v in report.items() if k != "failures"}))
    assert report["samples"] >= 200
    assert report["with_think_end"] > 0 and report["with_tool_markers"] > 0 and report["truncated"] > 0
    assert report["canonical_with_think_end"] > 0 and report["canonical_with_tool_markers"] > 0
    assert report["exact_on_canonical"] == 1.0, report["failures"]
