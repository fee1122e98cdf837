"""Rebuilt ids are what the target wrote, or the sample says why not: each case a review found silently wrong.

On the real DeepSeek, Qwen and Kimi-format tokenizers: a ``<think>`` a user wrote, a bill a token off, a filtered
or aborted finish, empty reasoning, hidden reasoning, Kimi's 400k-character chunks, Qwen history with two
``</think>``, and the audit CLI on a folder that lacks a token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.base.config import ChecksConfig
from pipeline.checks import audit
from pipeline.checks.reconstruct import rebuild_ids
from pipeline.checks.validate import is_truncated, validate_sample
from pipeline.generate.sources.http.wire import Failure, Reply, interpret
from pipeline.profiles import PROFILE_NAMES, load_profile
from pipeline.profiles.base import Completion, Profile, tool_call
from pipeline.profiles.kimi import MAX_RUN
from pipeline.profiles.qwen3 import qwen_rank_file
from pipeline.profiles.tokenizers import split_long_runs
from tests.unit.test_profiles import _deepseek_folder, _kimi_folder

KIMI_CHUNK = 400_000  # tokenization_kimi.py's TIKTOKEN_MAX_ENCODE_CHARS
CALL = tool_call("get_weather", '{"city": "Paris"}', "functions.get_weather:0")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module", params=PROFILE_NAMES)
def profile(request: pytest.FixtureRequest) -> Profile:
    return load_profile(request.param)


def _pad(p: Profile) -> tuple[str, str]:
    return p.think_end_padding


def _sample(p: Profile, c: Completion, thinking: bool = True, tools: list[dict[str, Any]] | None = None,
            billed: int | None = None) -> dict[str, Any]:
    """A row as the HTTP source stores it: ids rebuilt from the reply, the reply's fields and bill."""
    r = rebuild_ids(p, c, thinking)
    return {"sample_id": "s:0", "dataset": "d", "output_ids": r.ids, "thinking": thinking, "truncated": r.truncated,
            "finish_reason": c.finish_reason, "ids_from": "rebuilt", "reasoning": c.reasoning, "content": c.content,
            "tool_calls": json.dumps(c.tool_calls) if c.tool_calls else "", "prompt_ids": [1],
            "tools": json.dumps(tools) if tools else "",
            "billed_completion_tokens": -1 if c.completion_tokens is None else c.completion_tokens}


def _verdict(p: Profile, c: Completion, thinking: bool = True, tools: list[dict[str, Any]] | None = None):
    return validate_sample(_sample(p, c, thinking, tools), p, ChecksConfig())


# -- 1. thinking is read from the generation prompt, not from a <think> someone wrote ------------------


def test_a_think_string_in_a_tool_result_does_not_open_reasoning(tmp_path: Path) -> None:
    builtin, folder = load_profile("deepseek"), load_profile("deepseek", str(_deepseek_folder(tmp_path)))
    msgs = [{"role": "user", "content": "Summarise this page"},
            {"role": "assistant", "content": "", "tool_calls": [tool_call("fetch", "{}", "call_0")]},
            {"role": "tool", "content": "<html>The model writes <think> before it reasons.</html>"}]
    tools = [{"type": "function", "function": {"name": "fetch", "description": "get a page", "parameters": {}}}]
    a, b = builtin.render_prompt(msgs, tools, True), folder.render_prompt(msgs, tools, True)
    assert a.ids == b.ids and folder.think_start_id in b.ids  # the string is the special id in the prompt
    assert not a.thinking and not b.thinking  # V3.1 resumes after a tool result without reasoning


def test_a_template_without_reasoning_never_opens_it(tmp_path: Path) -> None:
    instruct = ("{%- for m in messages -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>{%- endfor -%}"
                "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
    p = load_profile("kimi-k2.5", str(_kimi_folder(tmp_path, instruct)))
    r = p.render_prompt([{"role": "user", "content": "Explain <think> please"}], None, True)
    assert p.think_start_id in r.ids and not r.thinking


# -- 2. a bill a token off cannot pick a reading against the layout -------------------------------------


def test_a_bill_one_short_of_a_kimi_tool_call_is_quarantined_not_silently_rebuilt() -> None:
    p = load_profile("kimi-k2.5")
    truth = p.encode("Need the weather.</think>" + p.render_tool_calls([CALL]) + "<|im_end|>")
    exact = Completion("Need the weather.", "", [CALL], "tool_calls", len(truth))
    assert rebuild_ids(p, exact, True).ids == truth
    v = _verdict(p, exact, tools=WEATHER)
    assert v.passed and not v.flagged, v
    short = Completion("Need the weather.", "", [CALL], "tool_calls", len(truth) - 1)
    v = _verdict(p, short, tools=WEATHER)
    assert "rebuild" in v.failed and "cannot say which" in v.failed["rebuild"], v


def test_a_bill_one_off_on_reasoning_only_answers_is_quarantined(profile: Profile) -> None:
    p = profile
    before, after = _pad(p)
    cut = p.encode("I keep thinking about this problem")  # max_tokens hit inside the reasoning
    v = _verdict(p, Completion("I keep thinking about this problem", None, None, "length", len(cut) + 1))
    assert "rebuild" in v.failed, v
    ended = p.encode("Done thinking" + before) + [p.think_end_id] + p.encode(after) + [p.eot_id]
    r = rebuild_ids(p, Completion("Done thinking", None, None, "stop", len(ended)), True)
    assert r.ids == ended
    one_short = Completion("Done thinking", None, None, "stop", len(ended) - 1)
    v = _verdict(p, one_short)
    # Exact (Qwen: no other reading has that length), or quarantined: never silently another reading.
    assert rebuild_ids(p, one_short, True).ids == ended or "rebuild" in v.failed, v


def test_qwen_stripped_padding_with_a_bill_one_short_is_quarantined() -> None:
    p = load_profile("qwen3")
    truth = p.encode("Let me think.\n</think>\n\nThe answer is 4.<|im_end|>")
    for billed in (len(truth), len(truth) + 1):
        c = Completion("Let me think.", "The answer is 4.", None, "stop", billed)
        assert rebuild_ids(p, c, True).ids == truth
        assert _verdict(p, c).passed
    v = _verdict(p, Completion("Let me think.", "The answer is 4.", None, "stop", len(truth) - 1))
    assert "rebuild" in v.failed, v


def test_a_bill_far_from_the_layout_still_settles_the_reading() -> None:
    """The cases readings exist for: a server that bills every id (vLLM, SGLang) and a difference past the slack."""
    p = load_profile("qwen3")
    engine_ids = p.encode("Think</think>Answer<|im_end|>")  # no padding at all: 2 tokens fewer than the layout
    assert len(rebuild_ids(p, Completion("Think", "Answer", None, "stop"), True).ids) == len(engine_ids) + 2
    c = Completion("Think", "Answer", None, "stop", len(engine_ids))
    r = rebuild_ids(p, c, True)
    assert r.ids == engine_ids and r.reading == "think_end" and r.doubt is None
    assert _verdict(p, c).passed


# -- 3. only stop and tool_calls end a turn --------------------------------------------------------------


@pytest.mark.parametrize("finish", ["content_filter", "abort", "something_new"])
def test_other_finishes_are_cut_off_with_no_end_of_turn(profile: Profile, finish: str) -> None:
    p = profile
    r = rebuild_ids(p, Completion("The user asks about", "Here is a partial", None, finish, None), True)
    assert r.truncated and p.eot_id not in r.ids and p.think_end_id in r.ids
    assert is_truncated({"truncated": False, "finish_reason": finish})
    for natural in ("stop", "tool_calls"):
        assert not is_truncated({"truncated": False, "finish_reason": natural})
    assert not is_truncated({"truncated": False})  # a row that names no finish is judged by its flag
    v = _verdict(p, Completion("The user asks about", "Here is a partial", None, finish, len(r.ids)))
    assert "truncated" in v.flagged and "structure" not in v.failed
    assert ("rebuild" in v.failed) == (finish == "content_filter"), v


def test_a_content_filter_finish_refuses_that_prompt_on_the_wire() -> None:
    body = {"id": "gen-1", "provider": "Moonshot AI", "model": "m", "choices": [{
        "finish_reason": "content_filter", "native_finish_reason": "content_filter",
        "message": {"role": "assistant", "reasoning": "The user asks about", "content": "Here is a partial"}}],
        "usage": {"completion_tokens": 9, "prompt_tokens": 20, "cost": 0.0001}}
    f = interpret(200, json.dumps(body).encode())
    assert isinstance(f, Failure) and f.failure_class == "sample" and not f.retryable
    assert "content_filter" in f.message and (f.billed, f.cost) == (9, 0.0001)  # what it cost still counts
    assert not f.against_provider  # moderation says nothing about the provider's health


# -- 4. empty reasoning is no reasoning ------------------------------------------------------------------


def test_empty_reasoning_with_an_unparsed_think_end_rebuilds_exactly(profile: Profile) -> None:
    p = profile
    before, after = _pad(p)
    raw = "Let me add 2 and 2." + before + p.think_end_text + after + "4"
    truth = p.encode(raw + p.eot_text)
    for billed in (len(truth), None):
        r = rebuild_ids(p, Completion("", raw, None, "stop", billed), True)
        assert r.ids == truth and r.ids.count(p.think_end_id) == 1
    assert _verdict(p, Completion("", raw, None, "stop", len(truth))).passed


def test_the_wire_falls_back_to_reasoning_content_when_reasoning_is_empty() -> None:
    body = {"id": "g", "choices": [{"finish_reason": "stop", "message": {
        "role": "assistant", "reasoning": "", "reasoning_content": "Let me think.", "content": "Answer."}}],
        "usage": {"completion_tokens": 5}}
    r = interpret(200, json.dumps(body).encode())
    assert isinstance(r, Reply) and r.completion.reasoning == "Let me think."


# -- 5. reasoning the API did not return is seen ---------------------------------------------------------


def test_hidden_reasoning_with_no_bill_is_quarantined(profile: Profile) -> None:
    p = profile
    v = _verdict(p, Completion(None, "The answer is 4.", None, "stop", None))
    assert "rebuild" in v.failed and "no reasoning" in v.failed["rebuild"], v
    v = _verdict(p, Completion("", "The answer is 4.", None, "stop", None))
    assert "rebuild" in v.failed, v
    assert _verdict(p, Completion(None, "The answer is 4.", None, "stop", None), thinking=False).passed


def test_reasoning_the_bill_shows_was_empty_passes_and_a_hidden_one_does_not(profile: Profile) -> None:
    p = profile
    ids = rebuild_ids(p, Completion(None, "The answer is 4.", None, "stop"), True).ids
    assert _verdict(p, Completion(None, "The answer is 4.", None, "stop", len(ids))).passed
    v = _verdict(p, Completion(None, "The answer is 4.", None, "stop", len(ids) + 5))
    assert "rebuild" in v.failed and "5 billed tokens" in v.failed["rebuild"], v


# -- 6. Kimi's 400k-character chunks ---------------------------------------------------------------------


def test_kimi_cuts_the_whole_text_into_400k_character_chunks_first() -> None:
    p = load_profile("kimi-k2.5")
    enc = p.tokenizer._enc  # the bare tiktoken encoding, to encode as tokenization_kimi.py does
    text = ("The quick brown fox jumps over the lazy dog. " * 9200)[: KIMI_CHUNK + 10_000]
    subs = [sub for k in range(0, len(text), KIMI_CHUNK) for sub in split_long_runs(text[k : k + KIMI_CHUNK], MAX_RUN)]
    kimi = [i for sub in subs for i in enc.encode(sub, allowed_special="all")]
    assert p.encode(text) == kimi != enc.encode_ordinary(text)
    assert p.encode(text, frozenset()) == kimi and p.tokenizer.encode_ordinary(text) == kimi


# -- 7. Qwen history turns split as Qwen's template splits them ------------------------------------------


def test_qwen_history_takes_reasoning_before_the_first_think_end() -> None:
    p = load_profile("qwen3")
    content = "<think>\nfirst thought\n</think>\n\nI wrote </think> in my answer </think> here"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    text = p.decode(p.render_prompt(msgs, None, True).ids)
    # Qwen3's template: reasoning = content.split('</think>')[0]..., content = content.split('</think>')[-1]...
    assert "<|im_start|>assistant\n<think>\nfirst thought\n</think>\n\n here<|im_end|>" in text


# -- 8. the audit CLI on a folder that lacks a token -------------------------------------------------------


def test_audit_refuses_a_model_folder_missing_a_token(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tiktoken.model").write_bytes(qwen_rank_file().read_bytes())
    names = {"added_tokens_decoder": {"151643": {"content": "[BOS]"}}}  # no <|im_end|>, <think>, ...
    (folder / "tokenizer_config.json").write_text(json.dumps(names))
    assert audit.main([str(tmp_path), "--profile", "kimi-k2.5", "--model-dir", str(folder)]) == 2
    assert "a token it needs is missing" in capsys.readouterr().err


# -- the source's rebuild carries its doubt to validation (no second tokenization of every answer) ----------


def test_the_http_source_carries_the_doubt_its_rebuild_found_and_validation_uses_it() -> None:
    from pipeline.generate.sources.http.config import OpenRouterSourceConfig
    from pipeline.generate.sources.http.engine import HttpEngine, Secret

    p = load_profile("kimi-k2.5")
    truth = p.encode("Need the weather.</think>" + p.render_tool_calls([CALL]) + "<|im_end|>")
    engine = HttpEngine(OpenRouterSourceConfig(model="m", default_budget=10), profile=p, ledger=None,  # type: ignore[arg-type]
                        api_key=Secret(""))
    for billed, doubtful in ((len(truth), False), (len(truth) - 1, True)):
        reply = Reply(Completion("Need the weather.", "", [CALL], "tool_calls", billed), "gen-1", "prov", "m",
                      billed, 0.0, "tool_calls")
        attempt, _, _ = engine._rebuild(reply, True, 0.1)
        assert bool(attempt.doubt) == doubtful and ("cannot say which" in attempt.doubt) == doubtful
        sample = _sample(p, Completion("Need the weather.", "", [CALL], "tool_calls", billed), True, WEATHER)
        carried = validate_sample({**sample, "rebuild_doubt": attempt.doubt}, p, ChecksConfig())
        assert ("rebuild" in carried.failed) == doubtful
        assert validate_sample(sample, p, ChecksConfig()).failed.keys() == carried.failed.keys()  # re-run agrees
    # what the row carries is what counts: validation does not rebuild again where the source did
    sample = _sample(p, Completion("Need the weather.", "", [CALL], "tool_calls", len(truth) - 1), True, WEATHER)
    assert "rebuild" not in validate_sample({**sample, "rebuild_doubt": ""}, p, ChecksConfig()).failed
    assert validate_sample({**sample, "rebuild_doubt": "a carried doubt"}, p,
                           ChecksConfig()).failed["rebuild"] == "a carried doubt"
