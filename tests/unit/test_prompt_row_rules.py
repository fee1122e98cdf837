"""What a prompt row may hold and how a file's bytes become rows: a turn without content, tool-call arguments that
are not an object, a .json file read by the JSONL rule, a BOM at a later line's start, a compressed or UTF-16 file,
a reason that quotes a huge value. Each was a prompt generated from nothing, rows the two file kinds judged apart, a
row lost to quarantine, every row of a file quarantined as garbage, or a megabyte in every reason."""

from __future__ import annotations

import bz2
import codecs
import gzip
import json
import lzma
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base.config import DatasetConfig
from pipeline.prompts.datasets import (
    QUOTE_CHARS,
    REASON_CHARS,
    DatasetError,
    RowError,
    check_dataset,
    count_rows,
    iter_dataset,
    parse_row,
)

HI = [{"role": "user", "content": "hi"}]
GOOD = {"messages": HI}


def _read(path: Path, fmt: str = "messages") -> list[tuple[bool, dict]]:
    return list(iter_dataset(DatasetConfig(name="ds", path=str(path), format=fmt), warn=False))


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _call(args: object) -> dict:
    return {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": args}}]},
                         {"role": "tool", "content": "r", "tool_call_id": "c"}]}


# -- rows that were prompts and stay prompts keep their ids (digests taken before these rules) -------------------

KEPT = [
    ("messages", _call('{"a": 1}'), "fa7533a6d594"),  # an assistant's null content beside its tool calls
    ("messages", {"messages": [{"role": "user", "content": "q"},
                               {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f",
                                                                                             "arguments": ""}}]},
                               {"role": "tool", "content": "r", "tool_call_id": "c"}]}, "c6c2844cdfc7"),
    ("messages", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
     "6999af6dd6e3"),  # a trailing assistant turn is dropped, whatever it holds
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": None}]},
     "6999af6dd6e3"),
    ("glaive", {"system": "SYSTEM: hi", "chat": "USER: q ASSISTANT: <functioncall> {\"name\": \"f\", \"arguments\": "
                "'{\"a\": 1}'} <|endoftext|> FUNCTION RESPONSE: {} ASSISTANT: ok"}, "b80c47a0be13"),
    ("messages", {"messages": [{"role": "user", "content": ""}]}, "6cff24734b8b"),  # "" is content; null is none
]


@pytest.mark.parametrize(("fmt", "row", "digest"), KEPT)
def test_rows_that_were_prompts_keep_their_ids(tmp_path, fmt, row, digest):
    for path in (_jsonl(tmp_path / "rows.jsonl", [row]), tmp_path / "rows.json"):
        path.write_text(json.dumps([row]), encoding="utf-8") if path.suffix == ".json" else None
        [(ok, got)] = _read(path, fmt)
        assert ok and got["sample_id"] == f"ds:0:{digest}", (path.name, got)


# -- 1: a turn without content ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "row", "reason"), [
    ("messages", {"messages": [{"role": "user"}]}, "message 0 is a user message without content"),
    ("messages", {"messages": [{"role": "user", "content": None}]}, "message 0 is a user message without content"),
    ("messages", {"messages": [{"role": "system", "content": None}, *HI]},
     "message 0 is a system message without content"),
    ("messages", {"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c"}]},
     "message 2 is a tool message without content"),
    ("messages", {"messages": [*HI, {"role": "assistant", "content": None}, {"role": "user", "content": "and?"}]},
     "message 1 is an assistant message with neither content nor tool_calls"),
    ("messages", {"messages": [*HI, {"role": "assistant", "tool_calls": []}, {"role": "user", "content": "and?"}]},
     "message 1 is an assistant message with neither content nor tool_calls"),
    ("sharegpt", {"conversations": [{"from": "human", "value": None}]}, "turn 0 ('human') has no value"),
    ("sharegpt", {"conversations": [{"from": "system", "value": None}, {"from": "human", "value": "q"}]},
     "turn 0 ('system') has no value"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": None},
                                    {"from": "human", "value": "and?"}]},
     "message 1 is an assistant message with neither content nor tool_calls"),
], ids=["user-no-key", "user-null", "system-null", "tool-null", "assistant-mid-null", "assistant-mid-empty-calls",
        "sharegpt-human-null", "sharegpt-system-null", "sharegpt-gpt-mid-null"])
def test_a_turn_without_content_is_quarantined(tmp_path, fmt, row, reason):
    """A user turn with no content became a prompt with ``content: null``: the engine generated from an empty turn.
    Only an assistant's content may be null, beside its tool calls (OpenAI's format), or at the end (dropped)."""
    with pytest.raises(RowError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_row(row, fmt)
    good = {"messages": GOOD, "sharegpt": {"conversations": [{"from": "human", "value": "hi"}]}}[fmt]
    rows = _read(_jsonl(tmp_path / "rows.jsonl", [good, row, good]), fmt)
    assert [ok for ok, _ in rows] == [True, False, True]
    assert reason in rows[1][1]["reason"]


# -- 2: tool-call arguments that are not an object ----------------------------------------------------------------


@pytest.mark.parametrize(("args", "found"), [("[1]", "a list"), ("5", "a number"), ('"{}"', "a string"),
                                             ("null", "null"), ("true", "a boolean")])
def test_tool_call_arguments_that_are_not_an_object_are_quarantined(tmp_path, args, found):
    """OpenAI's arguments are the JSON of an object; ``"[1]"`` was kept, and a template that reads its keys fails."""
    rows = _read(_jsonl(tmp_path / "rows.jsonl", [GOOD, _call(args), _call('{"a": 1}')]))
    assert [ok for ok, _ in rows] == [True, False, True]
    assert f"message 1 tool call 0 arguments must be a JSON object, got {found}" in rows[1][1]["reason"]


def test_glaive_arguments_that_are_not_an_object_are_quarantined():
    row = {"system": "SYSTEM: hi",
           "chat": "USER: q ASSISTANT: <functioncall> {\"name\": \"f\", \"arguments\": '[1, 2]'} <|endoftext|> "
                   "FUNCTION RESPONSE: {}"}
    with pytest.raises(RowError, match="message 2 tool call 0 arguments must be a JSON object, got a list"):
        parse_row(row, "glaive")


# -- 3: a .json file's rows read by the JSONL rule --------------------------------------------------------------


UNREAD = [
    ('{"messages": [{"role": "user", "content": "x"}], "extra": NaN}', "NaN is not a number JSON allows"),
    ('{"messages": [{"role": "user", "content": "x"}], "extra": [-Infinity]}',
     "-Infinity is not a number JSON allows"),
    ('{"messages": [{"role": "user", "content": "x"}], "extra": {"a": 1e400}}',
     "1e400 is past the range of a number JSON allows"),
    ('{"messages": [{"role": "user", "content": "x"}], "n": ' + "1" * 5000 + "}", "Exceeds the limit (4300 digits)"),
    ('{"messages": [{"role": "user", "content": "x"}], "x": ' + "[" * 250 + "]" * 250 + "}",
     "nested too deeply (more than 200 levels)"),
    ('{"messages": [{"role": "user", "content": "x"}], "x": ' + "[" * 5000 + "]" * 5000 + "}",
     "nested too deeply"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize(("bad", "why"), UNREAD,
                         ids=["nan", "infinity", "1e400", "huge-int", "deep-250", "deep-5000", "deep-100000"])
def test_a_json_list_row_is_read_by_the_jsonl_rule(tmp_path, bad, why):
    """A NaN in a column no format reads quarantined its JSONL line, yet the same row in a .json list was a prompt
    (the list was parsed without the strict checks); a too-long integer or a too-deep row failed the whole .json
    file. Now each such row is quarantined in both, the rows around it keep their ids, and the counts agree."""
    good = json.dumps(GOOD)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(f"{good}\n{bad}\n{good}\n", encoding="utf-8")
    listed = tmp_path / "rows.json"
    listed.write_text(f"[\n  {good},\n  {bad}, {good}\n]\n", encoding="utf-8")
    lines, items = _read(jsonl), _read(listed)
    assert [ok for ok, _ in lines] == [ok for ok, _ in items] == [True, False, True]
    assert [r["sample_id"] for _, r in lines[::2]] == [r["sample_id"] for _, r in items[::2]]
    assert why in lines[1][1]["reason"] and why in items[1][1]["reason"], (lines[1][1]["reason"], items[1][1])
    assert "row is not valid JSON (rows.json line 3): " in items[1][1]["reason"]
    assert items[1][1]["raw"] and items[1][1]["sample_id"].startswith("ds:1:")
    assert [r["sample_id"] for _, r in _read(listed)] == [r["sample_id"] for _, r in items]
    d = DatasetConfig(name="ds", path=str(listed))
    check_dataset(d)
    assert count_rows(d, warn=False) == 3
    assert [r["sample_id"] for _, r in iter_dataset(d, warn=False, rows={1, 2})] == \
        [r["sample_id"] for _, r in items[1:]]


def test_a_json_list_of_many_rows_reads_as_before(tmp_path):
    """The list read row by row: empty lists, whitespace anywhere, rows that are not objects, a trailing BOM-less
    newline; every row where json.loads put it."""
    rows = [GOOD, {"messages": [{"role": "user", "content": "two, ] }"}]}, 7, None, [1], "s"]
    for text in (json.dumps(rows), json.dumps(rows, indent=4), " \r\n\t" + json.dumps(rows, indent="\t") + "\n\n"):
        path = tmp_path / "rows.json"
        path.write_text(text, encoding="utf-8")
        got = _read(path)
        assert [ok for ok, _ in got] == [True, True, False, False, False, False]
        assert json.loads(got[1][1]["messages"])[0]["content"] == "two, ] }"
        assert count_rows(DatasetConfig(name="ds", path=str(path)), warn=False) == 6
    for empty in ("[]", " [ \n ] ", "\n"):
        (tmp_path / "empty.json").write_text(empty, encoding="utf-8")
        assert _read(tmp_path / "empty.json") == []


# -- 4: a UTF-8 BOM at a later line's start ---------------------------------------------------------------------


def test_a_bom_at_a_later_lines_start_is_read_as_the_row(tmp_path):
    """Two files that each began with a BOM, joined with ``cat``: the second one's first row was quarantined as
    "Unexpected UTF-8 BOM"; it reads as it did in its own file (same id). A line of a BOM alone stays the malformed
    row it was, so the rows after it keep their indices (and ids)."""
    bom = codecs.BOM_UTF8
    one = bom + json.dumps(GOOD).encode() + b"\n"
    two = bom + json.dumps({"messages": [{"role": "user", "content": "b"}]}).encode() + b"\r\n"
    joined = tmp_path / "joined.jsonl"
    joined.write_bytes(one + two + bom + b"\n" + two)
    (tmp_path / "two.jsonl").write_bytes(two)
    rows = _read(joined)
    assert [ok for ok, _ in rows] == [True, True, False, True]
    alone = _read(tmp_path / "two.jsonl")[0][1]["sample_id"]
    assert rows[1][1]["sample_id"] == alone.replace("ds:0:", "ds:1:")
    assert rows[3][1]["sample_id"] == alone.replace("ds:0:", "ds:3:")  # what it was before a BOM was dropped
    assert count_rows(DatasetConfig(name="ds", path=str(joined)), warn=False) == 4
    assert [r["sample_id"] for _, r in iter_dataset(DatasetConfig(name="ds", path=str(joined)), warn=False,
                                                    rows={1, 3})] == [rows[1][1]["sample_id"], rows[3][1]["sample_id"]]


def test_a_bom_inside_a_line_is_still_not_json(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + codecs.BOM_UTF8 + json.dumps(GOOD).encode() + b"\n")
    [(ok, row)] = _read(path)
    assert not ok and "line is not valid JSON" in row["reason"]


# -- 5: a compressed or UTF-16 file ------------------------------------------------------------------------------


LINES = ('{"messages": [{"role": "user", "content": "a"}]}\r\n' * 3)
ENCODED = {
    "gzip": (gzip.compress(LINES.encode()), "is gzip-compressed: decompress it"),
    "bzip2": (bz2.compress(LINES.encode()), "is bzip2-compressed: decompress it"),
    "xz": (lzma.compress(LINES.encode()), "is xz-compressed: decompress it"),
    "zstd": (b"\x28\xb5\x2f\xfd" + b"\0" * 12, "is zstd-compressed: decompress it"),
    "utf-16": (LINES.encode("utf-16"), "is UTF-16: save it as UTF-8"),
    "utf-16-be": (codecs.BOM_UTF16_BE + LINES.encode("utf-16-be"), "is UTF-16: save it as UTF-8"),
    "utf-32": (LINES.encode("utf-32"), "is UTF-32: save it as UTF-8"),
    # no BOM (Python's "utf-16-le", .NET's Encoding.Unicode.GetBytes): each line was quarantined as garbage
    "utf-16-le-no-bom": (LINES.encode("utf-16-le"), "is UTF-16 (without a BOM): save it as UTF-8"),
    "utf-16-be-no-bom": (LINES.encode("utf-16-be"), "is UTF-16 (without a BOM): save it as UTF-8"),
}


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "rows.json"])
@pytest.mark.parametrize("kind", sorted(ENCODED))
def test_a_compressed_or_utf16_file_is_refused_naming_its_encoding(tmp_path, kind, name):
    """PowerShell's ``>`` writes UTF-16 and an export may be gzipped: read as JSONL every line was quarantined as
    garbage. The driver's pre-flight check refuses the file, naming what it is, as the readers do."""
    from pipeline.prompts.read import check_prompt_files

    content, why = ENCODED[kind]
    path = tmp_path / name
    path.write_bytes(content)
    d = DatasetConfig(name="ds", path=str(path))
    for call in (check_dataset, lambda d: list(iter_dataset(d, warn=False)), lambda d: count_rows(d, warn=False),
                 lambda d: check_prompt_files(type("Cfg", (), {"datasets": [d]})())):
        with pytest.raises(DatasetError) as err:
            call(d)
        assert str(err.value) == f"{path}: {why}"


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz"])
def test_a_compressed_parquet_file_is_refused_naming_its_compression(tmp_path, kind):
    """``gzip rows.parquet`` (Parquet compresses inside; a transfer tool may wrap it again) was refused as "not a
    valid Parquet file: Parquet magic bytes not found in footer": now named, as a compressed JSONL file is."""
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"messages": [json.dumps(GOOD["messages"])]}), buf)
    raw = buf.getvalue().to_pybytes()
    packed = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}[kind](raw)
    path = tmp_path / "rows.parquet"
    path.write_bytes(packed)
    with pytest.raises(DatasetError) as err:
        check_dataset(DatasetConfig(name="ds", path=str(path)))
    assert str(err.value) == f"{path}: is {kind}-compressed: decompress it"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="not a valid Parquet file"):
        check_dataset(DatasetConfig(name="ds", path=str(path)))


def test_a_jsonl_file_that_only_looks_odd_is_still_read(tmp_path):
    """Heads near the magic ones that are text: ``BZh`` as a row's first bytes is no bzip2 stream."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"BZh9 not json\n" + json.dumps(GOOD).encode() + b"\n")
    check_dataset(DatasetConfig(name="ds", path=str(path)))
    assert [ok for ok, _ in _read(path)] == [False, True]


# -- 6: a reason quotes at most QUOTE_CHARS of a value ------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "row", "start"), [
    ("messages", {"messages": [{"role": "x" * 1_000_000, "content": "a"}]}, "message 0 has unknown role 'xxx"),
    ("sharegpt", {"conversations": [{"from": "y" * 1_000_000, "value": "a"}]}, "turn 0 has unknown speaker 'yyy"),
    ("messages", {"messages": [{"role": "user", "content": "\ud800" * 100_000}]}, "message 0 holds a lone surrogate"),
])
def test_a_reason_quotes_a_huge_value_cut(tmp_path, fmt, row, start):
    """A megabyte speaker name was repeated in full in the reason (``raw`` keeps the row, cut at 4,000 chars)."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n", encoding="utf-8")
    [(ok, q)] = _read(path, fmt)
    assert not ok and start in q["reason"], q["reason"][:300]
    assert len(q["reason"]) < QUOTE_CHARS + 100 and "…" in q["reason"]
    assert len(q["raw"]) == 4000


def test_a_reason_is_cut_whatever_made_it(tmp_path, monkeypatch):
    """A reason from an error no check foresaw (its message quoting anything) is cut too."""
    import pipeline.prompts.datasets as datasets

    def boom(row, fmt, columns=None):
        raise KeyError("k" * 100_000)

    monkeypatch.setattr(datasets, "parse_row", boom)
    [(ok, q)] = _read(_jsonl(tmp_path / "rows.jsonl", [GOOD]))
    assert not ok and q["reason"].startswith("malformed row: KeyError: 'kkk")
    assert len(q["reason"]) == REASON_CHARS + 1 and q["reason"].endswith("…")


# -- an id index written under the earlier rules ------------------------------------------------------------------


def test_an_id_index_written_before_these_rules_is_not_trusted(tmp_path):
    """A resume trusted the file's id index (``id_index``) of an unchanged file: a row that was a prompt then and
    quarantines now was counted as to do, skipped by the read (it no longer parses) and never quarantined."""
    import pyarrow as pa

    from pipeline.base.layout import RunLayout
    from pipeline.prompts import id_index
    from pipeline.prompts.read import index_dataset, todo_rows

    path = _jsonl(tmp_path / "rows.jsonl", [GOOD, {"messages": [{"role": "user"}]}])
    d = DatasetConfig(name="ds", path=str(path))
    layout = RunLayout(tmp_path / "out")
    good_id = _read(path)[0][1]["sample_id"]
    old = pa.table({"sample_id": [good_id, "ds:1:0123456789ab"], "ok": [True, True]}, schema=id_index.SCHEMA)
    id_index.write_index(layout.prompt_index("ds"), {**id_index.index_key(d), "v": 1}, old)  # what v1 wrote
    counts = index_dataset(d, layout, set(), {})
    assert counts["ds.rows"] == 2 and counts["to_do"] == 1
    assert len(list(layout.quarantine.glob("*.parquet"))) == 1
    assert [r["sample_id"] for r in todo_rows(d, set(), None, layout.prompt_index("ds"))] == [good_id]
