"""Rebuilding target ids from API responses, on the real DeepSeek, Qwen and Kimi-format tokenizers."""

from __future__ import annotations

import json

import pytest

from pipeline.checks.reconstruct import (
    completion_from_message,
    completion_from_response,
    rebuild_from_response,
    rebuild_ids,
    response_text,
)
from pipeline.profiles import PROFILE_NAMES, load_profile
from pipeline.profiles.base import Completion, Profile, tool_call
from tests.helpers.oracle import oracle_report

CALL = tool_call("get_weather", '{"city": "Paris"}', "functions.get_weather:0")


@pytest.fixture(scope="module", params=PROFILE_NAMES)
def profile(request: pytest.FixtureRequest) -> Profile:
    return load_profile(request.param)


def test_completion_from_message_reads_either_reasoning_field() -> None:
    openrouter = completion_from_message({"role": "assistant", "content": "4", "reasoning": "2+2"}, "stop",
                                         {"completion_tokens": 7})
    vllm = completion_from_message({"role": "assistant", "content": None, "reasoning_content": "hmm",
                                    "tool_calls": [CALL]}, "tool_calls")
    assert (openrouter.reasoning, openrouter.content, openrouter.completion_tokens) == ("2+2", "4", 7)
    assert (vllm.reasoning, vllm.content, vllm.tool_calls, vllm.finish_reason) == ("hmm", None, [CALL], "tool_calls")
    empty = completion_from_message({"content": "", "reasoning": None, "tool_calls": []}, None)
    assert (empty.reasoning, empty.content, empty.tool_calls, empty.finish_reason) == (None, "", None, "stop")


def test_layout_encodes_each_segment_on_its_own(profile: Profile) -> None:
    p = profile
    c = Completion("Hel", "lo", None, "stop")
    expected = p.encode("Hel") + [p.think_end_id] + p.encode("lo") + [p.eot_id]
    if p.name == "qwen3":  # Qwen writes \n</think>\n\n: stripped whitespace comes back
        expected = p.encode("Hel\n") + [p.think_end_id] + p.encode("\n\nlo") + [p.eot_id]
    rebuilt = rebuild_ids(p, c, thinking=True)
    assert rebuilt.ids == expected and not rebuilt.truncated
    # Encoding the joined text merges across the place the special token holds.
    assert len(p.encode("Hello")) == 1 and p.encode("Hel") + p.encode("lo") != p.encode("Hello")


def test_raw_tool_markers_in_content_become_special_ids(profile: Profile) -> None:
    p = profile
    raw = p.render_tool_calls([CALL])  # what leaks into content when no tools were sent
    c = Completion("r\n" if p.name == "qwen3" else "r", ("\n\n" if p.name == "qwen3" else "") + "ok" + raw,
                   None, "stop")
    ids = rebuild_ids(p, c, thinking=True).ids
    assert p.tool_section_begin_id in ids and p.tool_section_end_id in ids
    assert ids == p.encode(c.reasoning) + [p.think_end_id] + p.encode(c.content) + [p.eot_id]


def test_structured_tool_calls_render_as_native_tokens(profile: Profile) -> None:
    p = profile
    c = Completion("check", None, [CALL], "tool_calls")
    ids = rebuild_ids(p, c, thinking=True).ids
    section = p.render_tool_calls([CALL])
    assert ids[-1] == p.eot_id
    assert ids[-1 - len(p.encode(section)): -1] == p.encode(section)
    text = p.decode(ids)
    if p.name == "deepseek":
        assert text == ("check</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')
    elif p.name == "qwen3":
        assert text == ('check\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                        "</tool_call><|im_end|>")
    else:
        assert text == ("check</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
                        "<|tool_calls_section_end|><|im_end|>")
    # The split of the rebuilt text gives the same structured call back.
    again = p.split_ids(ids, thinking=True)
    assert again.tool_calls is not None
    assert json.loads(again.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_length_has_no_end_of_turn_and_is_truncated(profile: Profile) -> None:
    p = profile
    cut_in_answer = rebuild_ids(p, Completion("r\n", "partial", None, "length"), thinking=True)
    assert cut_in_answer.truncated and cut_in_answer.ids[-1] != p.eot_id
    assert p.think_end_id in cut_in_answer.ids
    cut_in_reasoning = rebuild_ids(p, Completion("still going", "", None, "length"), thinking=True)
    assert cut_in_reasoning.ids == p.encode("still going")  # no </think>, no end-of-turn


def test_thinking_off_has_no_think_end(profile: Profile) -> None:
    p = profile
    ids = rebuild_ids(p, Completion(None, "Hello", None, "stop"), thinking=False).ids
    assert ids == p.encode("Hello") + [p.eot_id]


# -- whitespace around </think> ---------------------------------------------------------


def _sglang_style(c: Completion) -> Completion:
    """What a parser that strip()s both parts returns (older SGLang reasoning parsers did)."""
    return Completion((c.reasoning or "").strip(), (c.content or "").strip() or None, c.tool_calls, c.finish_reason)


def test_qwen_whitespace_stripped_around_think_end_comes_back() -> None:
    p = load_profile("qwen3")
    engine_ids = p.encode("Let me think.\nDone.\n</think>\n\nThe answer is 4.<|im_end|>")
    raw = p.split_ids(engine_ids, thinking=True)
    assert (raw.reasoning, raw.content) == ("Let me think.\nDone.\n", "\n\nThe answer is 4.")
    assert rebuild_ids(p, raw, thinking=True).ids == engine_ids  # vLLM's qwen3 parser strips nothing
    stripped = _sglang_style(raw)
    assert (stripped.reasoning, stripped.content) == ("Let me think.\nDone.", "The answer is 4.")
    rebuilt = rebuild_ids(p, stripped, thinking=True)
    assert rebuilt.ids == engine_ids and rebuilt.reading == "think_end+padded"
    # A tool call right after reasoning: the parser drops the whitespace-only content.
    call_ids = p.encode("Need weather.\n</think>\n\n" + p.render_tool_calls([CALL]) + "<|im_end|>")
    split = p.split_ids(call_ids, thinking=True)
    assert split.tool_calls and split.content == "\n\n"
    assert rebuild_ids(p, _sglang_style(split), thinking=True).ids == call_ids


def test_deepseek_and_kimi_keep_whitespace_as_returned() -> None:
    for name in ("deepseek", "kimi-k2.5"):
        p = load_profile(name)
        c = Completion(" spaced reasoning \n", "\n answer ", None, "stop")
        ids = rebuild_ids(p, c, thinking=True).ids
        assert p.decode(ids) == " spaced reasoning \n" + p.think_end_text + "\n answer " + p.eot_text
        flush = Completion("reasoning", "answer", None, "stop")
        assert p.decode(rebuild_ids(p, flush, thinking=True).ids) == (
            "reasoning" + p.think_end_text + "answer" + p.eot_text)


def test_kimi_vllm_parser_rstrip_loses_nothing_on_canonical_output() -> None:
    p = load_profile("kimi-k2.5")
    engine_ids = p.encode("plan it</think>Sure." + p.render_tool_calls([CALL]) + "<|im_end|>")
    split = p.split_ids(engine_ids, thinking=True)
    vllm_like = Completion(split.reasoning.rstrip(), split.content or None, split.tool_calls, "tool_calls")
    assert rebuild_ids(p, vllm_like, thinking=True).ids == engine_ids


# -- readings the text leaves open, settled by the billed count ----------------------------


def test_billed_count_settles_a_missing_think_end(profile: Profile) -> None:
    p = profile
    # The model ended inside its reasoning; the API says reasoning only, content null.
    no_end = p.encode("thinking forever") + [p.eot_id]
    c = Completion("thinking forever", None, None, "stop", completion_tokens=len(no_end))
    rebuilt = rebuild_ids(p, c, thinking=True)
    assert rebuilt.ids == no_end and rebuilt.reading.startswith("no_think_end") and rebuilt.billed_delta == 0
    # Unbilled, the layout wins: </think> was written.
    assert p.think_end_id in rebuild_ids(p, Completion("thinking forever", None, None, "stop"), True).ids
    # Billed one more than the rebuild: the delta says so.
    over = rebuild_ids(p, Completion("a", "b", None, "stop", completion_tokens=99), thinking=True)
    assert over.billed_delta == len(over.ids) - 99


def test_billed_count_settles_an_implicit_reasoning_end() -> None:
    p = load_profile("kimi-k2.5")
    engine_ids = p.encode("need weather" + p.render_tool_calls([CALL]) + "<|im_end|>")  # no </think>
    split = p.split_ids(engine_ids, thinking=True)
    assert split.reasoning == "need weather" and split.tool_calls
    assert rebuild_ids(p, split, thinking=True).ids == engine_ids
    split.completion_tokens = None
    assert p.think_end_id in rebuild_ids(p, split, thinking=True).ids


def test_missing_reasoning_is_flagged(profile: Profile) -> None:
    p = profile
    hidden = rebuild_ids(p, Completion(None, "answer", None, "stop"), thinking=True)
    assert hidden.reasoning_missing
    unparsed = Completion(None, "r" + p.think_end_text + "answer", None, "stop")
    rebuilt = rebuild_ids(p, unparsed, thinking=True)
    assert not rebuilt.reasoning_missing and rebuilt.ids.count(p.think_end_id) == 1


def test_rebuild_from_an_openrouter_body(profile: Profile) -> None:
    p = profile
    body = {"id": "gen-1", "provider": "X", "choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "", "reasoning": "Weather needed.", "tool_calls": [CALL]}}],
        "usage": {"completion_tokens": 3, "prompt_tokens": 10}}
    rebuilt = rebuild_from_response(p, body, thinking=True)
    assert rebuilt.billed_delta == len(rebuilt.ids) - 3
    assert p.decode(rebuilt.ids) == response_text(p, completion_from_message(body["choices"][0]["message"],
                                                                             "tool_calls"), True)


# reasoning_details as OpenRouter sends them (openrouter.md: a list on the message): the model's own text in
# reasoning.text parts, in order, between a summary and an encrypted part that are no generated text.
DETAILS = [{"type": "reasoning.text", "text": "Weather ", "signature": None, "format": "unknown", "index": 0},
           {"type": "reasoning.summary", "summary": "The user wants weather.", "format": "unknown", "index": 1},
           {"type": "reasoning.encrypted", "data": "gAAAAB...", "format": "unknown", "index": 2},
           {"type": "reasoning.text", "text": "needed.", "format": "unknown", "index": 3}]


def test_reasoning_only_in_reasoning_details_is_rebuilt(profile: Profile) -> None:
    """``reasoning: null`` with the text in ``reasoning_details``: the audit's offline rebuild reads it as the HTTP
    source does, so the ids hold the reasoning, match the bill, and raise no "no reasoning returned" doubt."""
    p = profile
    own = Completion("Weather needed.", "Sunny.", None, "stop")
    billed = len(rebuild_ids(p, own, thinking=True).ids)
    body = {"id": "gen-2", "provider": "X", "choices": [{"finish_reason": "stop", "native_finish_reason": "stop",
            "message": {"role": "assistant", "content": "Sunny.", "reasoning": None, "reasoning_details": DETAILS,
                        "refusal": None}}],
            "usage": {"completion_tokens": billed, "prompt_tokens": 10}}
    rebuilt = rebuild_from_response(p, body, thinking=True)
    assert rebuilt.ids == rebuild_ids(p, own, thinking=True).ids
    assert (rebuilt.billed_delta, rebuilt.reasoning_missing, rebuilt.doubt) == (0, False, None)
    # an empty reasoning field falls back the same way; a reasoning field of its own wins over the details
    body["choices"][0]["message"]["reasoning"] = ""
    assert completion_from_response(body).reasoning == "Weather needed."
    body["choices"][0]["message"]["reasoning"] = "Own."
    assert completion_from_response(body).reasoning == "Own."


@pytest.mark.parametrize("message", [
    {"content": "x", "reasoning": None, "reasoning_details": DETAILS},
    {"content": "x", "reasoning": "", "reasoning_details": DETAILS},
    {"content": "x", "reasoning_content": "", "reasoning_details": DETAILS},
    {"content": "x", "reasoning": "", "reasoning_content": "rc", "reasoning_details": DETAILS},
    {"content": "x", "reasoning": "own", "reasoning_details": DETAILS},
    {"content": "x", "reasoning": "", "reasoning_details": [{"type": "reasoning.encrypted", "data": "zz"}]},
    {"content": "x", "reasoning": None, "reasoning_details": [{"type": "reasoning.summary", "summary": "s"}]},
    {"content": "x", "reasoning": "", "reasoning_details": []},
    {"content": "x", "reasoning": None, "reasoning_details": "text"},
    {"content": "x", "reasoning": "", "reasoning_details": [1, {"type": "reasoning.text"}, {"text": "t"}]},
    {"content": "x", "reasoning": None, "reasoning_details": None},
    {"content": "x"},
])
def test_reasoning_is_read_as_the_http_source_reads_it(message: dict) -> None:
    """The checks' reading of a message and the HTTP source's agree on where reasoning comes from ("" and None
    kept apart: an empty string is a reading of its own)."""
    from pipeline.generate.sources.http.wire import completion_from_message as wire_completion

    assert completion_from_message(message, "stop").reasoning == wire_completion(message, "stop").reasoning


def test_oracle_report_counts_canonical_and_exact(profile: Profile) -> None:
    p = profile
    good = p.encode("r" + ("\n" if p.name == "qwen3" else "")) + [p.think_end_id]
    good += p.encode(("\n\n" if p.name == "qwen3" else "") + "fine") + [p.eot_id]
    # Two ids a fresh encode would merge: a model can emit them, no text can rebuild them.
    pieces = [p.encode("He"), p.encode("llo")]
    split_word = pieces[0] + pieces[1] + [p.think_end_id] + [p.eot_id]
    report = oracle_report(p, [{"output_ids": good, "thinking": True}, {"output_ids": split_word, "thinking": True}])
    assert report["samples"] == 2 and report["canonical"] == 1
    assert report["exact_on_canonical"] == 1.0 and report["canonical_mismatches"] == 0
