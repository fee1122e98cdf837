"""Validation: each kind of bad sample fires exactly the check meant to catch it; clean samples pass.

Samples are built the way the sources build them: API samples by rebuilding ids from text with
the real DeepSeek tokenizer, engine samples from ids (their text split from the ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.base.config import ChecksConfig
from pipeline.base.records import empty_sample
from pipeline.checks.reconstruct import rebuild_ids
from pipeline.checks.validate import (
    CHECK_NAMES,
    ConservationError,
    annotate,
    assert_conservation,
    longest_loop,
    quarantine_reason,
    validate_sample,
)
from pipeline.profiles import load_profile
from pipeline.profiles.base import Completion, Profile, RenderedPrompt, tool_call
from pipeline.profiles.deepseek import ASSISTANT, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP, USER

P = load_profile("deepseek")
CFG = ChecksConfig()
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
REASONING = "The user asks for a short greeting. I will answer politely."
CONTENT = "Hello! How can I help you today?"


def _base(sid: str, thinking: bool, tools: list[dict[str, Any]] | None, profile: Profile = P,
          dataset: str = "chat", user: str = "Say hello.") -> dict[str, Any]:
    messages = [{"role": "user", "content": user}]
    rendered = profile.render_prompt(messages, tools, thinking)
    return empty_sample({
        "sample_id": sid, "dataset": dataset, "row_index": int("".join(c for c in sid if c.isdigit()) or 0),
        "messages": json.dumps(messages), "tools": json.dumps(tools) if tools else "", "thinking": rendered.thinking,
        "prompt_ids": rendered.ids, "prompt_assistant_mask": rendered.assistant_mask,
    })


def api_sample(sid: str, reasoning: str | None = REASONING, content: str | None = CONTENT, *,
               calls: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
               finish: str = "stop", diff: int = 0, provider: str = "prov-a", thinking: bool = True,
               dataset: str = "chat") -> dict[str, Any]:
    """A sample as the HTTP source makes it: ids rebuilt from the text; billed = len(ids) - diff."""
    s = _base(sid, thinking, tools, dataset=dataset)
    rebuilt = rebuild_ids(P, Completion(reasoning, content, calls, finish), thinking)
    s.update(source="openrouter", source_kind="openrouter", provider=provider, model="deepseek/deepseek-v4",
             output_ids=rebuilt.ids, ids_from="rebuilt", reasoning=reasoning, content=content,
             tool_calls=json.dumps(calls) if calls else "", finish_reason=finish, truncated=rebuilt.truncated,
             billed_completion_tokens=len(rebuilt.ids) - diff, cost=1e-5)
    return s


def engine_sample(sid: str, ids: list[int], *, thinking: bool = True, tools: list[dict[str, Any]] | None = None,
                  truncated: bool | None = None, profile: Profile = P) -> dict[str, Any]:
    """A sample as a local engine makes it: exact ids, text split from them as a server's parsers do."""
    s = _base(sid, thinking, tools, profile=profile)
    split = profile.split_ids(ids, thinking)
    cut = split.finish_reason == "length" if truncated is None else truncated
    finish = "length" if cut else split.finish_reason.replace("length", "stop")
    s.update(source="local", source_kind="vllm", provider="vllm", model="tiny", output_ids=list(ids),
             ids_from="engine", reasoning=split.reasoning, content=split.content,
             tool_calls=json.dumps(split.tool_calls) if split.tool_calls else "",
             finish_reason=finish, truncated=cut)
    return s


def fired(sample: dict[str, Any], cfg: ChecksConfig = CFG, profile: Profile = P) -> set[str]:
    v = validate_sample(sample, profile, cfg)
    return set(v.failed) | set(v.flagged)


def enc(text: str) -> list[int]:
    return P.encode(text)


def good_ids(reasoning: str = REASONING, content: str = CONTENT) -> list[int]:
    return enc(reasoning) + [P.think_end_id] + enc(content) + [P.eot_id]


def weather_call(args: str = '{"city": "Paris"}', name: str = "get_weather") -> str:
    return f"{CALLS_BEGIN}{CALL_BEGIN}{name}{TOOL_SEP}{args}{CALL_END}{CALLS_END}"


# -- clean data ---------------------------------------------------------------


def clean_samples() -> list[dict[str, Any]]:
    call = tool_call("get_weather", {"city": "Paris"}, "call_0")
    return [
        api_sample("api-1"),
        api_sample("api-2", diff=1, provider="prov-b"),
        api_sample("api-3", reasoning=None, content="Hi there, nice to meet you.", thinking=False),
        api_sample("api-4", content="Let me look that up.", calls=[call], tools=WEATHER, finish="tool_calls"),
        api_sample("api-5", content="", calls=[call], tools=WEATHER, finish="tool_calls"),
        engine_sample("eng-1", good_ids()),
        engine_sample("eng-2", enc("Fine.") + [P.think_end_id] + enc("Sure") + enc(weather_call()) + [P.eot_id],
                      tools=WEATHER),
        engine_sample("eng-3", enc("Plain answer without reasoning.") + [P.eot_id], thinking=False),
    ]


def test_clean_samples_pass_every_check() -> None:
    for s in clean_samples():
        v = validate_sample(s, P, CFG)
        assert v.failed == {} and v.flagged == {}, (s["sample_id"], v)
        assert v.passed
        expected = set(CHECK_NAMES) - ({"billing", "rebuild"} if s["ids_from"] == "engine" else set())
        assert set(v.ran) == expected


def _real_in(field_specials: frozenset[str]):  # noqa: ANN202 - a filter predicate
    return lambda text: not any(sp in text for sp in field_specials)


def _text_with_specials() -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
                      st.sampled_from(sorted(P.special_ids)))
    return st.lists(piece, max_size=6).map("".join)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(reasoning=_text_with_specials().filter(_real_in(P.reasoning_specials)),
       content=_text_with_specials().filter(lambda t: t.strip()).filter(_real_in(P.content_specials)))
def test_rebuilt_text_is_never_a_structural_or_roundtrip_failure(reasoning: str, content: str) -> None:
    """Any text a provider returns rebuilds into ids that are structurally sound and canonical.

    Special-token strings a field cannot hold (``</think>`` in reasoning, the end-of-turn or a role
    header anywhere) are text and pass. Strings that are real there (a raw tool-call marker) are
    excluded: what they make of the tool-call layout is the structure and tool-semantics checks' job.
    """
    s = api_sample("h-1", reasoning, content)
    assert fired(s) & {"structure", "roundtrip", "tool_semantics", "billing"} == set()


# -- structure ----------------------------------------------------------------


@pytest.mark.parametrize("ids, thinking, why, also", [
    (enc("a") + [P.think_end_id] + enc("b") + [P.think_end_id] + enc("c") + [P.eot_id], True, "2 </think>", set()),
    (enc("x") + [P.think_end_id] + enc("y") + [P.eot_id], False, "thinking off", set()),
    (good_ids()[:-1] + enc(" and more"), True, "does not end with the end-of-turn", set()),
    (enc("r") + [P.think_end_id] + enc("c") + [P.eot_id] + enc("again") + [P.eot_id], True, "end-of-turn id inside",
     set()),
    (enc("r") + [P.think_end_id] + [P.encode(USER)[0]] + enc("c") + [P.eot_id], True, "forbidden tokens", set()),
    (enc("r") + [P.think_end_id] + P.encode(ASSISTANT) + enc("c") + [P.eot_id], True, "forbidden tokens", set()),
    # With no </think> a reasoning parser reads everything as reasoning: the answer is lost too.
    (enc("Just an answer.") + [P.eot_id], True, "0 </think> tokens with thinking on", {"empty_content"}),
    # The tokenizer drops an id it does not know, so the text does not re-encode to the ids either.
    (enc("r") + [P.think_end_id] + enc("c") + [129_999] + [P.eot_id], True, "outside the vocabulary",
     {"roundtrip"}),
])
def test_structure_failures(ids: list[int], thinking: bool, why: str, also: set[str]) -> None:
    s = engine_sample("s-1", ids, thinking=thinking, truncated=False)
    v = validate_sample(s, P, CFG)
    assert set(v.failed) == {"structure"} and set(v.flagged) == also, v
    assert why in v.failed["structure"]


def test_structure_catches_a_bad_prompt_mask() -> None:
    s = api_sample("s-2")
    s["prompt_assistant_mask"] = s["prompt_assistant_mask"][:-1]
    assert fired(s) == {"structure"}


def _tool_ids(section: str, *, reasoning: str = "Check the weather.") -> list[int]:
    return enc(reasoning) + [P.think_end_id] + enc("Sure") + enc(section) + [P.eot_id]


BAD_CALLS = [
    (weather_call(args='{"city": Paris}'), "tool call 'get_weather' at {at}: arguments are not a JSON object"),
    (weather_call(args='["Paris"]'), "tool call 'get_weather' at {at}: arguments are not a JSON object"),
    (weather_call(name="get_stock_price"), "tool call 'get_stock_price' at {at} names no declared tool"),
    (f"{CALLS_BEGIN}{CALL_BEGIN}get_weather{CALL_END}{CALLS_END}", "tool-call section at {at} does not parse"),
]


@pytest.mark.parametrize("section, why", BAD_CALLS)
def test_tool_call_content_problems_are_tool_semantics(section: str, why: str) -> None:
    ids = _tool_ids(section)
    s = engine_sample("t-1", ids, tools=WEATHER)
    v = validate_sample(s, P, CFG)
    assert set(v.failed) == {"tool_semantics"} and not v.flagged, v
    assert why.format(at=ids.index(P.tool_section_begin_id)) in v.failed["tool_semantics"]


@pytest.mark.parametrize("section, why", BAD_CALLS)
def test_raw_tool_calls_from_an_api_get_the_engine_rule(section: str, why: str) -> None:
    """Tools not sent: the call comes back as raw markers in content; it is judged by parsing, like engine ids."""
    s = api_sample("t-4", content="Sure" + section, tools=WEATHER)
    assert s["output_ids"] == _tool_ids(section, reasoning=REASONING)
    v = validate_sample(s, P, CFG)
    assert set(v.failed) == {"tool_semantics"} and not v.flagged, v
    assert why.format(at=s["output_ids"].index(P.tool_section_begin_id)) in v.failed["tool_semantics"]


@pytest.mark.parametrize("section, why", [
    (weather_call()[: -len(CALLS_END)], "never closed"),
    (weather_call() + CALLS_END, "without a begin"),
    (CALLS_BEGIN + weather_call(), "inside the one opened"),
    (f"{CALL_BEGIN}get_weather{TOOL_SEP}{{}}{CALL_END}", "outside a section"),
])
def test_unbalanced_sections_are_structure(section: str, why: str) -> None:
    """Bracketing is the token layout's business; the calls inside a closed section are tool_semantics'."""
    for s in (engine_sample("t-2", _tool_ids(section), tools=WEATHER),
              api_sample("t-3", content="Sure" + section, tools=WEATHER)):
        v = validate_sample(s, P, CFG)
        assert set(v.failed) == {"structure"} and not v.flagged, (s["ids_from"], v)
        assert why in v.failed["structure"]


def test_truncated_inside_a_tool_section_is_not_a_structure_failure() -> None:
    ids = _tool_ids(weather_call())[:-4]  # cut before the section closes
    s = engine_sample("t-3", ids, tools=WEATHER, truncated=True)
    assert "structure" not in fired(s)


def test_a_cut_off_tool_call_needs_declared_tools() -> None:
    ids = _tool_ids(weather_call())[:-4]  # cut before the section closes: no call to parse, yet a call
    v = validate_sample(engine_sample("t-5", ids, tools=None, truncated=True), P, CFG)
    assert set(v.failed) == {"tool_semantics"} and set(v.flagged) == {"truncated"}, v
    assert "tool-call section opened at" in v.failed["tool_semantics"]
    assert "the prompt declared no tools" in v.failed["tool_semantics"]


# -- roundtrip ----------------------------------------------------------------


def _noncanonical() -> list[int]:
    ids = enc("h") + enc("ello")
    assert enc("hello") != ids and P.decode(ids) == "hello"
    return enc("Greeting") + [P.think_end_id] + ids + [P.eot_id]


def test_noncanonical_engine_ids_are_flagged_not_quarantined() -> None:
    v = validate_sample(engine_sample("r-1", _noncanonical()), P, CFG)
    assert v.failed == {} and set(v.flagged) == {"roundtrip"} and v.passed
    assert "differs at token" in v.flagged["roundtrip"]


def test_noncanonical_rebuilt_ids_are_quarantined() -> None:
    s = engine_sample("r-2", _noncanonical())
    s["ids_from"] = "rebuilt"
    v = validate_sample(s, P, CFG)
    assert set(v.failed) == {"roundtrip"} and not v.flagged


def test_roundtrip_mode_per_origin_is_configurable() -> None:
    s = engine_sample("r-3", _noncanonical())
    assert validate_sample(s, P, ChecksConfig(roundtrip="quarantine")).failed.keys() == {"roundtrip"}
    s["ids_from"] = "rebuilt"
    assert "roundtrip" not in validate_sample(s, P, ChecksConfig(roundtrip_rebuilt="off")).ran


def test_truncation_inside_a_multibyte_character_is_not_a_roundtrip_failure() -> None:
    ids = enc("Thinking about emoji 😀 ")
    cut = ids[: next(i for i in range(len(ids), 0, -1) if P.decode(ids[:i]).endswith("\ufffd"))]
    assert P.encode(P.decode(cut)) != cut  # the naive comparison would fail
    assert fired(engine_sample("r-4", cut, truncated=True)) == {"truncated"}


# -- billing ------------------------------------------------------------------


LONG_REASONING = " ".join(f"step {i}" for i in range(150))  # 454 ids with "Done."


@pytest.mark.parametrize("diff, counted", [(0, False), (1, False), (-2, False), (8, False), (-9, False),
                                           (21, False), (22, True), (65, True), (-40, True)])
def test_billing_drift_counts_over_both_thresholds(diff: int, counted: bool) -> None:
    """Over 8 tokens and over 5% of the billed count: 9 of 463 or 21 of 433 are not drift, 22 of 432 is."""
    s = api_sample("b-1", reasoning=LONG_REASONING, content="Done.", diff=diff)
    assert len(s["output_ids"]) == 454
    assert fired(s) == ({"billing"} if counted else set())
    short = api_sample("b-4", reasoning="The user asks about the weather in Paris today.",
                       content="It is sunny and warm in Paris today; enjoy the day!", diff=3)  # 3 of 22: 13.6%
    assert fired(short) == set()


def test_rebuilt_ids_that_disagree_with_the_bill_are_quarantined_with_the_figures() -> None:
    """content null, finish stop: the ids cannot account for what was billed (44% off), so they are not trusted."""
    reasoning = " ".join(f"Case {i}: the sum is {2 * i}, so it holds." for i in range(8))
    n = len(api_sample("b-2", reasoning=reasoning, content=None)["output_ids"])
    billed = round(n / 1.44)
    s = api_sample("b-2", reasoning=reasoning, content=None, diff=n - billed)
    assert s["billed_completion_tokens"] == billed and s["finish_reason"] == "stop"
    v = validate_sample(s, P, CFG)
    assert set(v.failed) == {"billing"} and not v.passed, v
    pct = f"{(n - billed) / billed:.1%}"
    assert pct.startswith("4") and pct.endswith("%")
    assert f"rebuilt {n} ids, billed {billed}, difference {n - billed:+d} = {pct}" in v.failed["billing"]
    assert "thresholds 8 tokens and 5.0%" in v.failed["billing"]


def test_billing_mode_is_configurable_and_skips_unbilled_sources() -> None:
    s = api_sample("b-3", diff=-40)
    assert set(validate_sample(s, P, CFG).failed) == {"billing"}
    flagged = validate_sample(s, P, ChecksConfig(billing="flag"))
    assert flagged.passed and set(flagged.flagged) == {"billing"}
    assert "billing" not in validate_sample(s, P, ChecksConfig(billing="off")).ran
    assert validate_sample(s, P, ChecksConfig(billing_abs_threshold=100)).passed
    s["billed_completion_tokens"] = -1
    assert "billing" not in validate_sample(s, P, CFG).ran


# -- tool semantics -----------------------------------------------------------


def test_tool_call_without_declared_tools() -> None:
    ids = _tool_ids(weather_call())
    for s in (engine_sample("ts-1", ids, tools=None), api_sample("ts-5", content="Sure" + weather_call())):
        assert s["output_ids"][-len(enc(weather_call())) - 1:] == ids[-len(enc(weather_call())) - 1:]
        v = validate_sample(s, P, CFG)
        assert set(v.failed) == {"tool_semantics"}, v
        assert "tool call 'get_weather' at" in v.failed["tool_semantics"]
        assert "the prompt declared no tools" in v.failed["tool_semantics"]


def test_structured_tool_calls_without_declared_tools() -> None:
    call = tool_call("get_weather", {"city": "Rome"}, "c0")
    v = validate_sample(api_sample("ts-2", content="", calls=[call], finish="tool_calls"), P, CFG)
    assert set(v.failed) == {"tool_semantics"} and not v.flagged
    assert "'get_weather'" in v.failed["tool_semantics"] and "declared no tools" in v.failed["tool_semantics"]


def test_raw_tool_call_to_a_declared_tool_passes() -> None:
    """Tools not sent to the API (the default): a well-formed call to a declared tool is valid data."""
    s = api_sample("ts-3", content="Checking. " + weather_call(), tools=WEATHER)
    assert P.tool_section_begin_id in s["output_ids"] and not s["tool_calls"]
    v = validate_sample(s, P, CFG)
    assert v.passed and not v.flagged, v
    same_ids = engine_sample("ts-6", s["output_ids"], tools=WEATHER)
    assert validate_sample(same_ids, P, CFG).passed


@pytest.mark.parametrize("name", ["deepseek", "qwen3", "kimi-k2.5"])
def test_raw_and_structured_calls_pass_on_every_profile(name: str) -> None:
    p = load_profile(name)
    pad = ("\n", "\n\n") if name == "qwen3" else ("", "")
    calls = [tool_call("get_weather", {"city": "Paris"}, "functions.get_weather:0"),
             tool_call("get_weather", {"city": "Rome"}, "functions.get_weather:1")]
    raw = p.render_tool_calls(calls)
    for content, structured in ((pad[1] + "Checking." + raw, None), (pad[1] + "Checking.", calls)):
        c = Completion("Two cities." + pad[0], content, structured, "tool_calls" if structured else "stop")
        s = _base("ts-7", True, WEATHER, profile=p)
        ids = rebuild_ids(p, c, True).ids
        s.update(output_ids=ids, ids_from="rebuilt", reasoning=c.reasoning, content=c.content,
                 tool_calls=json.dumps(structured) if structured else "", finish_reason=c.finish_reason,
                 billed_completion_tokens=len(ids))
        v = validate_sample(s, p, CFG)
        assert v.passed and not v.flagged, (name, structured is None, v)
        s["tools"] = json.dumps([{"type": "function", "function": {"name": "search"}}])
        v = validate_sample(s, p, CFG)
        assert set(v.failed) == {"tool_semantics"} and "'get_weather'" in v.failed["tool_semantics"], v
        assert "names no declared tool ['search']" in v.failed["tool_semantics"]


def test_tool_section_inside_reasoning() -> None:
    ids = enc("Maybe") + enc(weather_call()) + [P.think_end_id] + enc("Answer.") + [P.eot_id]
    v = validate_sample(engine_sample("ts-4", ids, tools=WEATHER), P, CFG)
    assert set(v.failed) == {"tool_semantics"}
    assert "inside the reasoning" in v.failed["tool_semantics"]


# -- quality ------------------------------------------------------------------


def test_empty_content_after_stop() -> None:
    s = api_sample("q-1", reasoning="Long thoughts that ate the budget.", content="")
    v = validate_sample(s, P, CFG)
    assert set(v.flagged) == {"empty_content"} and v.passed


def test_truncated_response() -> None:
    s = api_sample("q-2", reasoning="I was thinking about this when", content="", finish="length")
    v = validate_sample(s, P, CFG)
    assert set(v.flagged) == {"truncated"} and not v.failed
    assert s["output_ids"][-1] != P.eot_id and P.think_end_id not in s["output_ids"]


@pytest.mark.parametrize("unit", ["Wait, let me reconsider the problem once more. ", "Again and again. ", " no"])
def test_degenerate_repetition(unit: str) -> None:
    loop = "First I read the question. " + unit * 12
    v = validate_sample(api_sample("q-3", reasoning=loop, content="42"), P, CFG)
    assert set(v.failed) == {"repetition"} and not v.flagged
    assert "repeats 12 times back-to-back (max 8" in v.failed["repetition"]


def test_longest_loop_counts_back_to_back_copies() -> None:
    assert longest_loop([7] * 20, 4) == ([7], 20)
    assert longest_loop([1, 2, 3] * 5 + [9], 4) == ([1, 2, 3], 5)
    assert longest_loop([1, 2, 3], 8) == ([], 0)
    assert longest_loop(list(range(50)), 4) == ([], 0)


def test_repetition_below_threshold_or_scattered_passes() -> None:
    some = "Wait, let me reconsider the problem once more. " * 8
    assert fired(api_sample("q-4", reasoning=some, content="42")) == set()
    phrase = "Let me double-check this step carefully. "
    scattered = "".join(f"Case {i}: the value is {i * i}. {phrase}" for i in range(30))
    assert fired(api_sample("q-5", reasoning=scattered, content="Done.")) == set()


def test_over_max_length() -> None:
    s = api_sample("q-5")
    limit = len(s["prompt_ids"]) + len(s["output_ids"]) - 1
    v = validate_sample(s, P, ChecksConfig(max_total_tokens=limit))
    assert set(v.failed) == {"max_length"} and f"> {limit}" in v.failed["max_length"]


def test_off_mode_skips_a_check() -> None:
    s = api_sample("q-6", reasoning="I was thinking", content="", finish="length")
    v = validate_sample(s, P, ChecksConfig(truncated="off"))
    assert "truncated" not in v.ran and v.flagged == {}


# -- verdict plumbing ---------------------------------------------------------


def test_a_check_that_raises_is_a_failure_not_a_crash() -> None:
    s = engine_sample("x-1", good_ids())
    s["tools"] = '[{"type": "function", "function": '  # a broken row, not a broken run
    v = validate_sample(s, P, CFG)
    assert set(v.failed) == {"tool_semantics"} and not v.flagged
    assert all(d.startswith("check raised JSONDecodeError") for d in v.failed.values())


def test_annotate_and_quarantine_reason_keep_every_detail() -> None:
    s = engine_sample("x-2", enc("a") + [P.think_end_id] + enc("b") + [P.think_end_id] + enc("c") + [P.eot_id])
    s["prompt_assistant_mask"] = []
    v = validate_sample(s, P, ChecksConfig(max_total_tokens=5))
    out = annotate(s, v)
    assert out["checks_failed"] == ["max_length", "structure"]
    assert json.loads(out["check_details"]).keys() == {"max_length", "structure"}
    assert quarantine_reason(v).startswith("max_length: prompt")
    assert "2 </think>" in quarantine_reason(v) and "prompt_assistant_mask" in quarantine_reason(v)


def test_conservation() -> None:
    assert_conservation(10, 7, 3)
    assert_conservation(10, 6, 3, not_generated=1)
    with pytest.raises(ConservationError, match=r"rows in 10 != passed 7 \+ quarantined 2 .*1 rows missing"):
        assert_conservation(10, 7, 2)
    with pytest.raises(ConservationError, match="extra"):
        assert_conservation(3, 3, 1)


def test_gate_names_must_be_checks() -> None:
    assert ChecksConfig(max_failures={"billing": 3}).max_failures == {"billing": 3}
    with pytest.raises(ValueError, match="unknown checks"):
        ChecksConfig(max_failures={"biling": 3})
    assert ChecksConfig(max_failures={"rebuild": 2}).max_failures == {"rebuild": 2}  # every check may be gated
    with pytest.raises(ValueError, match="unknown checks"):
        ChecksConfig(max_failures={"roundtrip_rebuilt": 1})  # a mode of roundtrip's, not a check of its own


def test_every_check_has_a_mode_in_checks_config() -> None:
    """Each named check is set per dataset like the others (quarantine | flag | off); ``roundtrip_rebuilt`` is
    the roundtrip check's mode for rebuilt ids."""
    from pipeline.base.config import CheckMode

    modes = {n for n, f in ChecksConfig.model_fields.items() if f.annotation == CheckMode}
    assert modes == set(CHECK_NAMES) | {"roundtrip_rebuilt"}
    assert ChecksConfig().rebuild == "quarantine"
    assert ChecksConfig.model_validate({"rebuild": False}).rebuild == "off"  # YAML's unquoted off


def _doubtful(sid: str = "doubt-1") -> dict[str, Any]:
    """Rebuilt ids with thinking on, no reasoning returned and 5 billed tokens the ids do not hold: every other
    check passes (5 is under the billing thresholds), the rebuild check doubts them."""
    return api_sample(sid, reasoning=None, diff=-5)


@pytest.mark.parametrize("mode", ["quarantine", "flag", "off"])
def test_the_rebuild_check_follows_its_mode(mode: str) -> None:
    v = validate_sample(_doubtful(), P, ChecksConfig(rebuild=mode))  # type: ignore[arg-type]
    others = set(CHECK_NAMES) - {"rebuild"}
    assert not (set(v.failed) | set(v.flagged)) & others, v
    if mode == "quarantine":
        assert "5 billed tokens" in v.failed["rebuild"] and not v.passed
    elif mode == "flag":  # kept, and counted as flagged
        assert v.passed and "5 billed tokens" in v.flagged["rebuild"] and "rebuild" in v.ran
    else:  # skipped
        assert v.passed and "rebuild" not in v.ran and not v.flagged
    # engine ids are never judged by it, whatever its mode
    assert "rebuild" not in validate_sample(engine_sample("e", good_ids()), P, ChecksConfig(rebuild=mode)).ran  # type: ignore[arg-type]


# -- another profile ----------------------------------------------------------


class CharTokenizer:
    """One id per character; specials are whole strings. Enough to be a different target family."""

    SPECIALS = {"<eot>": 1000, "</think>": 1001, "<tc>": 1002, "</tc>": 1003, "<user>": 1004}

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            hit = next((s for s in self.SPECIALS if text.startswith(s, i)), None)
            ids.append(self.SPECIALS[hit] if hit else ord(text[i]))
            i += len(hit) if hit else 1
        return ids

    def decode(self, ids: list[int]) -> str:
        back = {v: k for k, v in self.SPECIALS.items()}
        return "".join(back.get(i) or chr(i) for i in ids)


@dataclass
class CharProfile(Profile):
    """A made-up family on CharTokenizer; its ids share nothing with DeepSeek's."""

    def render_builtin_prompt(self, messages: list[dict[str, Any]], tools: Any, thinking: bool) -> RenderedPrompt:
        ids = self.encode("<user>" + messages[-1]["content"])
        return RenderedPrompt(ids=ids, assistant_mask=[0] * len(ids), thinking=thinking)

    def render_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        return "".join("<tc>" + json.dumps({"name": c["function"]["name"],
                                            "arguments": json.loads(c["function"]["arguments"])}) + "</tc>"
                       for c in tool_calls)

    def parse_tool_calls(self, section: str) -> list[dict[str, Any]]:
        body = json.loads(section.removeprefix("<tc>").removesuffix("</tc>"))
        return [tool_call(body["name"], body["arguments"], "call_0")]


# Kimi-like: a tool section may end the reasoning without </think>.
OTHER = CharProfile(
    name="other", tokenizer=CharTokenizer(), eot_id=1000, think_start_id=999, think_end_id=1001,
    tool_section_begin_id=1002, tool_section_end_id=1003, forbidden_output_ids=frozenset({1004}),
    tool_marker_ids=frozenset({1002, 1003}), tool_section_ends_reasoning=True,
)


def test_checks_follow_the_profile_fields() -> None:
    tok = OTHER.tokenizer
    good = engine_sample("o-1", tok.encode("hmm</think>hello<eot>"), profile=OTHER)
    assert fired(good, profile=OTHER) == set()
    implied = engine_sample("o-2", tok.encode('hmm<tc>{"name": "get_weather", "arguments": {}}</tc><eot>'),
                            tools=WEATHER, profile=OTHER)
    assert fired(implied, profile=OTHER) == set()
    bad = engine_sample("o-3", tok.encode("hmm</think>hi<user>x<eot>"), profile=OTHER)
    assert fired(bad, profile=OTHER) == {"structure"}
    deepseek_eot = engine_sample("o-4", tok.encode("hmm</think>hi") + [P.eot_id], truncated=False, profile=OTHER)
    assert "does not end with the end-of-turn id" in validate_sample(deepseek_eot, OTHER, CFG).failed["structure"]
