"""Profiles on real tokenizers: ids, prompt layouts, folder overrides, parser splits, the Kimi log filter."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeline.profiles import PROFILE_NAMES, load_profile
from pipeline.profiles.base import Profile, tool_call
from pipeline.profiles.deepseek import DEEPSEEK_CHAT_TEMPLATE, deepseek_tokenizer_dir
from pipeline.profiles.kimi import KIMI_PAT, KIMI_SPECIAL_OFFSETS, MAX_RUN, kimi_tokenizer
from pipeline.profiles.kimi_tools import tools_typescript
from pipeline.profiles.log_filters import KimiEncodeWarningFilter, silence_kimi_encode_warning
from pipeline.profiles.qwen3 import qwen_rank_file
from pipeline.profiles.tokenizers import load_tiktoken_ranks

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = tool_call("get_weather", '{"city": "Paris"}', "functions.get_weather:0")

CONVERSATIONS: list[tuple[list[dict[str, Any]], Any, bool]] = [
    ([{"role": "user", "content": "Hi there"}], None, True),
    ([{"role": "user", "content": "Hi there"}], None, False),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 你好 😀"}], None, True),
    ([{"role": "user", "content": "Weather in Paris?"}], WEATHER, True),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "18C sunny"}],
     WEATHER, True),
]


@pytest.fixture(scope="module", params=PROFILE_NAMES)
def profile(request: pytest.FixtureRequest) -> Profile:
    return load_profile(request.param)


def test_load_profile_names() -> None:
    for name in PROFILE_NAMES:
        assert load_profile(name).name == name
    with pytest.raises(ValueError, match="unknown model profile"):
        load_profile("llama")


def test_profile_fields_are_meaningful(profile: Profile) -> None:
    p = profile
    ids = {p.eot_id, p.think_start_id, p.think_end_id, p.tool_section_begin_id, p.tool_section_end_id}
    assert len(ids) == 5 and ids <= set(p.special_ids.values())
    # Every special id decodes to its string and that string encodes back to the one id.
    for text, i in p.special_ids.items():
        assert p.decode([i]) == text and p.encode(text) == [i]
    allowed = {p.eot_id, p.think_end_id} | p.tool_marker_ids
    assert not allowed & p.forbidden_output_ids
    assert {p.tool_section_begin_id, p.tool_section_end_id} <= p.tool_marker_ids
    # Prompt-only tokens: everything that opens a turn or reasoning is forbidden in output.
    assert p.think_start_id in p.forbidden_output_ids
    prompt = p.render_prompt([{"role": "user", "content": "hi"}], None, True).ids
    assert p.think_end_id not in prompt
    assert {i for i in prompt if i in p.special_ids.values()} - {p.eot_id} <= p.forbidden_output_ids


def test_prompt_opens_reasoning_matches_thinking(profile: Profile) -> None:
    for messages, tools, thinking in CONVERSATIONS:
        r = profile.render_prompt(messages, tools, thinking)
        assert len(r.ids) == len(r.assistant_mask)
        if messages[-1]["role"] == "tool" and profile.name == "deepseek":
            assert not r.thinking  # V3.1 resumes its turn after a tool result without reasoning
        else:
            assert r.thinking == thinking
        assert profile.prompt_opens_reasoning(r.ids) == r.thinking


def test_assistant_mask_covers_what_the_model_wrote(profile: Profile) -> None:
    messages, tools, thinking = CONVERSATIONS[2]
    r = profile.render_prompt(messages, tools, thinking)
    masked = profile.decode([i for i, m in zip(r.ids, r.assistant_mask, strict=True) if m])
    assert masked.endswith("4" + profile.eot_text)
    assert masked.count(profile.eot_text) == 1


# -- Kimi ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi() -> Profile:
    return load_profile("kimi-k2.5")


def test_kimi_specials_sit_after_the_base_ranks_at_kimis_offsets(kimi: Profile) -> None:
    n_base = len(load_tiktoken_ranks(qwen_rank_file()))
    assert n_base == 151_643
    for token, offset in KIMI_SPECIAL_OFFSETS.items():
        assert kimi.special_ids[token] == n_base + offset
    assert kimi.eot_id == n_base + 2 and kimi.think_end_id == n_base + 23
    assert len(kimi.special_ids) == 256
    assert kimi.special_ids[f"<|reserved_token_{n_base + 5}|>"] == n_base + 5
    assert kimi.tokenizer.vocab_size == n_base + 256


def test_kimi_pretokenizer_splits_han_runs_and_short_digit_groups(kimi: Profile) -> None:
    import regex

    text = "你好世界abc 12345 HelloWorld don't"
    pieces = regex.findall(KIMI_PAT, text, flags=regex.V1)  # tiktoken's regex engine reads && as V1 does
    assert pieces == ["你好世界", "abc", " ", "123", "45", " Hello", "World", " don't"]
    # Tokens never straddle a pre-token boundary.
    bounds = {0}
    for piece in pieces:
        bounds.add(max(bounds) + len(piece))
    pos = 0
    for i in kimi.encode(text):
        pos += len(kimi.decode([i]))
        assert pos in bounds or not any(b > pos - len(kimi.decode([i])) and b < pos for b in bounds)
    assert pos == len(text)


def test_kimi_cuts_long_runs_like_its_tokenizer(kimi: Profile) -> None:
    text = "a" * (MAX_RUN + 10) + " " * (MAX_RUN + 3) + "b"
    ids = kimi.encode(text)
    assert kimi.decode(ids) == text
    enc = kimi.tokenizer._enc  # the bare tiktoken encoding, to show the cut is where Kimi cuts
    expected = enc.encode_ordinary("a" * MAX_RUN) + enc.encode_ordinary("a" * 10 + " " * MAX_RUN)
    expected += enc.encode_ordinary(" " * 3 + "b")
    assert ids == expected


def test_kimi_prompt_layout(kimi: Profile) -> None:
    messages, tools, _ = CONVERSATIONS[4]
    text = kimi.decode(kimi.render_prompt(messages, tools, True).ids)
    decl = tools_typescript(WEATHER)
    assert decl.startswith("# Tools\n\n## functions\nnamespace functions {\n// Weather for a city\n")
    assert text == (
        f"<|im_system|>tool_declare<|im_middle|>{decl}<|im_end|>"
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18C sunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    off = kimi.decode(kimi.render_prompt([{"role": "user", "content": "x"}], None, False).ids)
    assert off.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    own = kimi.decode(kimi.render_prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "x"}],
                                         None, True).ids)
    assert own.startswith("<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>")
    assert "You are Kimi" not in own


def test_kimi_keeps_reasoning_only_in_the_open_tool_loop(kimi: Profile) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "reasoning_content": "old thought"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "", "reasoning_content": "new thought", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"},
    ]
    text = kimi.decode(kimi.render_prompt(messages, WEATHER, True).ids)
    assert "<think></think>A<|im_end|>" in text and "old thought" not in text
    assert "<think>new thought</think><|tool_calls_section_begin|>" in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18C" in text


def test_kimi_typescript_tool_declaration() -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather.\nUse it for cities.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
            "city": {"type": "string", "maxLength": 40},
            "days": {"type": "integer", "minimum": 1, "default": 1},
            "tags": {"type": "array", "items": {"type": "string", "description": "a tag"}},
            "filters": {"type": "object", "properties": {"exact": {"type": "boolean"}}, "additionalProperties": False},
        }}}}, {"type": "retrieval"}]
    assert tools_typescript(tools) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "// Get the weather.\n// Use it for cities.\n"
        "type get_weather = (_: {\n"
        "  // maxLength: 40\n  city: string,\n"
        "  // minimum: 1\n  // Default: 1\n  days?: number,\n"
        "  filters?: {\n    exact?: boolean,\n    [k: string]: never\n  },\n"
        "  tags?: Array<\n    // a tag\n    string\n  >,\n"
        '  // Unit\n  unit?: "celsius" | "fahrenheit"\n'
        "}) => any;\n}\n"
    )
    assert tools_typescript([]) == "" and tools_typescript([{"type": "retrieval"}]) == ""


def test_kimi_typescript_defs_and_self_reference() -> None:
    tool = {"type": "function", "function": {"name": "tree", "parameters": {
        "properties": {"node": {"$ref": "#/$defs/Node"}, "child": {"$ref": "#"}},
        "$defs": {"Node": {"type": "object", "description": "A node",
                           "properties": {"v": {"type": ["string", "null"]}}}},
    }}}
    assert tools_typescript([tool]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "interface parameters {\n  node?: Node,\n  child?: parameters\n}\n"
        "// A node\ninterface Node {\n  v?: string | null\n}\n"
        "type tree = (_: parameters) => any;\n}\n"
    )


def _kimi_folder(tmp: Path, template: str | None) -> Path:
    """A Kimi-format model folder: tiktoken.model plus the added-token names, on a real rank file."""
    shutil.copyfile(qwen_rank_file(), tmp / "tiktoken.model")
    n_base = 151_643
    names = {**{t: n_base + o for t, o in KIMI_SPECIAL_OFFSETS.items()}, "<|media_begin|>": n_base + 18}
    cfg: dict[str, Any] = {"added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in names.items()},
                           "bos_token": "[BOS]", "eos_token": "[EOS]"}
    if template is not None:
        cfg["chat_template"] = template
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp


def test_kimi_model_folder_names_and_template_win(tmp_path: Path) -> None:
    template = ("{%- for m in messages -%}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
                "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
                "{%- if thinking -%}<think>{%- else -%}<think></think>{%- endif -%}{%- endif -%}")
    folder = _kimi_folder(tmp_path, template)
    p = load_profile("kimi-k2.5", str(folder))
    assert p.special_ids["<|media_begin|>"] == 151_643 + 18  # a name only the folder knows
    r = p.render_prompt([{"role": "user", "content": "hi"}], None, True)
    assert p.decode(r.ids) == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    assert r.thinking and not p.render_prompt([{"role": "user", "content": "hi"}], None, False).thinking


def test_kimi_folder_without_template_uses_the_builtin_layout(tmp_path: Path, kimi: Profile) -> None:
    p = load_profile("kimi-k2.5", str(_kimi_folder(tmp_path, None)))
    for messages, tools, thinking in CONVERSATIONS:
        assert p.render_prompt(messages, tools, thinking).ids == kimi.render_prompt(messages, tools, thinking).ids


# K2.5's chat template as the facts in chat-formats.md describe it, written as Jinja.
KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
    "{%- if tools_ts_str is defined -%}{{ tools_ts_str }}{%- else -%}{{ tools | tojson(separators=(',', ':')) }}"
    "{%- endif -%}<|im_end|>{%- endif -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>{%- endif -%}"
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}"
    "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>{{ m.get('name') or 'user' }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'system' -%}"
    "<|im_system|>{{ m.get('name') or 'system' }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>{{ m.get('name') or 'tool' }}<|im_middle|>"
    "## Return of {{ m['tool_call_id'] }}\n{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ m.get('name') or 'assistant' }}<|im_middle|><think>"
    "{%- if loop.index0 > ns.last -%}{{ m.get('reasoning_content') or '' }}{%- endif -%}"
    "</think>{{ m['content'] or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for c in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>{{ c['function']['arguments'] }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking -%}<think>{%- else -%}<think></think>{%- endif -%}{%- endif -%}"
)


def test_kimi_folder_template_gets_the_typescript_tools_and_equals_builtin(tmp_path: Path, kimi: Profile) -> None:
    p = load_profile("kimi-k2.5", str(_kimi_folder(tmp_path, KIMI_TEMPLATE)))
    assert p.chat_template == KIMI_TEMPLATE
    for messages, tools, thinking in CONVERSATIONS:
        a, b = kimi.render_prompt(messages, tools, thinking), p.render_prompt(messages, tools, thinking)
        assert (a.ids, a.assistant_mask, a.thinking) == (b.ids, b.assistant_mask, b.thinking)


def test_kimi_tokenizer_on_a_rank_file_path() -> None:
    tok = kimi_tokenizer(qwen_rank_file())
    assert tok.decode(tok.encode("<|im_end|>x")) == "<|im_end|>x"


# -- folder overrides: DeepSeek's template and the built-in layout agree --------------


def _deepseek_folder(tmp: Path) -> Path:
    src = deepseek_tokenizer_dir()
    shutil.copyfile(src / "tokenizer.json", tmp / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = DEEPSEEK_CHAT_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return tmp


def test_deepseek_folder_template_equals_builtin(tmp_path: Path) -> None:
    builtin = load_profile("deepseek")
    folder = load_profile("deepseek", str(_deepseek_folder(tmp_path)))
    assert folder.chat_template == DEEPSEEK_CHAT_TEMPLATE and builtin.chat_template is None
    for messages, tools, thinking in CONVERSATIONS:
        a = builtin.render_prompt(messages, tools, thinking)
        b = folder.render_prompt(messages, tools, thinking)
        assert a.ids == b.ids and a.thinking == b.thinking
        assert a.assistant_mask == b.assistant_mask


def test_transformers_apply_chat_template_gives_the_profile_ids(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast  # the class the folder's tokenizer_config names

    folder = _deepseek_folder(tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token=cfg["bos_token"]["content"],
                                 eos_token=cfg["eos_token"]["content"], chat_template=cfg["chat_template"])
    p = load_profile("deepseek", str(folder))
    for messages, tools, thinking in CONVERSATIONS:
        got = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                     thinking=thinking)
        got = got["input_ids"] if hasattr(got, "keys") else got
        assert list(got) == p.render_prompt(messages, tools, thinking).ids


# -- Qwen3 --------------------------------------------------------------------------


def test_qwen3_ids_and_layout() -> None:
    p = load_profile("qwen3")
    assert (p.special_ids["<|im_start|>"], p.eot_id, p.tool_section_begin_id, p.think_start_id, p.think_end_id) == (
        151644, 151645, 151657, 151667, 151668)
    text = p.decode(p.render_prompt(*CONVERSATIONS[4]).ids)
    assert text.startswith("<|im_start|>system\n# Tools\n\n")
    assert '\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n18C sunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n")
    off = p.decode(p.render_prompt([{"role": "user", "content": "x"}], None, False).ids)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_applies_nfc_like_its_tokenizer_json() -> None:
    p = load_profile("qwen3")
    decomposed = "e\u0301"
    assert p.decode(p.encode(decomposed)) == "\u00e9" == p.normalize(decomposed)


# -- parser splits --------------------------------------------------------------------


def test_split_text_per_profile(profile: Profile) -> None:
    p = profile
    section = p.render_tool_calls([CALL])
    c = p.split_text("think" + p.think_end_text + "answer" + section + p.eot_text, thinking=True)
    assert (c.reasoning, c.content, c.finish_reason) == ("think", "answer", "tool_calls")
    assert c.tool_calls is not None and c.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(c.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    # No </think>: all of it is reasoning; no end-of-turn: truncated.
    c = p.split_text("still thinking", thinking=True)
    assert (c.reasoning, c.content, c.finish_reason) == ("still thinking", "", "length")
    # A broken section stays raw in the content, markers and all.
    broken = p.tool_section_begin_text + "oops"
    c = p.split_text("r" + p.think_end_text + broken + p.eot_text, thinking=True)
    assert (c.content, c.tool_calls, c.finish_reason) == (broken, None, "stop")


def test_tool_section_ends_reasoning_for_kimi_and_qwen(profile: Profile) -> None:
    section = profile.render_tool_calls([CALL])
    c = profile.split_text("think" + section + profile.eot_text, thinking=True)
    if profile.tool_section_ends_reasoning:
        assert (c.reasoning, c.content) == ("think", "") and c.tool_calls
    else:
        assert c.reasoning == "think" + section and not c.tool_calls
    assert profile.tool_section_ends_reasoning == (profile.name != "deepseek")


def test_kimi_tool_call_ids(kimi: Profile) -> None:
    calls = [tool_call("a", "{}", "call_xyz"), tool_call("b", '{"k": 1}', "functions.b:7")]
    section = kimi.render_tool_calls(calls)
    assert "<|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}" in section
    assert "<|tool_call_begin|>functions.b:7<|tool_call_argument_begin|>" in section
    parsed = kimi.parse_tool_calls(section)
    assert [c["function"]["name"] for c in parsed] == ["a", "b"]
    assert [c["id"] for c in parsed] == ["functions.a:0", "functions.b:7"]


# -- the Kimi encode warning -------------------------------------------------------------


def test_kimi_encode_warning_is_silenced_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    # Remote code is imported as transformers_modules.<folder>.tokenization_kimi.
    name = "transformers_modules.Kimi_hyphen_K2_dot_5.tokenization_kimi"
    kimi_logger = logging.getLogger(name)
    silence_kimi_encode_warning(name)
    silence_kimi_encode_warning(name)
    assert sum(isinstance(f, KimiEncodeWarningFilter) for f in kimi_logger.filters) == 1
    with caplog.at_level(logging.INFO):
        kimi_logger.warning(f"Calling super().encode with {({'add_special_tokens': False})}")
        kimi_logger.warning("Token indices sequence length is longer than the specified maximum")
        kimi_logger.info(f"Calling super().encode with {({'x': 1})}")  # not the warning: passes
        logging.getLogger("pipeline.other").warning("Calling super().encode with {} elsewhere")
    messages = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert (name, "WARNING", "Token indices sequence length is longer than the specified maximum") in messages
    assert (name, "INFO", "Calling super().encode with {'x': 1}") in messages
    assert ("pipeline.other", "WARNING", "Calling super().encode with {} elsewhere") in messages
    assert not any(lvl == "WARNING" and n == name and m.startswith("Calling super") for n, lvl, m in messages)


def test_silence_finds_loaded_kimi_modules(kimi: Profile) -> None:
    name = "transformers_modules.other_folder.tokenization_kimi"
    logging.getLogger(name)
    assert name in {lg.name for lg in silence_kimi_encode_warning()}
    # Any object that is not Kimi's tokenizer itself (an engine's wrapper, say): the loaded modules.
    assert name in {lg.name for lg in silence_kimi_encode_warning(kimi.tokenizer)}
    assert not any(isinstance(f, KimiEncodeWarningFilter) for f in logging.getLogger("pipeline.profiles").filters)


# -- a model folder that cannot give its tokenizer or template is refused, never silently replaced ----------


def test_a_loadable_folder_passes_the_check(tmp_path: Path) -> None:
    from pipeline.profiles import check_model_folder

    assert check_model_folder("deepseek", str(_deepseek_folder(tmp_path))) is None
    assert check_model_folder("kimi-k2.5", str(_kimi_folder(tmp_path, KIMI_TEMPLATE))) is None


@pytest.mark.parametrize(("breakage", "expected"), [
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: no such file"),
    (lambda d: (d / "tokenizer.json").write_text('{"model": '), "tokenizer.json: not a readable tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_bytes(b"\xff\xfe"), "tokenizer.json: not a readable tokenizer.json"),
    (lambda d: (d / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json: not valid JSON"),
    (lambda d: (d / "chat_template.jinja").write_bytes(b"{{ bos_token }}\xe9"), "chat_template.jinja: not UTF-8"),
    (lambda d: (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m"),
     "chat template of"),
    (lambda d: (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use",
                                                                                       "template": "x"}]})),
     "none named 'default'"),
    (lambda d: (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7})), "chat_template is a int"),
])
def test_a_deepseek_folder_that_cannot_give_its_tokenizer_or_template_is_refused(tmp_path, breakage, expected):
    """These failed inside a Ray actor after Ray started (or, for the template list, fell back to the built-in
    layout); now the check names the file before anything starts."""
    from pipeline.profiles import check_model_folder

    folder = _deepseek_folder(tmp_path)
    breakage(folder)
    reason = check_model_folder("deepseek", str(folder))
    assert reason is not None and expected in reason and str(folder) in reason, reason


def test_a_qwen3_folder_without_its_tokenizer_never_falls_back_to_the_packaged_one(tmp_path: Path) -> None:
    """Before: a folder without tokenizer.json silently got the packaged Qwen tokenizer and lost its template."""
    from pipeline.profiles import check_model_folder

    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_profile("qwen3", str(tmp_path))
    assert "tokenizer.json: no such file" in (check_model_folder("qwen3", str(tmp_path)) or "")
    # a tokenizer that is not Qwen's lacks the tokens the profile needs: named, not a KeyError in an actor
    shutil.copyfile(deepseek_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    assert "a token it needs is missing (<|im_end|>)" in (check_model_folder("qwen3", str(tmp_path)) or "")


def test_a_kimi_folder_without_its_rank_file_is_refused(tmp_path: Path) -> None:
    from pipeline.profiles import check_model_folder

    folder = _kimi_folder(tmp_path, None)
    (folder / "tiktoken.model").unlink()
    assert "tiktoken.model: no such file" in (check_model_folder("kimi-k2.5", str(folder)) or "")


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_warm_builds_the_plain_encoder_and_changes_no_ids(name: str) -> None:
    """A stage actor warms its profile in its constructor: afterwards nothing is left to build on the first batch,
    and a special-token string asked to stay text still encodes as text."""
    profile = load_profile(name, None)
    profile.warm()
    if hasattr(profile.tokenizer, "_plain"):  # the HF tokenizers build it on first use
        assert profile.tokenizer._plain is not None
    special = next(iter(profile.tokenizer.added_tokens()))
    text = f"12 + 30 = 42 {special} done"
    as_text = profile.encode(text, specials=())
    assert profile.decode(as_text) == text and as_text != profile.encode(text)


def test_the_plain_encoder_shares_the_model_and_encodes_as_one_built_without_added_tokens() -> None:
    """``encode_ordinary`` uses the loaded model with no added tokens (``plain_copy``), not a second parse of
    tokenizer.json: its ids equal those of a tokenizer built from the file with ``added_tokens`` emptied, special
    strings and odd text included."""
    import json
    import random

    from tokenizers import Tokenizer

    from pipeline.profiles.deepseek import deepseek_tokenizer_dir

    path = deepseek_tokenizer_dir() / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    spec["added_tokens"] = []
    oracle = Tokenizer.from_str(json.dumps(spec))
    tok = load_profile("deepseek", None).tokenizer
    rng = random.Random(0)
    pieces = [*tok.added_tokens(), "Hello world", " 12 + 30 = 42", "中文，标点。", "\u00a0\u2028", "  \n\n\t x",
              "é" * 9]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    for text in texts:
        assert tok.encode_ordinary(text) == oracle.encode(text, add_special_tokens=False).ids, text
    assert tok.encode_ordinary("<｜end▁of▁sentence｜>") != [tok.token_to_id("<｜end▁of▁sentence｜>")]
