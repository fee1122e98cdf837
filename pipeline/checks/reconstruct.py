"""Exact target token ids from the text an OpenAI-compatible API returns.

ids = encode(reasoning) + [</think>] + encode(content) [+ tool-call section] + [end-of-turn]

Each text segment is encoded on its own so BPE never merges across a special
token. A special-token string inside a field becomes the special id only where
the layout lets that token occur in that field (``Profile.reasoning_specials``,
``Profile.content_specials``): raw tool-call markers that leak into ``content``
when no tools were sent are the ids the target wrote; a ``</think>`` inside the
``reasoning`` a parser split off, or an end-of-turn or role-header string
anywhere, was written as text and is encoded as text. Content that no reasoning
parser touched (reasoning None, thinking on) holds the real ``</think>``: its
first one. Structured ``tool_calls`` are rendered back into the profile's
native section, where only the tool-call markers are tokens.

Two things the text alone leaves open, settled by the profile's rules and, when
the API reports it, the billed ``completion_tokens``:

* whether ``</think>`` was written. A response that finished (or was cut off)
  with reasoning and no content reads the same either way; so does a Kimi or
  Qwen tool call that ended reasoning implicitly. The layout says it was
  written unless the response was cut off inside its reasoning.
* whitespace a reasoning parser stripped around ``</think>``: the profile's
  ``think_end_padding`` is what the target writes there; it is put back where
  the reasoning ends, or the content starts, with no whitespace at all.

The default reading comes first; when the billed count is known and the default
does not match it, the other readings are tried and the first that matches wins.
That settles them for a server that bills every id it generated (vLLM, SGLang).
A provider's bill may be a token off (openrouter.md: mean |diff| 1.0 token), and
the readings differ by one token (a ``</think>``) or two: where the default is
within ``BILL_SLACK`` of the bill too, the bill cannot say which the target
wrote. ``Rebuilt.doubt`` says so, and the validation stage quarantines the
sample (``check_rebuild``, by default; ``checks.rebuild`` may flag it or skip
the check) rather than keep ids that may be a token wrong.

An answer ends with the end-of-turn id only when the API says the model ended
it (``NATURAL_ENDS``); any other finish (``length``, a filter, an abort) cut it.
Empty reasoning (``""``) is no reasoning, the same as ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeline.profiles.base import Completion, Profile

# Finish reasons that say the model ended its turn (wrote its end-of-turn token): OpenAI's, vLLM's and
# SGLang's ``stop`` and ``tool_calls`` (``function_call``: OpenAI's older name for the same). Anything else
# (``length``, ``content_filter``, vLLM/SGLang ``abort``, a name we do not know) cut the answer off.
NATURAL_ENDS = frozenset({"stop", "tool_calls", "function_call"})
# Tokens a provider's bill may be off on a faithful response (openrouter.md: mean |diff| 1.0 token).
BILL_SLACK = 1
# Finish reasons whose text is not known to be what the target wrote (a provider's filter cut or edited it).
FILTERED = frozenset({"content_filter"})


def cut_off(finish_reason: str) -> bool:
    """Whether the answer was cut before the model ended it: no end-of-turn id was generated."""
    return finish_reason not in NATURAL_ENDS


@dataclass
class Rebuilt:
    ids: list[int]
    truncated: bool
    reading: str = "default"  # which reading of the text produced ids (see module docstring)
    billed_delta: int | None = None  # len(ids) - billed completion_tokens, when billed
    reasoning_missing: bool = False  # thinking on, yet the API returned no reasoning to rebuild
    doubt: str | None = None  # why the text and bill do not pin the ids down (see check_rebuild)


class TextSeg(NamedTuple):
    """A run of response text and the special-token strings that are tokens inside it."""

    text: str
    specials: frozenset[str]


Segment = int | TextSeg  # a special id the layout puts there, or text


@dataclass(frozen=True)
class Reading:
    think_end: bool
    pad: bool
    # Thinking on, no reasoning, a ``</think>`` string in content: no parser ran and it is the real one.
    # Off for the same text read as a parser's split that found the reasoning empty ("" from vLLM's parser).
    unparsed: bool = False

    @property
    def label(self) -> str:
        return (("think_end" if self.think_end else "no_think_end") + ("+padded" if self.pad else "")
                + ("+unparsed" if self.unparsed else ""))


def completion_from_message(
    message: dict[str, Any], finish_reason: str | None, usage: dict[str, Any] | None = None
) -> Completion:
    """A Completion from an API ``message``: ``reasoning`` (OpenRouter) or ``reasoning_content`` (vLLM/SGLang),
    else the ``reasoning.text`` parts of OpenRouter's ``reasoning_details`` (the HTTP source's rule)."""
    reasoning = message.get("reasoning")
    if not reasoning:  # "" is no reasoning: a server may send it empty and the text in reasoning_content
        reasoning = message.get("reasoning_content") or reasoning
    if not reasoning:  # some providers send reasoning null and the text only in reasoning_details
        reasoning = reasoning_details_text(message.get("reasoning_details")) or reasoning
    calls = message.get("tool_calls") or None
    billed = (usage or {}).get("completion_tokens")
    return Completion(
        reasoning=reasoning,
        content=message.get("content"),
        tool_calls=list(calls) if calls else None,
        finish_reason=finish_reason or "stop",
        completion_tokens=_billed(billed),
    )


def reasoning_details_text(details: Any) -> str | None:
    """The model's own reasoning text in OpenRouter's ``reasoning_details`` (its ``reasoning.text`` parts, in
    order), or None. Summaries (``reasoning.summary``) and encrypted parts (``reasoning.encrypted``) are not the
    tokens it generated, so they are no text to rebuild from; the field is only a fallback, so an odd shape there
    adds nothing rather than failing the answer. The same rule as the HTTP source's reading of a message."""
    if not isinstance(details, list):
        return None
    texts = [d["text"] for d in details
             if isinstance(d, dict) and d.get("type") == "reasoning.text" and isinstance(d.get("text"), str)]
    return "".join(texts) if texts else None


def _billed(v: Any) -> int | None:
    """The billed count when it is a number; a missing or odd value is unknown, not an error."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        return None
    try:
        return int(v)
    except (ValueError, OverflowError):
        return None


def completion_from_response(body: dict[str, Any]) -> Completion:
    """The first choice of a chat-completions response body, with its billed token count."""
    choice = body["choices"][0]
    return completion_from_message(choice.get("message") or {}, choice.get("finish_reason"), body.get("usage"))


def _think_end_written(profile: Profile, c: Completion, thinking: bool, unparsed: bool) -> tuple[bool, bool]:
    """(whether ``</think>`` goes in by default, whether the other reading is possible)."""
    if not thinking:
        return False, False
    content = c.content or ""
    if unparsed:
        return False, False  # no reasoning parser ran: </think> is inside the content already
    truncated = cut_off(c.finish_reason)
    if content:
        # A raw tool-call section right after the reasoning may have ended it implicitly.
        implicit = profile.tool_section_ends_reasoning and content.startswith(profile.tool_section_begin_text)
        return True, implicit
    if c.tool_calls:
        return True, profile.tool_section_ends_reasoning
    # Reasoning and nothing after it: cut off inside the reasoning, or </think> right before the end.
    return not truncated, True


def _padded(profile: Profile, reasoning: str, content: str, c: Completion, think_end: bool) -> tuple[str, str]:
    before, after = profile.think_end_padding
    if not think_end:
        return reasoning, content
    if before and not reasoning[-1:].isspace():
        reasoning += before
    if after and not content[:1].isspace() and (content or c.tool_calls or not cut_off(c.finish_reason)):
        content = after + content
    return reasoning, content


def _unparsed(profile: Profile, c: Completion, thinking: bool) -> bool:
    """Thinking on, no reasoning ("" or None) and a ``</think>`` string in content: by default no reasoning
    parser ran, and the content holds the reasoning and the real ``</think>``."""
    return thinking and not c.reasoning and profile.think_end_text in (c.content or "")


def response_segments(profile: Profile, c: Completion, thinking: bool, reading: Reading) -> list[Segment]:
    """The response as text segments and special ids, in order, for one reading."""
    reasoning, content = c.reasoning or "", c.content or ""
    if reading.pad:
        reasoning, content = _padded(profile, reasoning, content, c, reading.think_end)
    segs: list[Segment] = []
    if reasoning:
        segs.append(TextSeg(reasoning, profile.reasoning_specials))
    if reading.think_end:
        segs.append(profile.think_end_id)
    if content and reading.unparsed:
        head, tail = content.split(profile.think_end_text, 1)
        segs += [TextSeg(head, profile.reasoning_specials), profile.think_end_id]
        content = tail
    if content:
        segs.append(TextSeg(content, profile.content_specials))
    if c.tool_calls:
        segs.append(TextSeg(profile.render_tool_calls(c.tool_calls), profile.tool_marker_texts))
    if not cut_off(c.finish_reason):
        segs.append(profile.eot_id)
    return segs


def response_text(profile: Profile, c: Completion, thinking: bool, reading: Reading | None = None) -> str:
    """What ``decode(rebuild_ids(...).ids)`` gives back for the default reading (the test oracle)."""
    reading = reading or default_reading(profile, c, thinking)
    parts = response_segments(profile, c, thinking, reading)
    return "".join(profile.token_text(p) if isinstance(p, int) else profile.normalize(p.text, p.specials)
                   for p in parts)


def default_reading(profile: Profile, c: Completion, thinking: bool) -> Reading:
    thinking = thinking or bool(c.reasoning)
    unparsed = _unparsed(profile, c, thinking)
    think_end, _ = _think_end_written(profile, c, thinking, unparsed)
    return Reading(think_end=think_end, pad=any(profile.think_end_padding), unparsed=unparsed)


def readings(profile: Profile, c: Completion, thinking: bool) -> list[Reading]:
    """Every reading of the text the target could have written, the default first."""
    thinking = thinking or bool(c.reasoning)
    first = default_reading(profile, c, thinking)
    _, open_question = _think_end_written(profile, c, thinking, first.unparsed)
    out = [first]
    if first.pad:
        out.append(Reading(first.think_end, False))
    if open_question:
        out += [Reading(not first.think_end, first.pad), Reading(not first.think_end, False)]
    if first.unparsed and c.reasoning == "":
        # An empty string may also be a parser's split whose reasoning was empty (the model wrote </think>
        # first): then the </think> string in content is text the model wrote after it.
        think_end = _think_end_written(profile, c, thinking, False)[0]
        out += [Reading(think_end, first.pad), Reading(think_end, False)]
    return list(dict.fromkeys(out))


def encode_segments(profile: Profile, segs: list[Segment | str]) -> list[int]:
    """Ids of segments: special ids as they are, text with its own specials (a bare str honours all)."""
    ids: list[int] = []
    for seg in segs:
        if isinstance(seg, int):
            ids.append(seg)
        elif isinstance(seg, TextSeg):
            ids += profile.encode(seg.text, seg.specials)
        else:
            ids += profile.encode(seg)
    return ids


def rebuild_ids(profile: Profile, completion: Completion, thinking: bool) -> Rebuilt:
    """Rebuild the response ids the target produced for ``completion``.

    Reasoning returned with thinking off is still the model's text before a ``</think>`` it wrote.
    """
    truncated = cut_off(completion.finish_reason)
    missing = thinking and not completion.reasoning and profile.think_end_text not in (completion.content or "")
    options = readings(profile, completion, thinking)
    billed = completion.completion_tokens
    first_ids: list[int] | None = None
    chosen: Rebuilt | None = None
    for reading in options:
        ids = encode_segments(profile, response_segments(profile, completion, thinking, reading))
        if first_ids is None:
            first_ids = ids
        if billed is None:
            break
        if len(ids) == billed:
            chosen = Rebuilt(ids, truncated, reading.label, 0, missing)
            break
    assert first_ids is not None
    if chosen is None:
        chosen = Rebuilt(first_ids, truncated, options[0].label, None if billed is None else len(first_ids) - billed,
                         missing)
    chosen.doubt = rebuild_doubt(completion, chosen, options[0].label, len(first_ids))
    return chosen


def rebuild_doubt(c: Completion, rebuilt: Rebuilt, default_label: str, n_default: int) -> str | None:
    """Why ``rebuilt.ids`` may not be what the target wrote though every other check passes, or None.

    A bill within ``BILL_SLACK`` of the default reading cannot overrule it (the bill may be that far off);
    reasoning the API did not return is only known to be empty when the bill leaves no room for it; a
    filtered answer's text is the filter's.
    """
    billed = c.completion_tokens
    doubts = []
    if c.finish_reason in FILTERED:
        doubts.append(f"finish_reason {c.finish_reason!r}: the provider's filter cut or changed the answer, so its "
                      "text is not known to be the target's")
    if rebuilt.reading != default_label and billed is not None and abs(n_default - billed) <= BILL_SLACK:
        doubts.append(f"the bill ({billed} tokens) fits reading {rebuilt.reading} ({len(rebuilt.ids)} ids) but is "
                      f"within {BILL_SLACK} of the layout's reading {default_label} ({n_default} ids): a bill that "
                      "may be a token off cannot say which the target wrote")
    if rebuilt.reasoning_missing and (billed is None or len(rebuilt.ids) < billed - BILL_SLACK):
        hidden = "and no bill to show none was hidden" if billed is None else \
            f"and {billed - len(rebuilt.ids)} billed tokens are not in the ids"
        doubts.append(f"thinking on but the API returned no reasoning {hidden}")
    return "; ".join(doubts) or None


def rebuild_from_response(profile: Profile, body: dict[str, Any], thinking: bool) -> Rebuilt:
    """Rebuild ids straight from a chat-completions response body."""
    return rebuild_ids(profile, completion_from_response(body), thinking)
