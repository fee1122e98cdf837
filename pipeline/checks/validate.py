"""Named checks over one generated sample. Pure functions; the stage adapter lives in stages.py.

Each check returns None when it passes, or a short detail string when it fails.
What a failure does (quarantine, flag, nothing) is the dataset's ChecksConfig.
Checks read only Profile fields, so every target family gets the same checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.base.config import CheckMode, ChecksConfig
from pipeline.base.flight import output_len
from pipeline.checks.reconstruct import cut_off, rebuild_ids
from pipeline.profiles.base import Completion, Profile, tool_function

Check = Callable[[dict[str, Any], Profile, ChecksConfig], str | None]


class ConservationError(RuntimeError):
    """Rows went missing (or appeared) between the input and the passed/quarantined outputs."""


def assert_conservation(rows_in: int, passed: int, quarantined: int, not_generated: int = 0) -> None:
    """Every input row must end passed, quarantined or explicitly not generated; raise with the figures."""
    figures = {"rows_in": rows_in, "passed": passed, "quarantined": quarantined, "not_generated": not_generated}
    negative = [k for k, v in figures.items() if v < 0]
    accounted = passed + quarantined + not_generated
    if negative or accounted != rows_in:
        gap = rows_in - accounted
        raise ConservationError(
            f"sample conservation violated: rows in {rows_in} != passed {passed} + quarantined {quarantined}"
            f" + not generated {not_generated} (= {accounted}; {abs(gap)} rows {'missing' if gap > 0 else 'extra'})"
            + (f"; negative counts: {negative}" if negative else "")
        )


# -- helpers shared by checks and the audit -----------------------------------


def declared_tool_names(sample: dict[str, Any]) -> set[str]:
    """Function names the prompt declared in ``sample["tools"]`` (OpenAI tool JSON, or "")."""
    raw = sample.get("tools") or ""
    tools = json.loads(raw) if isinstance(raw, str) and raw.strip() else (raw or [])
    fns = [tool_function(t) for t in tools if isinstance(t, dict)]
    return {str(fn["name"]) for fn in fns if isinstance(fn, dict) and fn.get("name")}


def sample_tool_calls(sample: dict[str, Any]) -> list[Any]:
    """The structured calls the source reported (``tool_calls`` JSON, or "")."""
    raw = sample.get("tool_calls") or ""
    calls = json.loads(raw) if isinstance(raw, str) and raw.strip() else raw
    return list(calls or [])


def response_texts(sample: dict[str, Any], p: Profile) -> tuple[str, str]:
    """(reasoning, content) as stored; split from the ids when a source stored neither."""
    reasoning, content = sample.get("reasoning"), sample.get("content")
    if reasoning is None and content is None:
        parts = p.split_ids(list(sample["output_ids"]), bool(sample["thinking"]))
        reasoning, content = parts.reasoning, parts.content
    return reasoning or "", content or ""


def is_truncated(sample: dict[str, Any]) -> bool:
    """Cut before the model ended it: flagged so, or a finish reason other than a natural end (``length``,
    ``content_filter``, ``abort``, ...). A row that names no finish reason is judged by its flag alone."""
    finish = sample.get("finish_reason")
    return bool(sample.get("truncated")) or (isinstance(finish, str) and bool(finish) and cut_off(finish))


def billing_diff(sample: dict[str, Any]) -> int | None:
    """len(output ids) - billed completion tokens, or None where the source bills nothing (a sample row, or
    the writer's tally row of one)."""
    billed = sample.get("billed_completion_tokens")
    if billed is None or billed < 0:
        return None
    return (output_len(sample) or 0) - int(billed)


def billing_outlier(diff: int, billed: int, cfg: ChecksConfig) -> bool:
    """Over both thresholds: the absolute one, and the relative one (relative to the billed count).

    A token or two on a short answer (a provider counting its stop token, say) is not drift;
    a few tokens on a long response are not either. Large both ways, the ids cannot account
    for what was billed.
    """
    return abs(diff) > cfg.billing_abs_threshold and abs(diff) > cfg.billing_rel_threshold * max(billed, 1)


def longest_loop(ids: list[int], n: int) -> tuple[list[int], int]:
    """The block repeated back-to-back the most times, and that count (0 when no n-gram recurs).

    A loop of period p repeated k times makes every n-gram inside it recur exactly p tokens
    later, so a run of R positions whose n-gram recurs at a constant distance p spans
    k = (R + n - 1) // p + 1 copies. Phrases that recur scattered through a long reasoning
    never form such runs, so only degenerate loops count. O(len(ids)) with one dict.
    """
    last: dict[tuple[int, ...], int] = {}
    run_d, run_len, run_start = 0, 0, 0
    best: tuple[list[int], int] = ([], 0)
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i : i + n])
        d = i - last[gram] if gram in last else 0
        last[gram] = i
        if d and d == run_d:
            run_len += 1
        else:
            run_d, run_len, run_start = d, int(d > 0), i
        if d:
            k = (run_len + n - 1) // d + 1
            if k > best[1]:
                best = (ids[run_start - d : run_start], k)
    return best


@dataclass
class ToolSections:
    """Where the tool-call sections of a response lie, and what is wrong with their bracketing."""

    spans: list[tuple[int, int]]  # (begin index, end index) of each closed section, inclusive
    problems: list[str]
    open_at: int | None = None  # begin index of a section the response never closed


def find_tool_sections(ids: list[int], p: Profile) -> ToolSections:
    """Pair section begin/end ids; markers outside a section and nesting are problems."""
    begin, end = p.tool_section_begin_id, p.tool_section_end_id
    inner = set(p.tool_marker_ids) - {begin, end}
    out = ToolSections(spans=[], problems=[])
    for i, t in enumerate(ids):
        if t == begin:
            if out.open_at is not None:
                out.problems.append(f"tool-call section opened at {i} inside the one opened at {out.open_at}")
            out.open_at = i
        elif t == end:
            if out.open_at is None:
                out.problems.append(f"tool-call section end at {i} without a begin")
            else:
                out.spans.append((out.open_at, i))
                out.open_at = None
        elif t in inner and out.open_at is None:
            out.problems.append(f"tool-call marker {t} at {i} outside a section")
    return out


def _section_problems(sample: dict[str, Any], ids: list[int], p: Profile) -> list[str]:
    """The bracketing of tool-call sections; what the calls inside say is ``tool_call_problems``."""
    sections = find_tool_sections(ids, p)
    problems = list(sections.problems)
    if sections.open_at is not None and not is_truncated(sample):
        problems.append(f"tool-call section opened at {sections.open_at} never closed")
    return problems


def tool_call_problems(sample: dict[str, Any], ids: list[int], p: Profile) -> list[str]:
    """Each closed tool-call section in the ids, parsed by the profile: malformed calls, undeclared tools.

    Engine ids and rebuilt ids get the same rule: the section the target wrote (raw markers in
    content, or structured calls rendered back) is judged by what it says, not by where its
    markers showed up in the API's text.
    """
    declared = declared_tool_names(sample)
    problems = []
    sections = find_tool_sections(ids, p)
    if sections.open_at is not None and not declared:  # cut off before it closed: no call to judge, yet a call
        problems.append(f"tool-call section opened at {sections.open_at} but the prompt declared no tools")
    for b, e in sections.spans:
        try:
            calls = p.parse_tool_calls(p.decode(ids[b : e + 1]))
        except (ValueError, KeyError, TypeError) as err:
            problems.append(f"tool-call section at {b} does not parse: {err}")
            continue
        for call in calls:
            fn = call.get("function", {})
            name, args = fn.get("name"), fn.get("arguments")
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except ValueError as err:
                problems.append(f"tool call {name!r} at {b}: arguments are not a JSON object: {str(args)[:60]!r} "
                                f"({err})")
                parsed = {}
            if not isinstance(parsed, dict):
                problems.append(f"tool call {name!r} at {b}: arguments are not a JSON object: {str(args)[:60]!r}")
            if name not in declared:
                problems.append(f"tool call {name!r} at {b} names no declared tool "
                                + (f"{sorted(declared)}" if declared else "(the prompt declared no tools)"))
    return problems


# -- the checks ---------------------------------------------------------------


def check_structure(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    """Token layout: one </think>, end-of-turn last, no prompt-only ids, tool sections opened and closed."""
    ids = list(s["output_ids"])
    truncated = is_truncated(s)
    problems = []
    if not ids:
        problems.append("empty response")
    if not truncated and (not ids or ids[-1] != p.eot_id):
        problems.append("does not end with the end-of-turn id")
    if p.eot_id in ids[:-1]:
        problems.append(f"end-of-turn id inside the response at {ids.index(p.eot_id)}")
    n_end = ids.count(p.think_end_id)
    if s["thinking"]:
        # A cut inside the reasoning, or (where the profile says so) a tool section, may end it implicitly.
        implied = truncated or (p.tool_section_ends_reasoning and p.tool_section_begin_id in ids)
        if n_end > 1 or (n_end == 0 and not implied):
            problems.append(f"{n_end} </think> tokens with thinking on (expected 1)")
    elif n_end:
        problems.append(f"{n_end} </think> tokens with thinking off (expected 0)")
    bad = sorted({i for i in ids if i in p.forbidden_output_ids})
    if bad:
        problems.append(f"forbidden tokens {bad[:5]}{' ...' if len(bad) > 5 else ''}")
    vocab = getattr(p.tokenizer, "vocab_size", None)
    outside = sorted({i for i in ids if i < 0 or (vocab is not None and i >= vocab)})
    if outside:
        problems.append(f"ids outside the vocabulary {outside[:5]}")
    mask = s.get("prompt_assistant_mask")
    if mask is not None and s.get("prompt_ids") is not None and len(mask) != len(s["prompt_ids"]):
        problems.append(f"prompt_assistant_mask has {len(mask)} entries for {len(s['prompt_ids'])} prompt ids")
    if not outside:  # decoding ids outside the vocabulary would fail for a reason already reported
        problems += _section_problems(s, ids, p)
    return "; ".join(problems) or None


def reencode_text(ids: list[int], p: Profile) -> list[int]:
    """Special ids kept; each run of text between them decoded and encoded again as ordinary text.

    Where the special tokens sit is the structure check's business; this is the canonical
    tokenization of the text, a special string the model wrote as text included.
    """
    specials = p.special_id_set
    out: list[int] = []
    start = 0
    for k in [k for k, i in enumerate(ids) if i in specials] + [len(ids)]:
        if k > start:
            out += p.encode(p.decode(ids[start:k]), frozenset())
        if k < len(ids):
            out.append(ids[k])
        start = k + 1
    return out


def check_roundtrip(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    """decode then encode gives the same ids (the canonical tokenization of the text)."""
    ids = list(s["output_ids"])
    if is_truncated(s):
        # A cut may split a multi-byte character; compare what precedes the partial character.
        text = p.decode(ids)
        for _ in range(4):
            if not ids or not text.endswith("\ufffd"):
                break
            ids = ids[:-1]
            text = p.decode(ids)
    again = reencode_text(ids, p)
    if again == ids:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ids, again, strict=False)) if a != b), min(len(ids), len(again)))
    return (f"decode->encode differs at token {first} ({len(ids)} ids vs {len(again)}): "
            f"{ids[first : first + 4]} vs {again[first : first + 4]}")


def check_billing(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    """Ids vs the provider's billed completion tokens; a large gap means the ids are not what was generated.

    Rebuilt ids that cannot account for the bill (different text, a hidden part, another model) are
    not trustworthy training data: ``billing`` quarantines by default.
    """
    diff = billing_diff(s)
    if diff is None:
        return None
    billed = int(s["billed_completion_tokens"])
    if not billing_outlier(diff, billed, cfg):
        return None
    origin = "rebuilt" if s.get("ids_from") == "rebuilt" else "engine"
    return (f"{origin} {len(s['output_ids'])} ids, billed {billed}, difference {diff:+d} = "
            f"{abs(diff) / max(billed, 1):.1%} of the bill (over both thresholds {cfg.billing_abs_threshold} "
            f"tokens and {cfg.billing_rel_threshold:.1%})")


def check_tool_semantics(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    """Every tool-call section in the ids parses into calls to declared tools with JSON-object arguments.

    Judged on the ids, the same way for engine and rebuilt samples: a raw section an API left in
    ``content`` (tools not sent) is as good as a structured call when it says the same thing.
    """
    ids = list(s["output_ids"])
    problems = tool_call_problems(s, ids, p)
    if s["thinking"] and p.think_end_id in ids and p.tool_section_begin_id in ids[: ids.index(p.think_end_id)]:
        problems.append("tool-call section inside the reasoning")
    return "; ".join(problems) or None


def check_empty_content(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    """A finished response with no answer and no tool call (e.g. reasoning ate the budget)."""
    if is_truncated(s):
        return None  # the truncated check owns that case
    _, content = response_texts(s, p)
    if content.strip() or sample_tool_calls(s) or p.tool_section_begin_id in s["output_ids"]:
        return None
    return f"no content and no tool call after {len(s['output_ids'])} tokens"


def check_truncated(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    if not is_truncated(s):
        return None
    return f"cut off after {len(s['output_ids'])} tokens (finish_reason {s.get('finish_reason')!r})"


def check_rebuild(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    """Rebuilt ids the API's text and bill do not pin down, though every other check may pass.

    The source's rebuild says so in ``rebuild_doubt`` (``reconstruct.rebuild_doubt`` says why): a bill that
    cannot tell two readings apart, reasoning the API hid with no bill to show it was empty, a filtered answer.
    Where the row does not carry it (a written shard the audit re-checks), the rebuild is run again on the
    stored fields.
    """
    carried = s.get("rebuild_doubt")
    if carried is not None:
        return carried or None
    billed = s.get("billed_completion_tokens")
    c = Completion(s.get("reasoning"), s.get("content"), sample_tool_calls(s) or None,
                   str(s.get("finish_reason") or "stop"), int(billed) if billed is not None and billed >= 0 else None)
    return rebuild_ids(p, c, bool(s["thinking"])).doubt


def check_repetition(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    """Degenerate loops: a block repeated back-to-back more often than the configured threshold."""
    block, count = longest_loop(list(s["output_ids"]), cfg.repetition_ngram)
    if count <= cfg.repetition_max_repeats:
        return None
    return (f"{len(block)}-token block {p.decode(block)[:60]!r} repeats {count} times back-to-back "
            f"(max {cfg.repetition_max_repeats}; {cfg.repetition_ngram}-gram matching)")


def check_max_length(s: dict[str, Any], p: Profile, cfg: ChecksConfig) -> str | None:
    n_prompt, n_out = len(s.get("prompt_ids") or []), len(s["output_ids"])
    if n_prompt + n_out <= cfg.max_total_tokens:
        return None
    return f"prompt {n_prompt} + output {n_out} = {n_prompt + n_out} tokens > {cfg.max_total_tokens}"


CHECKS: dict[str, Check] = {
    "structure": check_structure,
    "roundtrip": check_roundtrip,
    "billing": check_billing,
    "tool_semantics": check_tool_semantics,
    "empty_content": check_empty_content,
    "truncated": check_truncated,
    "repetition": check_repetition,
    "max_length": check_max_length,
    "rebuild": check_rebuild,
}
CHECK_NAMES = tuple(CHECKS)


def configured_mode(name: str, cfg: ChecksConfig) -> CheckMode:
    """A check's mode in ``cfg`` (every check has a ChecksConfig field of its name; a test holds them equal)."""
    mode: CheckMode = getattr(cfg, name)
    return mode


def check_mode(name: str, sample: dict[str, Any], cfg: ChecksConfig) -> CheckMode:
    """The mode of a check for this sample; roundtrip depends on where the ids came from."""
    if name == "roundtrip" and sample.get("ids_from") == "rebuilt":
        return cfg.roundtrip_rebuilt
    if name == "billing" and billing_diff(sample) is None:
        return "off"  # nothing billed, nothing to compare
    if name == "rebuild" and sample.get("ids_from") != "rebuilt":
        return "off"  # an engine's ids are its own, not a reading of text
    return configured_mode(name, cfg)


@dataclass
class Verdict:
    failed: dict[str, str] = field(default_factory=dict)   # checks whose mode is quarantine
    flagged: dict[str, str] = field(default_factory=dict)  # checks whose mode is flag
    ran: list[str] = field(default_factory=list)           # every check that was run, passing or not

    @property
    def passed(self) -> bool:
        return not self.failed


def validate_sample(sample: dict[str, Any], profile: Profile, cfg: ChecksConfig) -> Verdict:
    """Run every enabled check; sort failures into quarantining and flagging ones.

    A check that raises (e.g. ids a tokenizer cannot decode) counts as failing with the error as
    its detail: a broken sample must never take the run down nor slip through unchecked.
    """
    verdict = Verdict()
    for name, check in CHECKS.items():
        mode = check_mode(name, sample, cfg)
        if mode == "off":
            continue
        verdict.ran.append(name)
        try:
            detail = check(sample, profile, cfg)
        except Exception as e:  # noqa: BLE001 - reported as the check's failure detail
            detail = f"check raised {type(e).__name__}: {e}"
        if detail is not None:
            (verdict.failed if mode == "quarantine" else verdict.flagged)[name] = detail
    return verdict


def annotate(sample: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
    """A copy of the sample with its verdict in the checks_* columns of SAMPLE_SCHEMA."""
    return {
        **sample,
        "checks_failed": sorted(verdict.failed),
        "checks_flagged": sorted(verdict.flagged),
        "check_details": json.dumps({**verdict.flagged, **verdict.failed}, ensure_ascii=False, sort_keys=True),
    }


def quarantine_reason(verdict: Verdict) -> str:
    """One line naming every failed check with its detail (the quarantine row's ``reason``)."""
    return "; ".join(f"{k}: {v}" for k, v in sorted(verdict.failed.items()))
