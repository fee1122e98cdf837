"""Property tests: any API text rebuilds to ids that decode back to it and never merge across a special token.

Run on the real DeepSeek tokenizer.json, the real Qwen rank file and the
Kimi-format tokenizer (Kimi's pattern and special layout on that rank file).
Example counts stay modest: CI has two cores.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.checks.reconstruct import default_reading, rebuild_ids, response_segments, response_text
from pipeline.profiles import PROFILE_NAMES, load_profile
from pipeline.profiles.base import Completion, Profile, tool_call

PROFILES = {name: load_profile(name) for name in PROFILE_NAMES}
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))

SNIPPETS = [
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { a[i] = b[i]; }", "SELECT * FROM t;",
    "你好，世界。", "東京都に住んでいます", "한국어 텍스트", "😀👍🏽🇫🇷", "e\u0301", "Å", "\r\n", "\t\t",
    "x = {\"a\": [1, 2, 3]}", "  indented", "1234567890", "don't", "<think>", "<|im_end|", "｜tool▁sep",
]


def _text(profile: Profile) -> st.SearchStrategy[str]:
    specials = sorted(profile.special_ids)
    piece = st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=24),
        st.sampled_from(SNIPPETS),
        st.integers(1, 400).map(lambda n: " " * n),
        st.integers(1, 60).map(lambda n: "\n" * n),
        st.sampled_from(specials),
    )
    return st.lists(piece, max_size=8).map("".join)


def _completion(profile: Profile) -> st.SearchStrategy[tuple[Completion, bool]]:
    text = _text(profile)
    calls = st.lists(
        st.builds(lambda name, arg, i: tool_call(name, json.dumps({"q": arg}, ensure_ascii=False), f"call_{i}"),
                  st.sampled_from(["get_weather", "search", "run_code"]), text, st.integers(0, 3)),
        min_size=1, max_size=2,
    )
    return st.tuples(
        st.builds(Completion, st.none() | text, st.none() | text, st.none() | calls,
                  st.sampled_from(["stop", "length", "tool_calls"])),
        st.booleans(),
    )


def _piecewise(profile: Profile, c: Completion, thinking: bool) -> list[int]:
    """Each run of text between the special strings its segment honours encoded alone as plain text,
    those specials as their ids; any other special string stays text."""
    ids: list[int] = []
    for seg in response_segments(profile, c, thinking, default_reading(profile, c, thinking)):
        if isinstance(seg, int):
            ids.append(seg)
            continue
        if not seg.specials:
            ids += profile.tokenizer.encode_ordinary(seg.text)
            continue
        cut = re.compile("(" + "|".join(map(re.escape, sorted(seg.specials, key=len, reverse=True))) + ")")
        for k, part in enumerate(cut.split(seg.text)):
            if k % 2:
                ids.append(profile.special_ids[part])
            elif part:
                ids += profile.tokenizer.encode_ordinary(part)
    return ids


def _check(profile: Profile, c: Completion, thinking: bool) -> None:
    rebuilt = rebuild_ids(profile, c, thinking)
    assert profile.decode(rebuilt.ids) == response_text(profile, c, thinking)
    assert rebuilt.ids == _piecewise(profile, c, thinking)
    assert rebuilt.truncated == (c.finish_reason == "length")
    if c.finish_reason != "length":
        assert rebuilt.ids[-1] == profile.eot_id


@SETTINGS
@given(case=_completion(PROFILES["deepseek"]))
def test_deepseek_rebuild_roundtrips(case: tuple[Completion, bool]) -> None:
    _check(PROFILES["deepseek"], *case)


@SETTINGS
@given(case=_completion(PROFILES["qwen3"]))
def test_qwen3_rebuild_roundtrips(case: tuple[Completion, bool]) -> None:
    _check(PROFILES["qwen3"], *case)


@SETTINGS
@given(case=_completion(PROFILES["kimi-k2.5"]))
def test_kimi_rebuild_roundtrips(case: tuple[Completion, bool]) -> None:
    _check(PROFILES["kimi-k2.5"], *case)


@pytest.mark.parametrize("name", PROFILE_NAMES)
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_split_then_rebuild_is_exact_on_canonical_text(name: str, data: st.DataObject) -> None:
    """Text a target could have written (ids = encode(text)) survives split_text -> rebuild exactly."""
    p = PROFILES[name]
    body = data.draw(_text(p))
    thinking = data.draw(st.booleans())
    ids = p.encode(body)
    if p.eot_id in ids:
        ids = ids[: ids.index(p.eot_id) + 1]
    if p.encode(p.decode(ids)) != ids or p.reencode(ids, thinking) != ids:
        return  # not canonical (BPE, or a special token where its field reads it as text): no text rebuild
    c = p.split_text(p.decode(ids), thinking)
    c.completion_tokens = len(ids)
    assert rebuild_ids(p, c, thinking).ids == ids
