"""Special-token strings inside API text: real ids only where the layout lets that token occur, text elsewhere.

A provider splits reasoning from content at the real ``</think>``; a ``</think>`` string left inside the
``reasoning`` field was therefore written as text (a model discussing its own format). The end-of-turn
token ends the generation, so its string inside any field is text too; prompt-only tokens never occur
in a response. Raw tool-call markers in ``content`` are real (tools not sent: no tool parser ran).
Run on the real DeepSeek tokenizer.json, the real Qwen rank file and the Kimi-format tokenizer.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.base.config import ChecksConfig
from pipeline.base.records import empty_sample
from pipeline.checks.reconstruct import default_reading, rebuild_ids, response_text
from pipeline.checks.validate import validate_sample
from pipeline.profiles import PROFILE_NAMES, load_profile
from pipeline.profiles.base import Completion, Profile, tool_call
from tests.helpers.oracle import oracle_report

PROFILES = {name: load_profile(name) for name in PROFILE_NAMES}
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
CALL = tool_call("get_weather", '{"city": "Paris"}', "functions.get_weather:0")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=PROFILE_NAMES)
def profile(request: pytest.FixtureRequest) -> Profile:
    return PROFILES[request.param]


def _prompt_only(p: Profile) -> str:
    """A special string that belongs in prompts only (a role header)."""
    return next(t for t, i in sorted(p.special_ids.items()) if i in p.forbidden_output_ids and "reserved" not in t)


def _rebuilt_sample(p: Profile, c: Completion, thinking: bool = True, tools: list | None = None) -> dict:
    rebuilt = rebuild_ids(p, c, thinking)
    s = empty_sample({"sample_id": "s:0", "dataset": "d", "row_index": 0, "messages": "[]",
                      "tools": json.dumps(tools) if tools else "", "thinking": thinking,
                      "prompt_ids": [1, 2], "prompt_assistant_mask": [0, 0]})
    s.update(output_ids=rebuilt.ids, ids_from="rebuilt", reasoning=c.reasoning, content=c.content,
             tool_calls=json.dumps(c.tool_calls) if c.tool_calls else "", finish_reason=c.finish_reason,
             truncated=rebuilt.truncated, billed_completion_tokens=len(rebuilt.ids))
    return s


# -- encode modes ---------------------------------------------------------------------


def test_encode_honours_only_the_given_special_strings(profile: Profile) -> None:
    p = profile
    end, eot, begin = p.think_end_text, p.eot_text, p.tool_section_begin_text
    text = f"a{end}b {eot} c{begin}d"
    assert p.encode(text, None) == p.encode(text)  # None: every special string is its id, as before
    plain = p.encode(text, frozenset())
    assert not set(plain) & set(p.special_ids.values()) and p.decode(plain) == text
    only_end = p.encode(text, frozenset({end}))
    assert only_end == p.encode("a", frozenset()) + [p.think_end_id] + p.encode(f"b {eot} c{begin}d", frozenset())
    assert set(only_end) & set(p.special_ids.values()) == {p.think_end_id}
    # Both tokenizer classes take the same argument.
    assert p.tokenizer.encode(text, frozenset({end})) == only_end


# -- the per-field rules ----------------------------------------------------------------


def test_think_end_string_inside_reasoning_is_text(profile: Profile) -> None:
    p = profile
    reasoning = f"I close my reasoning with {p.think_end_text} and then answer.\n"
    c = Completion(reasoning, "\n\nThe answer is 4.", None, "stop")
    ids = rebuild_ids(p, c, thinking=True).ids
    assert ids.count(p.think_end_id) == 1
    assert p.decode(ids) == response_text(p, c, True)
    v = validate_sample(_rebuilt_sample(p, c), p, ChecksConfig())
    assert v.passed and not v.flagged, v


def test_strings_of_tokens_a_field_cannot_hold_are_text(profile: Profile) -> None:
    p = profile
    header = _prompt_only(p)
    reasoning = f"Format: {p.eot_text} ends a turn, {header} opens one, <think> starts reasoning.\n"
    content = f"\n\nNo {p.think_end_text} here, nor {p.eot_text}, nor {header}."
    c = Completion(reasoning, content, None, "stop")
    rebuilt = rebuild_ids(p, c, thinking=True)
    ids = rebuilt.ids
    assert ids.count(p.think_end_id) == 1 and ids.count(p.eot_id) == 1 and ids[-1] == p.eot_id
    assert not set(ids) & p.forbidden_output_ids
    assert p.decode(ids) == response_text(p, c, True)
    assert p.reencode(ids, True) == ids  # the layout reads these ids back as the same fields
    v = validate_sample(_rebuilt_sample(p, c), p, ChecksConfig())
    assert v.passed and not v.flagged, v


def test_tool_markers_inside_reasoning_follow_the_profile(profile: Profile) -> None:
    p = profile
    section = p.render_tool_calls([CALL])
    c = Completion(f"I could write {section} now.\n", "\n\nNo need.", None, "stop")
    ids = rebuild_ids(p, c, thinking=True).ids
    if p.tool_section_ends_reasoning:
        # A real section would have ended the reasoning: inside the reasoning field it is text.
        assert not set(ids) & p.tool_marker_ids
        assert p.reasoning_specials == frozenset()
    else:
        assert p.tool_section_begin_id in ids[: ids.index(p.think_end_id)]
        assert p.reasoning_specials == p.tool_marker_texts
    assert p.decode(ids) == response_text(p, c, True)


def test_raw_tool_markers_in_content_stay_real(profile: Profile) -> None:
    p = profile
    section = p.render_tool_calls([CALL])
    c = Completion("r", f"Sure {p.think_end_text}." + section, None, "stop")
    ids = rebuild_ids(p, c, thinking=True).ids
    assert p.tool_section_begin_id in ids and p.tool_section_end_id in ids
    assert ids.count(p.think_end_id) == 1
    assert p.content_specials == p.tool_marker_texts


def test_content_no_parser_split_honours_only_the_first_think_end(profile: Profile) -> None:
    p = profile
    end = p.think_end_text
    c = Completion(None, f"reasoning{end}The tag {end} closes reasoning.", None, "stop")
    ids = rebuild_ids(p, c, thinking=True).ids
    assert ids.count(p.think_end_id) == 1
    assert ids == (p.encode("reasoning", p.reasoning_specials) + [p.think_end_id]
                   + p.encode(f"The tag {end} closes reasoning.", p.content_specials) + [p.eot_id])
    # With thinking off no reasoning was written: every </think> string is text.
    off = rebuild_ids(p, Completion(None, f"a{end}b", None, "stop"), thinking=False).ids
    assert p.think_end_id not in off and p.decode(off) == f"a{end}b{p.eot_text}"


def test_tool_call_arguments_holding_special_strings(profile: Profile) -> None:
    p = profile
    args = json.dumps({"q": f"what does {p.think_end_text} or {p.eot_text} mean"})
    call = tool_call("search", args, "functions.search:0")
    c = Completion("look it up", None, [call], "tool_calls")
    ids = rebuild_ids(p, c, thinking=True).ids
    assert ids.count(p.think_end_id) == 1 and ids.count(p.eot_id) == 1
    back = p.split_ids(ids, thinking=True)
    assert back.tool_calls and json.loads(back.tool_calls[0]["function"]["arguments"]) == json.loads(args)


# -- engine ids, split_ids and the oracle -----------------------------------------------------


def _literal_ids(p: Profile) -> tuple[list[int], str, str]:
    """Engine ids whose reasoning and content hold special strings written as ordinary text.

    Around the real ``</think>`` the whitespace the target writes there (Qwen: ``\n</think>\n\n``): without it
    a bill that may be a token off could not tell its text from the padded layout's (``check_rebuild``).
    """
    before, after = p.think_end_padding
    reasoning = f"Writing {p.think_end_text} ends my reasoning; {p.eot_text} ends the turn.{before}"
    content = f"{after}Done: {p.think_end_text} {p.eot_text} {_prompt_only(p)}."
    ids = p.encode(reasoning, frozenset()) + [p.think_end_id] + p.encode(content, frozenset()) + [p.eot_id]
    return ids, reasoning, content


def test_split_ids_cuts_at_the_real_tokens_and_rebuilds_exactly(profile: Profile) -> None:
    p = profile
    ids, reasoning, content = _literal_ids(p)
    c = p.split_ids(ids, thinking=True)
    assert (c.reasoning, c.content, c.finish_reason, c.completion_tokens) == (reasoning, content, "stop", len(ids))
    assert rebuild_ids(p, c, thinking=True).ids == ids
    assert p.reencode(ids, True) == ids
    # The text alone cannot tell: a text split cuts at the first </think> string.
    assert p.split_text(p.decode(ids), thinking=True).reasoning != reasoning


def test_engine_sample_with_literal_specials_passes_every_check(profile: Profile) -> None:
    p = profile
    ids, _, _ = _literal_ids(p)
    c = p.split_ids(ids, thinking=True)
    s = _rebuilt_sample(p, c)
    assert s["output_ids"] == ids
    for origin in ("engine", "rebuilt"):
        s["ids_from"] = origin
        v = validate_sample(s, p, ChecksConfig())
        assert v.passed and not v.flagged, (origin, v)


def test_oracle_counts_misplaced_specials_as_not_canonical(profile: Profile) -> None:
    p = profile
    pad = ("\n", "\n\n") if p.name == "qwen3" else ("", "")
    good = p.encode("r" + pad[0]) + [p.think_end_id] + p.encode(pad[1] + "fine") + [p.eot_id]
    # A second real </think>: the text says "</think>" inside content, which the layout reads as text.
    twice = p.encode("r" + pad[0]) + [p.think_end_id] + p.encode(pad[1] + "a") + [p.think_end_id] + [p.eot_id]
    report = oracle_report(p, [{"output_ids": good, "thinking": True}, {"output_ids": twice, "thinking": True}])
    assert report["samples"] == 2 and report["canonical"] == 1
    assert report["exact_on_canonical"] == 1.0 and report["canonical_mismatches"] == 0


# -- properties -------------------------------------------------------------------------


def _text(p: Profile) -> st.SearchStrategy[str]:
    specials = sorted(p.special_ids)
    piece = st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=16),
        st.sampled_from([" ", "\n", "\n\n", "e\u0301", "你好", "x = 1", "  "]),
        st.sampled_from([p.think_end_text, p.eot_text, "<think>"]),
        st.sampled_from(specials),
    )
    return st.lists(piece, max_size=8).map("".join)


def _literal_case(p: Profile) -> st.SearchStrategy[tuple[Completion, bool]]:
    text = _text(p)
    return st.tuples(
        st.builds(Completion, st.none() | text, st.none() | text, st.none(), st.sampled_from(["stop", "length"])),
        st.booleans(),
    )


def _expected_think_ends(p: Profile, c: Completion, thinking: bool) -> int:
    """How many </think> ids the layout says the response holds."""
    reading = default_reading(p, c, thinking)
    no_parser = thinking and not c.reasoning and p.think_end_text in (c.content or "")
    return int(reading.think_end) + int(no_parser)


def _check_literal(p: Profile, c: Completion, thinking: bool) -> None:
    rebuilt = rebuild_ids(p, c, thinking)
    ids = rebuilt.ids
    assert p.decode(ids) == response_text(p, c, thinking)
    assert ids.count(p.think_end_id) == _expected_think_ends(p, c, thinking)
    assert p.eot_id not in (ids[:-1] if c.finish_reason != "length" else ids)
    assert not set(ids) & p.forbidden_output_ids
    body = ids if c.finish_reason == "length" else ids[:-1]
    reasoning_end = body.index(p.think_end_id) if p.think_end_id in body else len(body)
    allowed_in_reasoning = {p.special_ids[t] for t in p.reasoning_specials}
    specials = set(p.special_ids.values())
    if c.reasoning is not None:
        assert {i for i in body[:reasoning_end] if i in specials} <= allowed_in_reasoning


@pytest.mark.parametrize("name", PROFILE_NAMES)
@SETTINGS
@given(data=st.data())
def test_encode_modes_agree_where_they_should(name: str, data: st.DataObject) -> None:
    """Honouring every special string is the native encode; with none in the text, plain text is too."""
    p = PROFILES[name]
    text = data.draw(_text(p))
    assert p.encode(text, frozenset(p.special_ids)) == p.encode(text)
    plain = p.encode(text, frozenset())
    assert p.decode(plain) == p.normalize(text, frozenset())
    if not any(t in text for t in p.special_ids):
        assert plain == p.encode(text)


@pytest.mark.parametrize("name", PROFILE_NAMES)
@SETTINGS
@given(data=st.data())
def test_literal_specials_rebuild_to_the_text_and_the_layout(name: str, data: st.DataObject) -> None:
    p = PROFILES[name]
    _check_literal(p, *data.draw(_literal_case(p)))


@pytest.mark.parametrize("name", PROFILE_NAMES)
@SETTINGS
@given(data=st.data())
def test_engine_ids_with_literal_specials_survive_split_ids(name: str, data: st.DataObject) -> None:
    """Ids a target could write (special strings in its text as ordinary tokens) split and rebuild exactly."""
    p = PROFILES[name]
    before, after = p.think_end_padding  # what the target writes around </think>
    reasoning, content = data.draw(_text(p)) + before, after + data.draw(_text(p))
    ids = p.encode(reasoning, p.reasoning_specials) + [p.think_end_id]
    ids += p.encode(content, frozenset()) + [p.eot_id]
    if p.reencode(ids, True) != ids:
        return  # e.g. a reasoning section marker that ends the reasoning early: not this layout
    c = p.split_ids(ids, thinking=True)
    assert rebuild_ids(p, c, thinking=True).ids == ids
