"""Prompt files at their edges: Parquet values Python cannot hold, suffixes in upper case, lines longer than a
read chunk, nesting near the recursion limit. Each was once a failed run, garbage rows or ids that moved."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base.config import DatasetConfig
from pipeline.base.layout import RunLayout
from pipeline.prompts.datasets import _CHUNK, _split_lines, check_dataset, count_rows, iter_dataset
from pipeline.prompts.id_index import Collector
from pipeline.prompts.read import index_dataset

HI = [{"role": "user", "content": "hi"}]


def _read(path: Path, **kw) -> list[tuple[bool, dict]]:
    return list(iter_dataset(DatasetConfig(name="ds", path=str(path), **kw), warn=False))


def test_a_parquet_value_python_cannot_hold_is_its_rows_fault_not_the_files(tmp_path):
    """A timestamp past year 9999 (``to_pylist`` raises OverflowError) in a column no format reads ended the read of
    the whole file; now its rows read, and in a column the format reads it quarantines just its row, named."""
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({
        "messages": [json.dumps(HI)] * 3,
        "created": pa.array([0, 10**12, 0], pa.timestamp("s")),  # row 1: year ~33658
    }), path)
    rows = _read(path)
    assert [ok for ok, _ in rows] == [True, True, True]
    assert len({r["sample_id"].split(":", 2)[2] for _, r in rows}) == 1  # the column plays no part in the id
    assert [r for _, r in _read(path)] == [r for _, r in rows]
    assert [i for i, _ in enumerate(_read(path))] == [0, 1, 2]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(HI)] * 2,
                             "chat": pa.array([0, 10**12], pa.timestamp("s"))}), bad)
    rows = _read(bad, columns={"messages": "chat"})
    assert [ok for ok, _ in rows] == [False, False]
    assert "missing column" not in rows[1][1]["reason"]
    assert "column 'chat' holds a timestamp[ms] value that cannot be read: date value out of range" in \
        rows[1][1]["reason"]
    assert [r["sample_id"] for _, r in _read(bad, columns={"messages": "chat"})] == [r["sample_id"] for _, r in rows]


def test_a_resumed_parquet_read_of_some_rows_gives_their_ids(tmp_path):
    """The resumed read (``rows``) converts only the rows it wants, with the same fallback."""
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(HI)] * 4,
                             "created": pa.array([0, 10**12, 0, 10**12], pa.timestamp("s"))}), path)
    cfg = DatasetConfig(name="ds", path=str(path))
    every = [r["sample_id"] for _, r in iter_dataset(cfg, warn=False)]
    assert [r["sample_id"] for _, r in iter_dataset(cfg, warn=False, rows={1, 3})] == [every[1], every[3]]


@pytest.mark.parametrize("name", ["ROWS.PARQUET", "rows.Parquet", "ROWS.JSON", "rows.JSONL"])
def test_a_suffix_in_upper_case_is_read_as_its_kind(tmp_path, name):
    """``DATA.PARQUET`` was read as JSONL (every line quarantined as not UTF-8), a ``.JSON`` list one line a row."""
    path = tmp_path / name
    rows = [{"messages": HI}, {"messages": [{"role": "user", "content": "two"}]}]
    if name.lower().endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist([{"messages": json.dumps(r["messages"])} for r in rows]), path)
    elif name.lower().endswith(".json"):
        path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = DatasetConfig(name="ds", path=str(path))
    check_dataset(cfg)
    assert [ok for ok, _ in iter_dataset(cfg, warn=False)] == [True, True]
    assert count_rows(cfg, warn=False) == 2


def test_a_line_many_chunks_long_is_split_in_linear_time():
    """Each chunk of a long line was joined to all before it: a 64 MiB line took seconds, quadratic in its length
    (a 1 GiB minified JSON array named .jsonl, many minutes on the driver's row count)."""
    line = b"x" * (64 * _CHUNK)
    chunks = [b"a\r"] + [line[i:i + _CHUNK] for i in range(0, len(line), _CHUNK)] + [b"\r\nb\n", b"c"]
    t0 = time.perf_counter()
    got = list(_split_lines(iter(chunks)))
    took = time.perf_counter() - t0
    assert got == b"".join(chunks).splitlines()
    assert took < 1.0, f"{took:.2f}s for a 64 MiB line"


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _at_stack_depth(frames: int, fn):
    return fn() if frames == 0 else _at_stack_depth(frames - 1, fn)


@pytest.mark.parametrize("where", ["extra-column", "tool-parameters"])
def test_a_rows_outcome_does_not_hang_on_the_readers_stack_depth(tmp_path, where):
    """A row nested near the recursion limit parsed or not by how deep the reader's stack was (the driver's, an
    index task's, a read task's): the same row got a prompt id in one process and a quarantine id in another."""
    lines = []
    for depth in range(700, 1000, 25):
        if where == "extra-column":
            lines.append(f'{{"messages": {json.dumps(HI)}, "x": {_nested(depth)}}}')
        else:
            tools = f'[{{"name": "f", "parameters": {{"a": {_nested(depth)}}}}}]'
            lines.append(f'{{"messages": {json.dumps(HI)}, "tools": {tools}}}')
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = DatasetConfig(name="ds", path=str(path))
    shallow = [r["sample_id"] for _, r in iter_dataset(cfg, warn=False)]
    deep = _at_stack_depth(150, lambda: [r["sample_id"] for _, r in iter_dataset(cfg, warn=False)])
    assert deep == shallow


def test_the_id_index_of_a_parquet_file_with_unreadable_values(tmp_path):
    """The index pass runs through a file it used to fail on, and its id index matches a plain read."""
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"messages": [json.dumps(HI)] * 2,
                             "created": pa.array([10**12, 0], pa.timestamp("s"))}), path)
    d = DatasetConfig(name="ds", path=str(path))
    layout = RunLayout(tmp_path / "out")
    counts = index_dataset(d, layout, set(), {})
    assert counts["ds.rows"] == 2 and counts["to_do"] == 2
    seen = Collector()
    for ok, row in iter_dataset(d, warn=False):
        seen.add(row["sample_id"], ok)
    assert pq.read_table(layout.prompt_index("ds")).column("sample_id").to_pylist() == \
        seen.table().column("sample_id").to_pylist()


@pytest.mark.parametrize("part", ["What is 2+2?", 7, None, ["nested"]])
def test_a_content_part_that_is_not_an_object_is_quarantined(tmp_path, part):
    """A bare string among the content parts was read as "": the prompt lost its question and was generated."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "Q: "}, part]}]})
                    + "\n", encoding="utf-8")
    [(ok, row)] = _read(path)
    assert not ok
    assert f"message 0 content part 1 must be an object, got {type(part).__name__}" in row["reason"]


@pytest.mark.parametrize(("content", "parts"), [([], "none"), ([{"type": "image_url", "image_url": {"url": "x"}}],
                                                                 "image_url"),
                                                ([{"type": "input_audio"}, {"type": "image_url"}],
                                                 "image_url, input_audio"),
                                                ([{"type": "text", "text": ""}], "text"), ([{"type": "text"}], "text")])
def test_a_user_turn_with_no_text_is_quarantined(tmp_path, content, parts):
    """A user turn whose content parts hold no text (none, an image only, empty text) was joined into "": the
    target was asked an empty question and its answer trained on. A text part beside an image keeps its text, as
    before; a system or tool turn of no text reads as "", as its string form does."""
    path = tmp_path / "rows.jsonl"
    mixed = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "Q?"}]
    empty_tool = [{"role": "system", "content": []}, {"role": "user", "content": "Q?"},
                  {"role": "assistant", "content": [], "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                  {"role": "tool", "content": []}]
    path.write_text("\n".join(json.dumps({"messages": m}) for m in (
        [{"role": "user", "content": content}], [{"role": "user", "content": mixed}], empty_tool)) + "\n",
        encoding="utf-8")
    [(ok, row), (ok_mixed, row_mixed), (ok_tool, row_tool)] = _read(path)
    assert not ok and f"message 0 is a user turn with no text (parts: {parts})" in row["reason"], row["reason"]
    assert ok_mixed and json.loads(row_mixed["messages"]) == [{"role": "user", "content": "Q?"}]
    assert ok_tool and [m["content"] for m in json.loads(row_tool["messages"])] == ["", "Q?", "", ""], row_tool
