"""Prompt-file parsing: the four row shapes, column mapping, ids, Parquet, quarantine, shipped prompts."""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base.config import DatasetConfig
from pipeline.prompts.datasets import (
    DatasetError,
    Prompt,
    RowError,
    iter_dataset,
    load_dataset,
    parse_row,
    sample_id,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "data" / "prompts"
FIXTURES = ROOT / "tests" / "data"

WEATHER_FN = {
    "name": "get_weather",
    "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_TOOL = {"type": "function", "function": WEATHER_FN}
OSLO_ARGS = json.dumps({"city": "Oslo"})


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _load(path: Path, fmt: str, name: str = "ds", **kw):
    return load_dataset(DatasetConfig(name=name, path=str(path), format=fmt, **kw))


# -- the four shapes ----------------------------------------------------------


def test_messages_shape_canonical():
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Oslo?"}]},
            {"role": "assistant", "content": "Regenerated, so dropped."},
        ],
        "tools": [WEATHER_TOOL],
        "extra": "ignored",
    }
    p = parse_row(row, "messages")
    assert p.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    assert p.tools == [WEATHER_TOOL]


def test_messages_tool_result_and_bare_tool_definitions():
    row = {
        "messages": json.dumps([
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 3}"},
        ]),
        "tools": json.dumps([WEATHER_FN]),  # bare function definitions, as JSON text
    }
    p = parse_row(row, "messages")
    assert p.messages == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": OSLO_ARGS}}]},
        {"role": "tool", "content": "{\"temp\": 3}", "tool_call_id": "c1"},
    ]
    assert p.tools == [WEATHER_TOOL]


@pytest.mark.parametrize("tools", [None, [], ""])
def test_messages_without_tools(tools):
    assert parse_row({"messages": [{"role": "user", "content": "x"}], "tools": tools}, "messages").tools is None


def test_sharegpt_shape_canonical():
    row = {
        "system": "You are a code reviewer.",
        "conversations": [
            {"from": "human", "value": "Review: def f(): pass"},
            {"from": "gpt", "value": "Looks empty."},
            {"from": "human", "value": "Anything else?"},
            {"from": "gpt", "value": "Dropped."},
        ],
        "tools": json.dumps([WEATHER_TOOL]),
    }
    p = parse_row(row, "sharegpt")
    assert p.messages == [
        {"role": "system", "content": "You are a code reviewer."},
        {"role": "user", "content": "Review: def f(): pass"},
        {"role": "assistant", "content": "Looks empty."},
        {"role": "user", "content": "Anything else?"},
    ]
    assert p.tools == [WEATHER_TOOL]


def test_sharegpt_observation_turn_is_a_tool_message():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "observation", "value": "r"}]}
    assert parse_row(row, "sharegpt").messages == [
        {"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]


def test_instruction_shape_canonical():
    p = parse_row({"instruction": "Solve for x.", "input": "2x = 6", "output": "x = 3", "system": "Show steps."},
                  "instruction")
    assert p == Prompt(
        messages=[{"role": "system", "content": "Show steps."}, {"role": "user", "content": "Solve for x.\n\n2x = 6"}],
        tools=None,
    )
    # An empty input adds nothing; the reference output never enters the prompt.
    p = parse_row({"instruction": "Name a prime.", "input": "  ", "output": "7"}, "instruction")
    assert p.messages == [{"role": "user", "content": "Name a prime."}]


GLAIVE_SYSTEM = (
    "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n"
    + json.dumps(WEATHER_FN, indent=4) + "\n"
)


def test_glaive_shape_canonical():
    row = {
        "system": GLAIVE_SYSTEM,
        "chat": "USER: Weather in Oslo?\n\n\n"
                "ASSISTANT: <functioncall> {\"name\": \"get_weather\", \"arguments\": '{\"city\": \"Oslo\"}'} "
                "<|endoftext|>\n\n\n"
                "FUNCTION RESPONSE: {\"temp\": 3}\n\n\n"
                "ASSISTANT: It is 3 degrees. <|endoftext|>\n\n\n",
    }
    p = parse_row(row, "glaive")
    assert p.messages == [
        {"role": "system", "content": "You are a helpful assistant with access to the following functions. "
                                      "Use them if required"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": OSLO_ARGS}}]},
        {"role": "tool", "content": "{\"temp\": 3}", "tool_call_id": "call_0"},
    ]
    assert p.tools == [WEATHER_TOOL]


def test_glaive_plain_chat_and_object_arguments():
    row = {"system": "SYSTEM: You are a helpful assistant, with no access to external functions.",
           "chat": "USER: Hi ASSISTANT: Hello! <|endoftext|> USER: Tell me a joke."}
    p = parse_row(row, "glaive")
    assert p.messages == [
        {"role": "system", "content": "You are a helpful assistant, with no access to external functions."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke."},
    ]
    assert p.tools is None
    row = {"system": GLAIVE_SYSTEM,
           "chat": "USER: Oslo? ASSISTANT: <functioncall> "
                   "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}} "
                   "<|endoftext|> FUNCTION RESPONSE: {}"}
    call = parse_row(row, "glaive").messages[2]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": OSLO_ARGS}


# -- column mapping -----------------------------------------------------------


def test_column_remapping_from_config(tmp_path):
    msgs = _write_jsonl(tmp_path / "m.jsonl", [
        {"dialog": [{"role": "user", "content": "hi"}], "functions": [WEATHER_FN]}])
    prompts, bad = _load(msgs, "messages", columns={"messages": "dialog", "tools": "functions"})
    assert bad == []
    assert json.loads(prompts[0]["messages"]) == [{"role": "user", "content": "hi"}]
    assert json.loads(prompts[0]["tools"]) == [WEATHER_TOOL]

    share = _write_jsonl(tmp_path / "s.jsonl", [
        {"turns": [{"from": "human", "value": "q"}], "preamble": "sys"}])
    prompts, bad = _load(share, "sharegpt", columns={"conversations": "turns", "system": "preamble"})
    assert bad == []
    assert json.loads(prompts[0]["messages"]) == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]

    inst = _write_jsonl(tmp_path / "i.jsonl", [{"question": "Add.", "context": "2 + 2", "input": "unused"}])
    prompts, bad = _load(inst, "instruction", columns={"instruction": "question", "input": "context"})
    assert bad == []
    assert json.loads(prompts[0]["messages"]) == [{"role": "user", "content": "Add.\n\n2 + 2"}]

    glaive = _write_jsonl(tmp_path / "g.jsonl", [{"sys": "SYSTEM: Be kind.", "text": "USER: hello"}])
    prompts, bad = _load(glaive, "glaive", columns={"system": "sys", "chat": "text"})
    assert bad == []
    assert json.loads(prompts[0]["messages"]) == [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "hello"}]


def test_remapped_column_missing_is_named(tmp_path):
    path = _write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    prompts, bad = _load(path, "messages", columns={"messages": "dialog"})
    assert prompts == []
    assert "missing column 'dialog'" in bad[0]["reason"]


# -- sample ids ---------------------------------------------------------------


def test_sample_ids_stable_and_content_addressed(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "alpha"}]},
        {"messages": [{"role": "user", "content": "beta"}]},
        {"messages": [{"role": "user", "content": "alpha"}]},
    ]
    path = _write_jsonl(tmp_path / "a.jsonl", rows)
    first = [r["sample_id"] for r in _load(path, "messages", name="set")[0]]
    second = [r["sample_id"] for r in _load(path, "messages", name="set")[0]]
    assert first == second
    assert len(set(first)) == 3
    for i, sid in enumerate(first):
        name, index, digest = sid.split(":")
        assert (name, index, len(digest)) == ("set", str(i), 12)
    digests = [sid.rsplit(":", 1)[1] for sid in first]
    assert digests[0] == digests[2] != digests[1]  # same content, same hash; the row index tells them apart

    # Changing a row's content changes its id; other rows keep theirs.
    rows[1]["messages"][0]["content"] = "gamma"
    changed = [r["sample_id"] for r in _load(_write_jsonl(path, rows), "messages", name="set")[0]]
    assert changed[0] == first[0] and changed[2] == first[2] and changed[1] != first[1]

    # Another dataset name gives other ids.
    assert [r["sample_id"] for r in _load(path, "messages", name="other")[0]][0] != changed[0]


def test_sample_id_depends_on_tools():
    msgs = [{"role": "user", "content": "x"}]
    assert sample_id("d", 0, Prompt(msgs, None)) != sample_id("d", 0, Prompt(msgs, [WEATHER_TOOL]))
    assert sample_id("d", 0, Prompt(msgs, None)) == sample_id("d", 0, Prompt(list(msgs), None))


# -- file kinds ---------------------------------------------------------------


def test_parquet_input(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "from parquet"}], "tools": json.dumps([WEATHER_TOOL])},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "two"},
                      {"role": "assistant", "content": "dropped"}], "tools": None},
        {"messages": [], "tools": None},
    ]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    prompts, bad = _load(path, "messages", name="pq")
    assert [json.loads(p["messages"]) for p in prompts] == [
        [{"role": "user", "content": "from parquet"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "two"}],
    ]
    assert json.loads(prompts[0]["tools"]) == [WEATHER_TOOL] and prompts[1]["tools"] == ""
    assert [p["row_index"] for p in prompts] == [0, 1]
    assert len(bad) == 1 and bad[0]["row_index"] == 2 and "non-empty list" in bad[0]["reason"]

    # Same content read from JSONL gets the same ids.
    jl = _write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "from parquet"}],
                                             "tools": [WEATHER_TOOL]}])
    assert _load(jl, "messages", name="pq")[0][0]["sample_id"] == prompts[0]["sample_id"]


def test_parquet_instruction_with_null_input(tmp_path):
    path = tmp_path / "i.parquet"
    pq.write_table(pa.Table.from_pylist([{"instruction": "Add 2 and 3.", "input": None, "output": "5"}]), path)
    prompts, bad = _load(path, "instruction")
    assert bad == [] and json.loads(prompts[0]["messages"]) == [{"role": "user", "content": "Add 2 and 3."}]


def test_json_list_input(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"instruction": "One."}, {"instruction": ""}]))
    prompts, bad = _load(path, "instruction")
    assert len(prompts) == 1 and len(bad) == 1 and "instruction is empty" in bad[0]["reason"]


def test_max_rows_and_thinking_flag(tmp_path):
    path = _write_jsonl(tmp_path / "a.jsonl", [{"instruction": f"q{i}"} for i in range(5)])
    prompts, bad = _load(path, "instruction", max_rows=3, thinking=False)
    assert [p["row_index"] for p in prompts] == [0, 1, 2] and bad == []
    assert all(p["thinking"] is False for p in prompts)


# -- bad files ----------------------------------------------------------------


def test_invalid_utf8_line_is_quarantined_with_file_and_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"instruction": "ok"}).encode()
    path.write_bytes(good + b"\n\n" + b'{"instruction": "caf\xe9 \xff"}\n' + good + b"\n")
    prompts, bad = _load(path, "instruction", name="u8")
    assert [p["row_index"] for p in prompts] == [0, 2]  # the blank line is no row; the bad line keeps its index
    assert len(bad) == 1 and bad[0]["row_index"] == 1 and bad[0]["stage"] == "read"
    assert "not valid UTF-8 (mixed.jsonl line 3)" in bad[0]["reason"]  # line 3 of the file, counting blanks
    assert "\\xe9" in bad[0]["raw"] and "caf" in bad[0]["raw"]  # the bad bytes stay visible
    assert bad[0]["sample_id"].startswith("u8:1:")


def test_utf8_bom_is_not_a_bad_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"instruction": "ok"}).encode() + b"\n")
    assert _load(path, "instruction") == _load(_write_jsonl(tmp_path / "plain.jsonl", [{"instruction": "ok"}]),
                                               "instruction")
    bom_json = tmp_path / "bom.json"
    bom_json.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"instruction": "ok"}]).encode())
    assert len(_load(bom_json, "instruction")[0]) == 1


def test_bad_json_line_reason_names_file_and_line(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_text(json.dumps({"instruction": "ok"}) + "\n" + '{"instruction": "cut' + "\n", encoding="utf-8")
    bad = _load(path, "instruction")[1]
    assert len(bad) == 1 and "line is not valid JSON (lines.jsonl line 2)" in bad[0]["reason"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'[{"instruction": "a"},\n {oops}]', "not valid JSON: Expecting property name enclosed in double quotes "
                                              "(line 2, column 3)"),
        (b'{"instruction": "a"}\n{"instruction": "b"}\n', "(line 2, column 1; one JSON value per line? "
                                                          "name the file .jsonl)"),
        (b'{"rows": []}', "a .json dataset must hold a list of rows, found an object"),
        (b'"just text"', "a .json dataset must hold a list of rows, found a string"),
        (b'[{"instruction": "a"},\n {"instruction": "\xff"}]', "not valid UTF-8 at line 2"),
        # a row with a too-long integer or nested too deeply is that row's fault (test_prompt_file_edges.py); a file
        # that does not close is the file's
        (b"[" * 100_000, "not valid JSON: Unterminated array or object (line 1, column 2)"),
        (b'[{"instruction": "a"},]', "not valid JSON: Expecting value (line 1, column 23)"),
        (b'[{"instruction": "a"} {"instruction": "b"}]', "not valid JSON: Expecting ',' delimiter (line 1, column 23)"),
        (b'[{"instruction": "a"}] []', "not valid JSON: Extra data (line 1, column 24; one JSON value per line?"),
        (b'[{"instruction": NaN},\n {oops}]', "not valid JSON: Expecting property name enclosed in double quotes "
                                            "(line 2, column 3)"),
    ],
    ids=["syntax", "jsonl-in-json", "object", "string", "utf8", "unterminated-deep", "trailing-comma", "no-comma",
         "extra-list", "syntax-after-a-refused-row"],
)
def test_bad_json_file_is_a_clear_error(tmp_path, content, expected):
    path = tmp_path / "rows.json"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as err:
        _load(path, "instruction")
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.parquet"])
def test_folder_or_missing_path_is_a_clear_error(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    with pytest.raises(DatasetError, match="is a folder, expected a .jsonl, .json or .parquet file"):
        _load(folder, "messages")
    with pytest.raises(DatasetError, match="file not found"):
        _load(tmp_path / f"missing-{name}", "messages")


@pytest.mark.parametrize("content", [b"not parquet at all", b"", b"PAR1" + b"\0" * 64 + b"PAR1"],
                         ids=["text", "zero-bytes", "bad-metadata"])
def test_invalid_parquet_is_a_clear_error(tmp_path, content):
    path = tmp_path / "rows.parquet"
    path.write_bytes(content)
    with pytest.raises(DatasetError) as err:
        _load(path, "messages")
    assert str(err.value).startswith(f"{path}: not a valid Parquet file: ")
    assert "<Buffer>" not in str(err.value)


def _empty_parquet(path: Path) -> None:
    pq.write_table(pa.table({"messages": pa.array([], pa.string())}), path)


@pytest.mark.parametrize(
    ("name", "write"),
    [
        ("empty.jsonl", lambda p: p.write_bytes(b"")),
        ("blank.jsonl", lambda p: p.write_text("\n  \n\n")),
        ("empty.json", lambda p: p.write_text("[]")),
        ("blank.json", lambda p: p.write_bytes(b"")),
        ("empty.parquet", _empty_parquet),
    ],
)
def test_empty_file_loads_with_a_warning(tmp_path, caplog, name, write):
    path = tmp_path / name
    write(path)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert _load(path, "messages", name="hollow") == ([], [])
    [rec] = [r for r in caplog.records if r.name.startswith("pipeline")]
    assert rec.levelno == logging.WARNING
    assert "'hollow'" in rec.getMessage() and str(path) in rec.getMessage() and "no rows" in rec.getMessage()


def test_no_empty_warning_for_rows_all_quarantined(tmp_path, caplog):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"instruction": ""}])
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        prompts, bad = _load(path, "instruction")
    assert prompts == [] and len(bad) == 1 and caplog.records == []


# -- malformed rows -----------------------------------------------------------

FIXTURE_REASONS = {  # row index in tests/data/malformed_messages.jsonl -> what the reason must name
    1: "line is not valid JSON",
    2: "missing column 'messages'",
    3: "unknown role 'robot'",
    4: "non-empty list",
    5: "no user message",
    6: "tools must be a list",
    7: "row is a list, not an object",
}


def test_malformed_rows_are_quarantined_never_dropped():
    path = FIXTURES / "malformed_messages.jsonl"
    n_rows = sum(1 for line in path.read_text().splitlines() if line.strip())
    prompts, bad = _load(path, "messages", name="mal")
    assert len(prompts) + len(bad) == n_rows == 9
    assert [p["row_index"] for p in prompts] == [0, 8]
    assert json.loads(prompts[1]["messages"]) == [{"role": "user", "content": "Good row two."}]
    assert {b["row_index"]: b for b in bad}.keys() == FIXTURE_REASONS.keys()
    for b in bad:
        assert FIXTURE_REASONS[b["row_index"]] in b["reason"], b
        assert b["reason"].startswith("malformed row: ")
        assert b["dataset"] == "mal" and b["stage"] == "read" and b["raw"]
        assert b["sample_id"].startswith(f"mal:{b['row_index']}:")
    assert len({b["sample_id"] for b in bad}) == len(bad)
    by_index = {b["row_index"]: b for b in bad}
    assert "broken line" in by_index[1]["raw"] and "robot" in by_index[3]["raw"]
    assert "(malformed_messages.jsonl line 2)" in by_index[1]["reason"]


@pytest.mark.parametrize(
    ("fmt", "row", "reason"),
    [
        ("messages", {"messages": "[not json"}, "messages is a string but not valid JSON"),
        ("messages", {"messages": [{"role": "user", "content": 5}]}, "message 0 content must be text"),
        ("messages", {"messages": ["hi"]}, "message 0 is not an object"),
        ("messages", {"messages": [{"content": "no role"}]}, "unknown role None"),
        ("messages", {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
         "ends with a system message"),
        ("messages", {"messages": [{"role": "user", "content": "q"}], "tools": [{"description": "no name"}]},
         "each tool needs a function name"),
        ("messages", {"messages": [{"role": "user", "content": "q"}], "tools": ["get_weather"]},
         "each tool must be an object"),
        ("messages", {"messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": None, "tool_calls": {"name": "f"}},
                                   {"role": "tool", "content": "r"}]},
         "message 1 tool_calls must be a list"),
        ("messages", {"messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": None,
                                    "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
                                   {"role": "tool", "content": "r"}]},
         "message 1 tool call 0 arguments are not valid JSON"),
        ("messages", {"messages": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]},
                                   {"role": "tool", "content": "r"}]},
         "message 1 tool call 0 needs a function name"),
        ("sharegpt", {"conversations": []}, "non-empty list"),
        ("sharegpt", {"conversations": {"from": "human", "value": "q"}}, "conversations must be a list"),
        ("sharegpt", {"conversations": [{"from": "alien", "value": "q"}]}, "unknown speaker 'alien'"),
        ("sharegpt", {"conversations": [{"from": "human"}]}, "turn 0 needs 'from' and 'value'"),
        ("sharegpt", {"conversations": [{"from": "gpt", "value": "only the assistant"}]}, "no user message"),
        ("sharegpt", {"turns": []}, "missing column 'conversations'"),
        ("sharegpt", {"conversations": [{"from": "human", "value": "q"}], "tools": 3}, "tools must be a list"),
        ("instruction", {"input": "orphan input"}, "missing column 'instruction'"),
        ("instruction", {"instruction": "   "}, "instruction is empty"),
        ("glaive", {"system": "SYSTEM: hi", "chat": "no speakers here"}, "no USER:/ASSISTANT: turns"),
        ("glaive", {"system": "SYSTEM: hi", "chat": ""}, "no USER:/ASSISTANT: turns"),
        ("glaive", {"chat": "USER: hi"}, "missing column 'system'"),
        ("glaive", {"system": "SYSTEM: hi", "chat": ["USER: hi"]}, "system and chat must be text"),
        ("glaive", {"system": "SYSTEM: hi", "chat": "ASSISTANT: talking to myself"}, "no user message"),
        ("glaive", {"system": "SYSTEM: hi", "chat": "USER: q ASSISTANT: <functioncall> oops FUNCTION RESPONSE: r"},
         "holds no call JSON"),
        ("glaive", "USER: a bare string", "row is a str, not an object"),
        ("instruction", None, "row is a NoneType, not an object"),
    ],
)
def test_malformed_row_reasons(tmp_path, fmt, row, reason):
    with pytest.raises(RowError) as err:
        parse_row(row, fmt)
    assert reason in str(err.value)
    # Through the loader the row is quarantined with the same reason, beside a good row.
    good = {
        "messages": {"messages": [{"role": "user", "content": "ok"}]},
        "sharegpt": {"conversations": [{"from": "human", "value": "ok"}]},
        "instruction": {"instruction": "ok"},
        "glaive": {"system": "SYSTEM: ok", "chat": "USER: ok"},
    }[fmt]
    path = _write_jsonl(tmp_path / "rows.jsonl", [good, row, good])
    prompts, bad = _load(path, fmt)
    assert [p["row_index"] for p in prompts] == [0, 2]
    assert len(bad) == 1 and bad[0]["row_index"] == 1 and reason in bad[0]["reason"]


GOOD = {"messages": [{"role": "user", "content": "ok"}]}
GOOD_DIGEST = "9e97a6d2a2d2"  # GOOD's id hash before parsing was made total: a well-formed row keeps its id


def _around_good(path: Path, bad: str | dict) -> Path:
    """``bad`` between two GOOD rows: a raw JSONL line, or a Parquet row (its types, not JSON's)."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist([GOOD, bad, GOOD], schema=pa.Table.from_pylist([bad]).schema), path)
    else:
        path.write_text(f"{json.dumps(GOOD)}\n{bad}\n{json.dumps(GOOD)}\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("name", "bad", "reason"),
    [
        ("rows.jsonl", '{"messages": [{"role": ["user"], "content": "hi"}]}',
         "message 0 role must be a string, got list"),
        ("rows.jsonl", '{"messages": [{"role": {"a": 1}, "content": "hi"}]}',
         "message 0 role must be a string, got dict"),
        ("rows.jsonl", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
         "message 0 content part 0 text must be a string, got int"),
        ("rows.jsonl", '{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
         "message 0 content part 0 text must be a string, got NoneType"),
        ("rows.jsonl", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
         "message 0 holds a lone surrogate ('\\ud800'), not valid Unicode"),
        ("rows.jsonl", '{"messages": [{"role": "bogus", "content": "\\ud800"}]}', "message 0 has unknown role 'bogus'"),
        ("rows.jsonl", '{"messages": [{"role": "user", "content": "hi"}], "n": ' + "1" * 5000 + "}",
         "line is not valid JSON (rows.jsonl line 2): Exceeds the limit (4300 digits)"),
        ("rows.jsonl", "[" * 100_000 + "]" * 100_000, "line is not valid JSON (rows.jsonl line 2): nested too deeply"),
        ("rows.jsonl", json.dumps({"messages": "[" * 100_000}), "messages is a string but not valid JSON: nested too"),
        ("rows.parquet", {"messages": [{"role": "user", "content": "hi", "name": b"x"}]},
         "message 0 name must be a string, got bytes"),
        ("rows.parquet", {"messages": [{"role": "user", "content": "hi"}],
                          "tools": [{"function": {"name": "f", "since": datetime.date(2020, 1, 1)}}]},
         "tool 0 cannot be written as JSON: Object of type date is not JSON serializable"),
    ],
    ids=["role-list", "role-dict", "text-int", "text-null", "lone-surrogate", "surrogate-in-bad-row", "huge-number",
         "deep-line", "deep-messages-text", "parquet-name-bytes", "parquet-tool-date"],
)
def test_rows_that_crashed_the_parser_are_quarantined(tmp_path, name, bad, reason):
    """Rows whose errors once escaped the parser (TypeError, UnicodeEncodeError, ValueError, RecursionError) and
    ended the run: each is one quarantine row with a reason, and the rows around it keep their ids."""
    path = _around_good(tmp_path / name, bad)
    rows = list(iter_dataset(DatasetConfig(name="ds", path=str(path)), warn=False))
    assert [(ok, r["row_index"]) for ok, r in rows] == [(True, 0), (False, 1), (True, 2)]
    assert [rows[0][1]["sample_id"], rows[2][1]["sample_id"]] == [f"ds:0:{GOOD_DIGEST}", f"ds:2:{GOOD_DIGEST}"]
    q = rows[1][1]
    assert q["reason"].startswith("malformed row: ") and reason in q["reason"], q["reason"]
    assert q["stage"] == "read" and q["sample_id"].startswith("ds:1:") and q["raw"]
    q["reason"].encode(), q["raw"].encode()  # a quarantine shard is UTF-8: no lone surrogate is left in it
    assert [r["sample_id"] for _, r in iter_dataset(DatasetConfig(name="ds", path=str(path)), warn=False)] == \
        [r["sample_id"] for _, r in rows]  # the same row gets the same id on every read


# -- the shipped prompt set ---------------------------------------------------

SHIPPED = {  # file -> (format, rows)
    "chat.jsonl": ("messages", 20),
    "code.jsonl": ("sharegpt", 14),
    "math.jsonl": ("instruction", 14),
    "tools.jsonl": ("messages", 16),
    "tools_glaive.jsonl": ("glaive", 4),
}


def _shipped(name: str) -> list[dict]:
    fmt, _ = SHIPPED[name]
    prompts, bad = _load(PROMPTS / name, fmt, name=name.removesuffix(".jsonl"))
    assert bad == [], [b["reason"] for b in bad]
    return [{**p, "messages": json.loads(p["messages"]), "tools": json.loads(p["tools"] or "null")} for p in prompts]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_prompt_files_load_cleanly(name):
    rows = _shipped(name)
    assert len(rows) == SHIPPED[name][1]
    assert len({r["sample_id"] for r in rows}) == len(rows)
    assert len({json.dumps(r["messages"]) for r in rows}) == len(rows)  # no duplicate prompts
    for r in rows:
        assert r["messages"][-1]["role"] in ("user", "tool")
        assert all(m["content"] is None or m["content"].strip() for m in r["messages"])


def test_shipped_prompt_mix():
    assert sum(n for fmt, n in SHIPPED.values() if fmt != "glaive") == 64

    chat = _shipped("chat.jsonl")
    assert sum(any(m["role"] == "assistant" for m in r["messages"]) for r in chat) == 6
    assert sum(r["messages"][0]["role"] == "system" for r in chat) >= 3
    assert all(r["tools"] is None for r in chat)

    code = _shipped("code.jsonl")
    assert sum(any(m["role"] == "assistant" for m in r["messages"]) for r in code) >= 2

    math = _shipped("math.jsonl")
    assert all(r["messages"][-1]["role"] == "user" and r["tools"] is None for r in math)
    raw_math = [json.loads(line) for line in (PROMPTS / "math.jsonl").read_text().splitlines()]
    assert all(isinstance(r["output"], str) and r["output"].strip() for r in raw_math)

    tools = _shipped("tools.jsonl")
    assert all(r["tools"] for r in tools)
    assert sum(len(r["tools"]) >= 2 for r in tools) >= 4
    ends_with_result = [r for r in tools if r["messages"][-1]["role"] == "tool"]
    assert len(ends_with_result) >= 4
    for r in ends_with_result:  # every result answers a call made in the assistant turn before it
        names = {t["function"]["name"] for t in r["tools"]}
        call_turns = [m for m in r["messages"] if m.get("tool_calls")]
        ids = {c["id"] for m in call_turns for c in m["tool_calls"]}
        assert {c["function"]["name"] for m in call_turns for c in m["tool_calls"]} <= names
        assert {m["tool_call_id"] for m in r["messages"] if m["role"] == "tool"} <= ids
        for m in call_turns:
            for c in m["tool_calls"]:
                assert isinstance(json.loads(c["function"]["arguments"]), dict)

    glaive = _shipped("tools_glaive.jsonl")
    assert sum(r["tools"] is not None for r in glaive) == 3
    assert sum(r["messages"][-1]["role"] == "tool" for r in glaive) == 2
