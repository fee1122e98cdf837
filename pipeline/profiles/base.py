"""What the pipeline knows about a target model: tokens, prompt layout, response layout.

A profile is the single source of truth shared by prompt rendering, output
splitting (what a reasoning parser does), id reconstruction from API text and
validation. Concrete profiles live next to this module.

When a model folder is configured its tokenizer files and chat template win:
the profile then renders prompts through that template (``chat_template``) and
its own built-in layout stays the fallback and the test oracle.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol


class TextTokenizer(Protocol):
    """The two operations the pipeline needs from any tokenizer backend.

    Backends that also have ``encode_ordinary`` and take ``encode(text, specials)`` (both in
    tokenizers.py do) can treat special-token strings as ordinary text; see ``Profile.encode``.
    """

    def encode(self, text: str) -> list[int]:
        """Ids for text; special-token strings inside it become their special ids."""

    def decode(self, ids: list[int]) -> str:
        """Text for ids, special tokens written out as their strings."""


@dataclass
class Completion:
    """One assistant response in the shape an OpenAI-compatible API returns it.

    ``completion_tokens`` is the billed count (``usage.completion_tokens``) when
    known; reconstruction uses it to settle readings the text alone leaves open.
    """

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    completion_tokens: int | None = None


@dataclass
class RenderedPrompt:
    """Prompt ids plus which of them earlier assistant turns produced (for the loss mask)."""

    ids: list[int]
    assistant_mask: list[int]
    thinking: bool  # whether the response is expected to open with reasoning


@dataclass
class Profile(ABC):
    """Token-level facts about one target family."""

    name: str
    tokenizer: TextTokenizer
    eot_id: int
    think_start_id: int
    think_end_id: int
    tool_section_begin_id: int
    tool_section_end_id: int
    # Every special string the model may write, by text.
    special_ids: dict[str, int] = field(default_factory=dict)
    # Ids that belong in prompts only (role headers, BOS, padding, ...).
    forbidden_output_ids: frozenset[int] = frozenset()
    # Ids that only appear inside a tool-call section.
    tool_marker_ids: frozenset[int] = frozenset()
    # Whitespace the target writes right before and right after ``</think>``;
    # reconstruction puts it back where a reasoning parser stripped it.
    think_end_padding: tuple[str, str] = ("", "")
    # Whether the opening of a tool-call section also ends reasoning (no ``</think>`` needed).
    tool_section_ends_reasoning: bool = False
    # A model folder's chat template; when set it renders prompts instead of the built-in layout.
    chat_template: str | None = None
    # Extra variables the chat template reads (bos_token, eos_token, ...).
    template_vars: dict[str, Any] = field(default_factory=dict)

    # -- tokens -----------------------------------------------------------
    def encode(self, text: str, specials: Collection[str] | None = None) -> list[int]:
        """Ids for text. ``specials``: the special-token strings that become their ids; any other is text.

        None honours every special string (prompts; the behaviour before fields had rules). A
        backend without ``encode_ordinary`` honours every one whatever is asked.
        """
        if specials is None or not hasattr(self.tokenizer, "encode_ordinary"):
            return self.tokenizer.encode(text)
        return self.tokenizer.encode(text, specials)  # type: ignore[call-arg]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @cached_property
    def special_id_set(self) -> frozenset[int]:
        """The ids of ``special_ids``, built once (DeepSeek has ~1,300: a set per sample was a seventh of
        validation's time)."""
        return frozenset(self.special_ids.values())

    def warm(self) -> None:
        """Build what the tokenizer builds on first use (the plain tokenizer behind ``encode`` with ``specials``:
        ~0.5 s for DeepSeek's vocabulary) now: a stage actor pays it in its constructor, while the stages ahead
        of it work, instead of on the run's first batch."""
        self.encode("warm", specials=())

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    @property
    def think_end_text(self) -> str:
        return self.decode([self.think_end_id])

    @property
    def eot_text(self) -> str:
        return self.decode([self.eot_id])

    @property
    def tool_section_begin_text(self) -> str:
        return self.decode([self.tool_section_begin_id])

    def normalize(self, text: str, specials: Collection[str] | None = None) -> str:
        """What ``decode(encode(text, specials))`` gives back (Qwen applies NFC; others change nothing)."""
        norm = getattr(self.tokenizer, "normalize", None)
        if not norm:
            return text
        if specials is None or not hasattr(self.tokenizer, "encode_ordinary"):
            return norm(text)
        return norm(text, specials)

    # -- which special tokens can occur where -------------------------------
    # A response is REASONING [</think>] CONTENT [tool-call section] [end of turn]. A provider's
    # reasoning parser cuts at the real </think> (or, where the profile says so, at the real opening
    # of a tool-call section), and the end-of-turn token ends the generation. So a special-token
    # string inside a field is the token only where that token can occur in that field; anywhere
    # else the model wrote it as text (discussing its own format, say) and it is encoded as text.

    @cached_property
    def tool_marker_texts(self) -> frozenset[str]:
        """The strings of every tool-call marker, section begin and end included."""
        ids = set(self.tool_marker_ids) | {self.tool_section_begin_id, self.tool_section_end_id}
        return frozenset(self.decode([i]) for i in ids)

    @property
    def reasoning_specials(self) -> frozenset[str]:
        """Special strings that are real inside reasoning a parser split off.

        Never ``</think>`` (the parser cut at the first one) nor the end of turn. Tool-call
        markers only where a tool-call section does not end reasoning: where it does, a real
        section would have ended the reasoning field before its markers.
        """
        return frozenset() if self.tool_section_ends_reasoning else self.tool_marker_texts

    @property
    def content_specials(self) -> frozenset[str]:
        """Special strings that are real inside content: the tool-call markers.

        With no tools sent (or a tool parser that failed) a call comes back as raw markers
        in content. ``</think>`` is real there only when no reasoning parser ran (reasoning
        is None, thinking on): reconstruction cuts such content at its first ``</think>``.
        """
        return self.tool_marker_texts

    # -- prompts ----------------------------------------------------------
    def render_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool
    ) -> RenderedPrompt:
        """Chat-template the conversation and open the assistant turn.

        A model folder's template wins over the built-in layout; both give ids
        exactly as the engine's tokenizer would produce them for that text.
        """
        if self.chat_template is None:
            return self.render_builtin_prompt(messages, tools, thinking)
        from pipeline.profiles.chat_template import render_template_prompt

        ids, mask, opens = render_template_prompt(self, messages, tools, thinking)
        return RenderedPrompt(ids=ids, assistant_mask=mask, thinking=opens)

    @abstractmethod
    def render_builtin_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool
    ) -> RenderedPrompt:
        """The built-in layout of the conversation, ending in an open assistant turn."""

    def template_extra(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """Variables the engine adds for this family before rendering its chat template."""
        return {}

    def prompt_opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether ids leave the model inside ``<think>`` (their last start after their last end).

        Judge only the generation prompt: earlier turns may hold a ``<think>`` string that a user or a
        tool wrote, encoded as the special id, which says nothing about this turn.
        """
        last_start = max((i for i, t in enumerate(prompt_ids) if t == self.think_start_id), default=-1)
        last_end = max((i for i, t in enumerate(prompt_ids) if t == self.think_end_id), default=-1)
        return last_start > last_end

    # -- tool calls -------------------------------------------------------
    @abstractmethod
    def render_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        """Native text of a tool-call section for OpenAI-style structured calls."""

    @abstractmethod
    def parse_tool_calls(self, section: str) -> list[dict[str, Any]]:
        """Structured calls from the native text of a tool-call section (raises ValueError)."""

    def parse_tool_section_exactly(self, section: str) -> list[dict[str, Any]]:
        """Structured calls only when rendering them back gives ``section`` verbatim (else ValueError).

        A parser that accepts looser text than the target's own layout would
        make the rebuilt ids differ from the emitted ones; such text stays raw.
        """
        calls = self.parse_tool_calls(section)
        if self.render_tool_calls(calls) != section:
            raise ValueError("tool-call section does not render back verbatim")
        return calls

    # -- responses --------------------------------------------------------
    def split_text(self, text: str, thinking: bool) -> Completion:
        """Split a raw response text the way a server's reasoning and tool parsers do.

        ``text`` is the decoded output with special tokens kept. An end-of-turn
        string at the end is removed; a response with no end-of-turn is treated
        as truncated. With thinking on, text before ``</think>`` is reasoning;
        with no ``</think>`` all of it is (as vLLM's deepseek_r1 parser does),
        unless the profile's tool-call section ends reasoning implicitly.
        Whitespace is left exactly as written: this is the parser that strips nothing.
        """
        eot = self.eot_text
        finish = "stop"
        if text.endswith(eot):
            text = text[: -len(eot)]
        else:
            finish = "length"
        reasoning: str | None = None
        begin = self.tool_section_begin_text
        if thinking:
            end = self.think_end_text
            if end in text:
                reasoning, text = text.split(end, 1)
            elif self.tool_section_ends_reasoning and begin in text:
                cut = text.index(begin)
                reasoning, text = text[:cut], text[cut:]
            else:
                reasoning, text = text, ""
        content, tool_calls = text, None
        if begin in content:
            cut = content.index(begin)
            try:
                tool_calls = self.parse_tool_section_exactly(content[cut:])
                content = content[:cut]
                finish = "tool_calls" if finish == "stop" else finish
            except ValueError:
                tool_calls = None
        return Completion(reasoning=reasoning, content=content, tool_calls=tool_calls, finish_reason=finish)

    def split_ids(self, ids: list[int], thinking: bool) -> Completion:
        """Split engine output ids into the API shape, cutting at the real tokens as a server's parsers do.

        The same split as ``split_text(decode(ids))`` (end of turn, ``</think>``, the implicit end
        of reasoning, a tool-call section that renders back verbatim), made on the ids: a special
        string the model wrote as text inside its reasoning or content stays there as text.
        """
        body, finish = list(ids), "stop"
        if body and body[-1] == self.eot_id:
            body = body[:-1]
        else:
            finish = "length"
        reasoning: str | None = None
        if thinking:
            cut = self._reasoning_end(body)
            reasoning = self.decode(body[:cut])
            body = body[cut + 1:] if cut < len(body) and body[cut] == self.think_end_id else body[cut:]
        content, tool_calls = self.decode(body), None
        if self.tool_section_begin_id in body:
            cut = body.index(self.tool_section_begin_id)
            try:
                tool_calls = self.parse_tool_section_exactly(self.decode(body[cut:]))
                content = self.decode(body[:cut])
                finish = "tool_calls" if finish == "stop" else finish
            except ValueError:
                tool_calls = None
        return Completion(reasoning=reasoning, content=content, tool_calls=tool_calls, finish_reason=finish,
                          completion_tokens=len(ids))

    def _reasoning_end(self, body: list[int]) -> int:
        """Where reasoning ends in response ids (end of turn removed): the first ``</think>``, else the
        first section begin where that ends reasoning, else the end."""
        if self.think_end_id in body:
            return body.index(self.think_end_id)
        if self.tool_section_ends_reasoning and self.tool_section_begin_id in body:
            return body.index(self.tool_section_begin_id)
        return len(body)

    def reencode(self, ids: list[int], thinking: bool) -> list[int]:
        """The ids a text rebuild gives for these ids' own fields: equal to ``ids`` when they are canonical.

        The ids are cut into reasoning and content at the real tokens (as ``split_ids`` does), each
        field's decoded text is encoded with the special strings that field can hold, and the cut
        tokens are put back. A special id where the layout has no room for it (a second ``</think>``,
        a role header) comes back as text; ids BPE would merge differently come back merged.
        """
        body, tail = list(ids), []
        if body and body[-1] == self.eot_id:
            body, tail = body[:-1], [self.eot_id]
        out: list[int] = []
        if thinking:
            cut = self._reasoning_end(body)
            out += self.encode(self.decode(body[:cut]), self.reasoning_specials)
            if cut < len(body) and body[cut] == self.think_end_id:
                out.append(self.think_end_id)
                cut += 1
            body = body[cut:]
        return out + self.encode(self.decode(body), self.content_specials) + tail


def tool_call(name: str, arguments: Any, call_id: str) -> dict[str, Any]:
    """An OpenAI-style structured tool call."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def call_arguments(call: dict[str, Any]) -> str:
    """A structured call's arguments as the text the model wrote (strings verbatim, objects as JSON)."""
    fn = call.get("function", call)
    args = fn.get("arguments", "")
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    """The function object of an OpenAI tool (``{"type": "function", "function": {...}}``) or a bare one."""
    return tool.get("function", tool)
