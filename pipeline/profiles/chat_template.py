"""Render prompts through a model folder's Jinja chat template, as engines do.

The text is rendered with transformers' own template renderer (the one
``apply_chat_template`` and vLLM use) and tokenized with the profile's
tokenizer, so the ids equal what the engine is given for the same request.

The assistant mask is found on ids, not text: for each assistant message, the
ids of the conversation up to it plus a generation prompt and the ids up to and
including it share a prefix; what follows that prefix, through the turn's
end-of-turn id, is what the model wrote.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.profiles.base import Profile


def render_template_text(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    thinking: bool,
    add_generation_prompt: bool,
    template_vars: dict[str, Any] | None = None,
) -> str:
    """The chat template's text; thinking is passed under both names templates use."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools or None,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        thinking=thinking,
        enable_thinking=thinking,
        **(template_vars or {}),
    )
    return rendered[0]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def render_template_prompt(
    profile: Profile, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool
) -> tuple[list[int], list[int], bool]:
    """Prompt ids through ``profile.chat_template``, the mask of earlier assistant output, and whether the
    generation prompt opens reasoning.

    The generation prompt is what ``add_generation_prompt`` adds (``generation_opens_reasoning``). Only it says
    whether the turn opens reasoning; a ``<think>`` string a user or a tool result wrote earlier is also
    encoded as the special id.
    """
    assert profile.chat_template is not None

    def text(msgs: list[dict[str, Any]], gen: bool) -> str:
        return render_template_text(
            profile.chat_template, msgs, tools, thinking=thinking, add_generation_prompt=gen,
            template_vars={**profile.template_vars, **profile.template_extra(tools)},
        )

    def ids(msgs: list[dict[str, Any]], gen: bool) -> list[int]:
        return profile.encode(text(msgs, gen))

    full_text = text(messages, True)
    full = profile.encode(full_text)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        through = ids(messages[: i + 1], False)
        if full[: len(through)] != through:
            continue  # the template renders this turn differently once later turns exist
        start = _common_prefix(ids(messages[:i], True), through)
        # The turn ends at its end-of-turn id; template text after it is not the model's.
        ends = [k for k in range(start, len(through)) if through[k] == profile.eot_id]
        for k in range(start, ends[-1] + 1 if ends else len(through)):
            mask[k] = 1
    return full, mask, generation_opens_reasoning(profile, full_text, text(messages, False))


def generation_opens_reasoning(profile: Profile, with_gen: str, without_gen: str) -> bool:
    """Whether the generation prompt (the text ``with_gen`` has after its common prefix with ``without_gen``)
    leaves the model inside ``<think>``: its last start after its last end.

    Judged on text, not ids: a special token's string is always its one id, so the same answer comes without
    encoding the conversation a second time. An occurrence that straddles the prefix's end belongs to the
    generation prompt (the text without it differs there)."""
    start = len(os.path.commonprefix([with_gen, without_gen]))

    def last(token: str) -> int:
        at = with_gen.rfind(token)
        return at if at >= 0 and at + len(token) > start else -1

    return last(profile.token_text(profile.think_start_id)) > last(profile.think_end_text)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def folder_chat_template(model_dir: str | Path) -> tuple[str | None, dict[str, Any]]:
    """A model folder's chat template (chat_template.jinja, else tokenizer_config.json) and its token vars.

    A file the folder has but that cannot give what it claims (not UTF-8, not JSON, a template of the wrong
    shape) raises ValueError naming it: falling back to the built-in layout would change the prompt ids."""
    folder = Path(model_dir)
    cfg_path = folder / "tokenizer_config.json"
    cfg = _read_json(cfg_path) if cfg_path.exists() else {}
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object")
    template: str | None = None
    if (folder / "chat_template.jinja").exists():
        template = _read_text(folder / "chat_template.jinja")
    else:
        raw = cfg.get("chat_template")
        if isinstance(raw, list):  # named templates: the default one renders chats
            raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
            if raw is None:
                raise ValueError(f"{cfg_path}: chat_template lists named templates but none named 'default'")
        if raw is not None and not isinstance(raw, str):
            raise ValueError(f"{cfg_path}: chat_template is a {type(raw).__name__}, expected a string")
        template = raw
    template_vars = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return template, {k: v for k, v in template_vars.items() if v is not None}


def _read_text(path: Path) -> str:
    """A folder file's text; one that is not UTF-8 is a ValueError naming it."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte offset {e.start})") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def encode_segments(
    encode: Callable[[str], list[int]], segments: list[tuple[str, bool]]
) -> tuple[list[int], list[int]]:
    """Ids of the joined text, and a mask of the tokens that came from segments flagged True.

    The text is encoded whole (as the engine does), never piecewise: a segment
    boundary inside a BPE merge is placed at the first token whose ids differ
    from those of the text before the boundary.
    """
    text = "".join(t for t, _ in segments)
    full = encode(text)
    mask = [0] * len(full)
    pos = 0
    for seg, flagged in segments:
        if flagged and seg:
            start = _common_prefix(encode(text[:pos]), full)
            end = _common_prefix(encode(text[: pos + len(seg)]), full)
            for k in range(start, end):
                mask[k] = 1
        pos += len(seg)
    return full, mask
