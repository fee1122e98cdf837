"""The engine oracle (tests only): rebuild ids from an engine's own text, as the API path does, and compare
them with the engine's ids. It proves pipeline.checks.reconstruct exact on canonical samples."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from pipeline.checks.reconstruct import rebuild_ids
from pipeline.profiles.base import Profile


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def oracle_report(profile: Profile, samples: list[dict[str, Any]], max_examples: int = 5) -> dict[str, Any]:
    """Compare rebuilt ids with an engine's own output ids.

    Each sample holds ``output_ids`` (the engine's ids), ``thinking`` and,
    optionally, ``text`` (the engine's detokenized text with special tokens
    kept; decoded from the ids when absent). The text is split as a reasoning parser
    would (``profile.split_text``), billed as the API would bill it (one token
    per id), rebuilt, and compared. A sample is canonical when decode->encode
    gives its ids back, both as a whole (no special string written as text,
    which a text split could take for the token) and field by field
    (``profile.reencode``: every special id where the layout has room for it).
    A model may emit ids a fresh encode merges differently, or a special token
    where the text of that field reads it as text; no text-based rebuild can
    recover those, so exactness is judged on the canonical samples, where it
    must be 1.0.
    """
    n = canonical = exact = exact_canonical = 0
    readings_used: Counter[str] = Counter()
    text_mismatch = 0
    failures: list[dict[str, Any]] = []
    with_tools = with_reasoning = with_markers = with_think_end = truncated = 0
    canonical_markers = canonical_think_end = 0
    for s in samples:
        ids = [int(i) for i in s["output_ids"]]
        thinking = bool(s.get("thinking", True))
        decoded = profile.decode(ids)
        text = s.get("text")
        if text is None:
            text = decoded
        else:
            if ids and ids[-1] == profile.eot_id and not text.endswith(profile.eot_text):
                text += profile.eot_text  # vLLM leaves the stop token's text out of ``text``
            text_mismatch += text != decoded
        is_canonical = profile.encode(decoded) == ids and profile.reencode(ids, thinking) == ids
        completion = profile.split_text(text, thinking)
        completion.completion_tokens = len(ids)
        rebuilt = rebuild_ids(profile, completion, thinking)
        ok = rebuilt.ids == ids
        n += 1
        canonical += is_canonical
        exact += ok
        exact_canonical += ok and is_canonical
        readings_used[rebuilt.reading] += 1
        with_tools += bool(completion.tool_calls)
        has_markers = any(i in profile.tool_marker_ids for i in ids)
        with_markers += has_markers
        with_think_end += profile.think_end_id in ids
        canonical_markers += is_canonical and has_markers
        canonical_think_end += is_canonical and profile.think_end_id in ids
        with_reasoning += bool(completion.reasoning)
        truncated += rebuilt.truncated
        if is_canonical and not ok and len(failures) < max_examples:
            at = _first_diff(rebuilt.ids, ids)
            failures.append({
                "index": n - 1, "first_diff": at, "engine": ids[max(0, at - 3): at + 3],
                "rebuilt": rebuilt.ids[max(0, at - 3): at + 3], "completion": json.dumps(completion.__dict__)[:500],
            })
    return {
        "samples": n,
        "canonical": canonical,
        "canonical_share": canonical / n if n else 0.0,
        "exact": exact,
        "exact_rate": exact / n if n else 0.0,
        "exact_on_canonical": exact_canonical / canonical if canonical else 0.0,
        "canonical_mismatches": canonical - exact_canonical,
        "with_tool_calls": with_tools,
        "with_tool_markers": with_markers,
        "with_think_end": with_think_end,
        "canonical_with_tool_markers": canonical_markers,
        "canonical_with_think_end": canonical_think_end,
        "with_reasoning": with_reasoning,
        "truncated": truncated,
        "engine_text_differs_from_decode": text_mismatch,
        "readings": dict(readings_used),
        "failures": failures,
    }
