"""The response journal: a billed response is the OS's before append returns, survives a kill, and is read back;
a journal that cannot write stops accepting (and says why) instead of piling records up."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pipeline.base.layout import RunLayout
from pipeline.generate.sources.http import journal as http_journal
from pipeline.generate.sources.http import totals as http_totals
from pipeline.generate.sources.http.journal import (
    JournalError,
    Record,
    ResponseJournal,
    iter_journal,
    journal_files,
    load_responses,
    request_digest,
)
from pipeline.generate.sources.http.totals import billed_by_dataset, cost_by_dataset

REPO = Path(__file__).resolve().parents[2]


def rec(sample_id: str, *, dataset: str = "d1", source: str = "or", kind: str = "response", billed: int = 10,
        **kw: object) -> Record:
    return Record(sample_id=sample_id, dataset=dataset, source=source, model="m/x",
                  sampling=json.dumps({"temperature": 0.6}), request_digest="ab" * 32, kind=kind,  # type: ignore[arg-type]
                  billed_completion_tokens=billed, **kw)  # type: ignore[arg-type]


def test_record_round_trip() -> None:
    r = rec("s1", provider="P", reasoning="思考 a\nb", content="answer \"quoted\"", finish_reason="tool_calls",
            tool_calls=[{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}],
            native_finish_reason="stop", cost=0.0012, generation_id="gen-1", t_generate_s=3.5, attempts=2,
            charged_tokens=12)
    line = r.to_json()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert Record.from_json(line) == r
    assert Record.from_json(line.decode()) == r
    none = rec("s2", reasoning=None, content=None, tool_calls=None, native_finish_reason=None)
    assert Record.from_json(none.to_json()) == none


def test_a_line_with_numbers_of_the_wrong_type_counts_as_far_as_it_reads_never_less(tmp_path: Path) -> None:
    """The counting reader checks the figures it adds up: a line with a string for tokens or cost is never a
    TypeError at the sum, nor a coerced value; what of it reads still counts (the provider billed it), and tokens
    that do not read count as the request's whole reservation (``max_tokens`` of its sampling) as the engine
    charges a bill it cannot read. Its prompt is known as answered (held, not asked again)."""
    from pipeline.generate.sources.http.totals import journal_totals

    good = rec("s1", billed=10, cost=0.5).to_json()
    asked = json.dumps({"temperature": 0.6, "max_tokens": 64})
    bad = [json.dumps({**json.loads(good), "sample_id": f"x{i}", "sampling": asked, **patch}).encode() + b"\n"
           for i, patch in enumerate([{"charged_tokens": "12"}, {"cost": "0.5"}, {"billed_completion_tokens": True}])]
    path = RunLayout(tmp_path).response_journal("or", "a1")
    path.parent.mkdir(parents=True)
    path.write_bytes(good + b"".join(bad) + good)
    totals = journal_totals(RunLayout(tmp_path).responses, "or")
    # x0: its charge does not read, its 10 billed do: the reservation (64) bounds it; x1: its cost does not read
    # (0 here: the ledger's journal holds its dollar reservation), its 10 tokens do; x2: its billed count does not
    assert totals.billed == {"d1": 10 + 64 + 10 + 64 + 10}
    assert totals.cost == {"d1": pytest.approx(0.5 + 0.5 + 0.0 + 0.5 + 0.5)}
    assert set(totals.responded) == {"s1", "x0", "x1", "x2"}
    assert [r.sample_id for r in iter_journal(path)] == ["s1", "s1"]


# One value per field a reader turns into an Arrow column (``journal.PROJECTION_SCHEMA``), of a type that column
# cannot hold: each once made ``pa.array`` raise after the per-line skip, or was counted as if it were good; then
# the line was skipped whole, and its prompt, paid for, was asked (and paid for) again on a resume.
WRONG_TYPED = [("source", 5), ("source", ["or"]), ("sample_id", 5), ("dataset", {"d": 1}), ("kind", 5),
               ("generation_id", 7), ("error", {"status": 500}), ("identity", 5), ("charged_tokens", 1 << 63),
               ("billed_completion_tokens", (1 << 64) - 1), ("charged_tokens", 1.5), ("cost", "0.5"),
               ("at", "yesterday"), ("at", None), ("at", True)]


def _one_bad_line(tmp_path: Path, patch: dict[str, object], dumps=json.dumps) -> tuple[Path, Path]:
    """A journal of good lines around one whose ``patch`` makes it foreign; returns (responses folder, file)."""
    good = [rec(f"s{i}", billed=10, cost=0.5, identity="id1", generation_id=f"g{i}").to_json() for i in range(3)]
    bad = {**json.loads(good[0]), "sample_id": "bad", "billed_completion_tokens": 1000, "cost": 9.0,
           "generation_id": "g-bad", "sampling": json.dumps({"max_tokens": 2000}), **patch}
    path = RunLayout(tmp_path).response_journal("or", "a1")
    path.parent.mkdir(parents=True)
    path.write_bytes(good[0] + good[1] + dumps(bad).encode() + b"\n" + good[2])
    return path.parent, path


def _assert_counted_as_far_as_it_reads(folder: Path, path: Path, caplog: pytest.LogCaptureFixture,
                                       key: str) -> None:
    """The good lines count; the bad one counts as far as it reads (its bill where its dataset reads, tokens
    that do not read as its whole reservation) and, where its sample id reads, its prompt is held by the replay
    index (``Unreadable``, naming the file, the line's byte and the field); where it does not, the line is
    skipped, saying that its prompt may be paid for again. Nothing is coerced, nothing raises."""
    from pipeline.generate.sources.http.replay import ReplayIndex, Unreadable
    from pipeline.generate.sources.http.totals import journal_totals

    with caplog.at_level(logging.WARNING):
        totals = journal_totals(folder, "or")
        by_name, by_identity = ReplayIndex(folder, "or"), ReplayIndex(folder, "renamed", identity="id1")
    tokens = 0 if key == "dataset" else 2000 if key in ("charged_tokens", "billed_completion_tokens") else 1000
    usd = 0.0 if key in ("dataset", "cost") else 9.0
    assert totals.billed == {"d1": 30 + tokens} and totals.cost == {"d1": pytest.approx(1.5 + usd)}
    assert totals.gave_up == {}
    held = key != "sample_id"
    assert set(totals.responded) == {"s0", "s1", "s2"} | ({"bad"} if held else set())
    byte = len(b"".join(path.read_bytes().splitlines(keepends=True)[:2]))
    for index, holds in ((by_name, held), (by_identity, held and key != "identity")):
        got = index.get("bad")
        assert len(index) == 3 + holds
        if holds:
            assert isinstance(got, Unreadable) and got.request_digest == "ab" * 32
            assert got.reason.startswith(f"journal {path}, the line at byte {byte}: ") and key in got.reason
            assert isinstance(index.pop("bad"), Unreadable) and isinstance(index.pop("bad"), Unreadable)  # held
        else:
            assert got is None
    assert f"at byte {byte}" in caplog.text and key in caplog.text
    if held:
        assert "its prompt bad is held as paid" in caplog.text
    else:
        assert "skipping the unreadable line" in caplog.text and "may be asked (and paid for) again" in caplog.text
    assert [r.sample_id for r in iter_journal(path)] == ["s0", "s1", "s2"]
    assert sorted(load_responses(folder, "or")) == ["s0", "s1", "s2"]


@pytest.mark.parametrize(("key", "value"), WRONG_TYPED, ids=[f"{k}={v!r}" for k, v in WRONG_TYPED])
def test_a_line_with_a_counted_field_of_the_wrong_type_holds_its_prompt_and_counts_as_far_as_it_reads(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, value: object) -> None:
    """A resume's spend restore and the replay index read a journal a crash or a foreign writer may have left
    anything in: a line whose field cannot go into its Arrow column is never an ArrowTypeError or OverflowError
    for the whole file, never a line counted with a coerced value, and never a prompt paid for twice."""
    folder, path = _one_bad_line(tmp_path, {key: value})
    _assert_counted_as_far_as_it_reads(folder, path, caplog, key)


STDLIB_ONLY = [("cost", float("nan")), ("cost", float("inf")), ("at", float("-inf")), ("source", "\ud800"),
               ("error", "x\udfff"), ("charged_tokens", 10**30)]


@pytest.mark.parametrize(("key", "value"), STDLIB_ONLY, ids=[f"{k}={v!r}" for k, v in STDLIB_ONLY])
def test_values_only_the_stdlib_parser_reads_are_refused_too(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, key: str,
        value: object) -> None:
    """Without orjson the stdlib parser reads NaN, infinities, lone surrogate escapes and integers of any size:
    none of them is counted or reaches an Arrow column."""
    monkeypatch.setattr(http_journal, "_loads", json.loads)
    folder, path = _one_bad_line(tmp_path, {key: value})
    _assert_counted_as_far_as_it_reads(folder, path, caplog, key)


def test_a_line_nested_too_deep_for_the_stdlib_parser_is_a_line_that_does_not_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without orjson, ``json.loads`` raises RecursionError (not a ValueError) on a line nested deep enough: every
    reader (``iter_journal``, the totals, the replay index's projection and its line-by-line refresh) skips that
    line loudly, never raising out of a resume."""
    from pipeline.generate.sources.http.replay import ReplayIndex
    from pipeline.generate.sources.http.totals import journal_totals

    monkeypatch.setattr(http_journal, "_loads", json.loads)
    deep = b'{"sample_id":"deep","x":' + b"[" * 200_000 + b"]" * 200_000 + b"}\n"
    with pytest.raises(RecursionError):
        json.loads(deep)
    folder = RunLayout(tmp_path).responses
    path = RunLayout(tmp_path).response_journal("or", "a1")
    path.parent.mkdir(parents=True)
    path.write_bytes(rec("s0").to_json() + deep + rec("s1").to_json())
    with caplog.at_level(logging.WARNING):
        assert [r.sample_id for r in iter_journal(path)] == ["s0", "s1"]
        totals = journal_totals(folder, "or")
        index = ReplayIndex(folder, "or")
    assert totals.billed == {"d1": 20} and set(totals.responded) == {"s0", "s1"}
    assert len(index) == 2 and index.get("deep") is None
    assert "maximum recursion depth" in caplog.text and "may be asked (and paid for) again" in caplog.text
    caplog.clear()
    with open(path, "ab") as fh:  # appended later: parsed line by line by the index's refresh
        fh.write(deep + rec("s2").to_json())
    with caplog.at_level(logging.WARNING):
        assert index.refresh() == 1
    assert index.get("s2") is not None and "maximum recursion depth" in caplog.text


# One value per field a replay reads into a sample row (and no counting reader reads), of a type that field
# cannot be: each once raised inside the replay (an internal-error row), failed its whole batch at the Arrow
# conversion, or made the rebuild fail so that the prompt was silently asked (and paid for) again.
REPLAY_WRONG_TYPED = [("content", 5), ("content", ["a"]), ("reasoning", {"t": 1}), ("tool_calls", "x"),
                      ("tool_calls", [1]), ("tool_calls", [{"function": {"name": 1, "arguments": "{}"}}]),
                      ("tool_calls", [{"function": {"name": "f", "arguments": {"a": 1}}}]), ("finish_reason", 7),
                      ("native_finish_reason", True), ("provider", None), ("model", 2), ("sampling", {}),
                      ("request_digest", 5), ("t_generate_s", "1.5"), ("t_generate_s", None),
                      ("attempts", "2")]


@pytest.mark.parametrize(("key", "value"), REPLAY_WRONG_TYPED, ids=[f"{k}={v!r}" for k, v in REPLAY_WRONG_TYPED])
def test_a_line_with_a_replayed_field_of_the_wrong_type_still_counts_but_never_parses_as_a_record(
        tmp_path: Path, key: str, value: object) -> None:
    """The replay's parse is total: a field of the wrong type is a ValueError naming it, never a Record that
    raises (or fails a batch) further on. The counting readers do not read that field: the line's bill still
    counts (the provider billed it), and the replay index still knows the prompt was answered."""
    from pipeline.generate.sources.http.replay import ReplayIndex, Unreadable
    from pipeline.generate.sources.http.totals import journal_totals

    good = rec("s1", billed=10, cost=0.5, content="fine").to_json()
    bad = json.dumps({**json.loads(good), "sample_id": "bad", key: value}).encode()
    with pytest.raises(ValueError, match=key):
        Record.from_json(bad)
    folder = RunLayout(tmp_path).responses
    path = RunLayout(tmp_path).response_journal("or", "a1")
    path.parent.mkdir(parents=True)
    path.write_bytes(good + bad + b"\n")
    totals = journal_totals(folder, "or")
    assert totals.billed == {"d1": 20} and set(totals.responded) == {"s1", "bad"}
    got = ReplayIndex(folder, "or").pop("bad")
    assert isinstance(got, Unreadable) and str(path) in got.reason and f"byte {len(good)}" in got.reason
    assert key in got.reason


def test_record_parse_rejects_torn_and_foreign_lines_and_ignores_new_keys() -> None:
    line = rec("s1").to_json()
    with pytest.raises(ValueError):
        Record.from_json(line[: len(line) // 2])
    with pytest.raises(ValueError, match="lacks"):
        Record.from_json(b'{"sample_id": "x"}')
    with pytest.raises(ValueError, match="kind"):
        Record.from_json(json.dumps({**json.loads(line), "kind": "other"}))
    newer = json.dumps({**json.loads(line), "added_in_v2": 1})
    assert Record.from_json(newer).sample_id == "s1"


def test_charged_tokens() -> None:
    assert rec("a", billed=7).charged == 7
    assert rec("a", billed=-1).charged == 0  # no usage sent
    assert rec("a", billed=-1, charged_tokens=4096).charged == 4096  # the ledger charged the reservation


def test_request_digest_is_canonical() -> None:
    a = {"model": "m", "messages": [{"role": "user", "content": "é"}], "temperature": 0.6}
    b = {"temperature": 0.6, "messages": [{"content": "é", "role": "user"}], "model": "m"}
    assert request_digest(a) == request_digest(b)
    assert len(request_digest(a)) == 64
    assert request_digest(a) != request_digest({**a, "temperature": 0.7})


def test_journal_round_trip(tmp_path: Path) -> None:
    path = RunLayout(tmp_path).response_journal("or", "actor1")
    assert path == RunLayout(tmp_path).responses / "or-actor1.jsonl"
    records = [rec(f"s{i}", content=f"c{i}") for i in range(5)]
    with ResponseJournal(path) as j:
        for r in records:
            j.append(r)
    assert list(iter_journal(path)) == records
    assert j.written == j.synced == 5
    j.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        j.append(rec("late"))


def test_append_hands_the_record_to_the_os_before_returning(tmp_path: Path) -> None:
    path = tmp_path / "or-a.jsonl"
    j = ResponseJournal(path, flush_every_s=0.2)
    try:
        r = rec("s1")
        j.append(r)
        # No wait, no flush: a reader sees the whole line as soon as append returned.
        assert path.read_bytes() == r.to_json()
        assert j.written == 1
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and j.synced < 1:
            time.sleep(0.01)
        assert j.synced == 1  # the timer fsyncs without another append
    finally:
        j.close()


def test_short_writes_are_finished_before_append_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "or-a.jsonl"
    j = ResponseJournal(path, flush_every_s=60)
    real_write = os.write
    calls: list[int] = []

    def dribbling_write(fd: int, data: bytes) -> int:
        if fd != j._fd:
            return real_write(fd, data)
        calls.append(len(data))
        return real_write(fd, bytes(data[:7]))  # the OS takes 7 bytes at a time

    monkeypatch.setattr(os, "write", dribbling_write)
    records = [rec(f"s{i}", content="x" * 50) for i in range(3)]
    for r in records:
        j.append(r)
        assert path.read_bytes().endswith(r.to_json())  # whole when append returns
    monkeypatch.undo()
    j.close()
    assert list(iter_journal(path)) == records
    assert len(calls) > 3 * 10  # it really was written piecewise


def test_fsync_at_most_once_per_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(time.monotonic())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    j = ResponseJournal(tmp_path / "or-a.jsonl", flush_every_s=0.2)
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 0.7:
        j.append(rec(f"s{n}"))
        n += 1
        time.sleep(0.001)
    elapsed = time.monotonic() - t0
    timer_calls = list(calls)
    j.close()
    assert 1 <= len(timer_calls) <= elapsed / 0.2 + 1
    assert all(b - a >= 0.19 for a, b in zip(timer_calls, timer_calls[1:], strict=False))
    assert len(list(iter_journal(j.path))) == n


def test_torn_last_line_is_skipped_and_a_reopened_journal_starts_a_fresh_line(tmp_path: Path) -> None:
    path = tmp_path / "or-a.jsonl"
    with ResponseJournal(path) as j:
        for i in range(3):
            j.append(rec(f"s{i}"))
    with open(path, "ab") as fh:  # a kill in the middle of writing the fourth record
        fh.write(rec("s3").to_json()[:40])
    assert [r.sample_id for r in iter_journal(path)] == ["s0", "s1", "s2"]
    with ResponseJournal(path) as j:
        j.append(rec("s4"))
    assert [r.sample_id for r in iter_journal(path)] == ["s0", "s1", "s2", "s4"]


def test_unreadable_middle_line_is_skipped_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "or-a.jsonl"
    path.write_bytes(rec("s0").to_json() + b"garbage\n" + rec("s1").to_json())
    with caplog.at_level(logging.WARNING, logger=http_journal.__name__):
        assert [r.sample_id for r in iter_journal(path)] == ["s0", "s1"]
    assert "line 2" in caplog.text


def test_two_actor_files_merged_latest_response_wins(tmp_path: Path) -> None:
    folder = RunLayout(tmp_path).responses
    with ResponseJournal(RunLayout(tmp_path).response_journal("or", "a1")) as j1:
        j1.append(rec("s1", content="first", at=100.0))
        j1.append(rec("s2", content="only", at=101.0))
        j1.append(rec("s3", kind="billed_failure", billed=50, at=102.0))
    with ResponseJournal(RunLayout(tmp_path).response_journal("or", "a2")) as j2:
        j2.append(rec("s1", content="second", at=200.0))
        j2.append(rec("s4", content="other dataset", dataset="d2", at=201.0))
    with ResponseJournal(RunLayout(tmp_path).response_journal("or-b", "a3")) as j3:  # "or-*" matches its file name too
        j3.append(rec("s1", source="or-b", content="another source", at=300.0))
    assert [p.name for p in journal_files(folder, "or")] == ["or-a1.jsonl", "or-a2.jsonl", "or-b-a3.jsonl"]
    got = load_responses(folder, "or")
    assert sorted(got) == ["s1", "s2", "s4"]  # a billed failure is not a response
    assert got["s1"].content == "second" and got["s2"].content == "only" and got["s4"].dataset == "d2"
    assert load_responses(folder, "or-b")["s1"].content == "another source"
    assert load_responses(folder, "absent") == {}
    assert load_responses(tmp_path / "no-such-folder", "or") == {}


def test_billed_totals_include_billed_failures(tmp_path: Path) -> None:
    folder = RunLayout(tmp_path).responses
    with ResponseJournal(RunLayout(tmp_path).response_journal("or", "a1")) as j:
        j.append(rec("s1", billed=100, cost=0.1, generation_id="g1"))
        j.append(rec("s2", kind="billed_failure", billed=30, cost=0.03))  # cut body, billed anyway
        j.append(rec("s3", billed=-1, charged_tokens=500, generation_id="g3"))  # no usage: charged in full
        j.append(rec("s4", dataset="d2", billed=7, generation_id="g4"))
    with ResponseJournal(RunLayout(tmp_path).response_journal("or", "a2")) as j:
        j.append(rec("s2", billed=40, cost=0.04, generation_id="g2"))  # the retry that succeeded
        j.append(rec("s1", billed=100, cost=0.1, generation_id="g1"))  # the same generation journaled twice
        j.append(rec("s5", dataset="d2", kind="billed_failure", billed=3))
    with ResponseJournal(RunLayout(tmp_path).response_journal("or-b", "a3")) as j:
        j.append(rec("s9", source="or-b", billed=1000))
    assert billed_by_dataset(folder, "or") == {"d1": 100 + 30 + 500 + 40, "d2": 7 + 3}
    costs = cost_by_dataset(folder, "or")
    assert costs["d1"] == pytest.approx(0.1 + 0.03 + 0.04)
    assert billed_by_dataset(folder, "or-b") == {"d1": 1000}


def test_journal_totals_parse_the_files_once_while_they_are_unchanged(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume asks for the billed tokens, the costs and the give-ups at three places, status for the billed
    tokens and the responses: one parse of the files serves them all until a file changes, and then only the
    lines appended since are parsed, in this process or the next (the projection kept beside the files)."""
    from pipeline.generate.sources.http.totals import gave_up_counts, journal_totals

    folder = RunLayout(tmp_path).responses
    with ResponseJournal(RunLayout(tmp_path).response_journal("or", "a1")) as j:
        j.append(rec("s1", billed=100, cost=0.1, generation_id="g1"))
        j.append(rec("s1", billed=100, cost=0.1, generation_id="g1"))  # journaled twice: counted once
        j.append(rec("s2", kind="gave_up", billed=0, error="timeout"))
        j.append(rec("s2", kind="gave_up", billed=0, error="HTTP 503"))
        j.append(rec("s3", dataset="d2", kind="billed_failure", billed=5))
    parses = []
    real = http_totals.record_fields
    monkeypatch.setattr(http_totals, "record_fields", lambda line: parses.append(1) or real(line))
    totals = journal_totals(folder, "or")
    assert totals.billed == {"d1": 100, "d2": 5} and totals.cost["d1"] == pytest.approx(0.1)
    assert totals.gave_up == {"s2": (2, "HTTP 503")} and totals.responded == {"s1": "d1"}
    n = len(parses)
    assert n == 5
    assert billed_by_dataset(folder, "or") == totals.billed and gave_up_counts(folder, "or") == totals.gave_up
    assert cost_by_dataset(folder, "or") == totals.cost and len(parses) == n  # no second parse
    with ResponseJournal(RunLayout(tmp_path).response_journal("or", "a2")) as j:  # a new file: only it is parsed
        j.append(rec("s4", dataset="d2", billed=7, generation_id="g4"))
        j.append(rec("s1", billed=100, cost=0.1, generation_id="g1"))  # g1 again, in another file: counted once
    assert billed_by_dataset(folder, "or") == {"d1": 100, "d2": 12} and len(parses) == n + 2
    assert journal_totals(folder, "or").responded == {"s1": "d1", "s4": "d2"}
    with ResponseJournal(RunLayout(tmp_path).response_journal("or", "a1")) as j:  # appended to: only the new line
        j.append(rec("s5", billed=1, generation_id="g5"))
    assert billed_by_dataset(folder, "or") == {"d1": 101, "d2": 12} and len(parses) == n + 3
    http_totals._TOTALS.clear()  # the next process: the projections on disk, nothing parsed
    assert journal_totals(folder, "or") == full_parse_totals(folder) and len(parses) == n + 3


def full_parse_totals(folder: Path) -> http_totals.JournalTotals:
    """The same figures from a full parse of every line (``iter_journal``), as the totals were first counted."""
    tables = []
    for path in http_journal.journal_files(folder, "or"):
        rows, at = [], 0
        for line in path.read_bytes().split(b"\n"):
            try:
                rows.append(http_journal.projected_row(http_journal.record_fields(line), at, at + len(line)))
            except ValueError:
                pass  # a blank or torn line, as iter_journal skips it
            at += len(line) + 1
        tables.append(http_totals._table(rows))
    table = pa.concat_tables(tables)
    return http_totals.totals_of(table.filter(pc.equal(table.column("source"), "or")))


def test_a_journal_projection_that_no_longer_holds_is_not_used(tmp_path: Path, caplog) -> None:
    """A file rewritten under its projection (other bytes before its offset), a projection that does not read,
    a torn last line: each counted as a full parse would count it."""
    from pipeline.generate.sources.http.totals import journal_totals

    folder = RunLayout(tmp_path).responses
    path = RunLayout(tmp_path).response_journal("or", "a1")
    with ResponseJournal(path) as j:
        j.append(rec("s1", billed=10, generation_id="g1"))
        j.append(rec("s2", billed=20, generation_id="g2"))
    assert journal_totals(folder, "or").billed == {"d1": 30}
    cache = http_journal.projection_path(path)
    assert cache.is_file()
    first = path.read_bytes()
    path.write_bytes(first.replace(b'"s1"', b'"s9"').replace(b":10,", b":11,") + rec("s3", billed=5).to_json())
    http_totals._TOTALS.clear()
    got = journal_totals(folder, "or")
    assert got.billed == {"d1": 36} and set(got.responded) == {"s9", "s2", "s3"}
    for junk in (b"", b"not parquet"):
        cache.write_bytes(junk)
        http_totals._TOTALS.clear()
        assert journal_totals(folder, "or") == got
    with open(path, "ab") as fh:  # a kill mid-write: the torn line is not counted, nor stored
        fh.write(rec("s4", billed=1000).to_json()[:40])
    http_totals._TOTALS.clear()
    with caplog.at_level("INFO"):
        assert journal_totals(folder, "or") == got
    assert "torn last line" in caplog.text


def test_write_failure_raises_and_stops_the_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "or-a.jsonl"
    j = ResponseJournal(path, flush_every_s=60)
    real_write = os.write
    calls = {"n": 0}

    def filling_write(fd: int, data: bytes) -> int:
        if fd != j._fd:
            return real_write(fd, data)
        calls["n"] += 1
        if calls["n"] <= 3:
            return real_write(fd, data)
        if calls["n"] == 4:
            return real_write(fd, bytes(data[:25]))  # the disk fills up part-way through the fourth record...
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # ...and its rest does not fit

    monkeypatch.setattr(os, "write", filling_write)
    for i in range(3):
        j.append(rec(f"s{i}"))
    with caplog.at_level(logging.ERROR, logger=http_journal.__name__), pytest.raises(JournalError) as failed:
        j.append(rec("s3"))
    assert str(path) in str(failed.value) and "No space left on device (ENOSPC)" in str(failed.value)
    assert "write failed" in caplog.text
    assert isinstance(j.error, OSError) and j.error.errno == errno.ENOSPC
    assert j.written == 3
    monkeypatch.undo()  # the disk has room again: the journal stays failed, nothing is kept to be written later
    n = calls["n"]
    for i in range(4, 7):
        with pytest.raises(JournalError, match="ENOSPC"):
            j.append(rec(f"s{i}"))
    assert calls["n"] == n  # later appends did not even try
    with pytest.raises(JournalError):
        j.flush()  # still fsyncs what was written before the failure, then says it failed
    assert j.synced == 3
    with pytest.raises(JournalError):
        j.close()
    assert j._fd == -1
    j.close()  # idempotent once closed
    assert [r.sample_id for r in iter_journal(path)] == ["s0", "s1", "s2"]  # the torn fourth line is skipped


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_journal_on_a_full_device_refuses_the_first_record() -> None:
    j = ResponseJournal("/dev/full", flush_every_s=60)  # every write fails with ENOSPC, as on a full disk
    with pytest.raises(JournalError, match="No space left on device"):
        j.append(rec("s0"))
    with pytest.raises(JournalError):
        j.append(rec("s1"))
    assert j.written == 0 and j.error is not None
    with pytest.raises(JournalError):
        j.close()


def test_fsync_failure_stops_the_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    j = ResponseJournal(tmp_path / "or-a.jsonl", flush_every_s=60)
    j.append(rec("s0"))

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(JournalError, match=r"fsync failed: .*\(EIO\)"):
        j.flush()
    with pytest.raises(JournalError, match="EIO"):
        j.append(rec("s1"))  # the written line may be lost on a crash: nothing new is taken on
    monkeypatch.undo()
    with pytest.raises(JournalError):
        j.close()
    assert j.synced == 0
    assert [r.sample_id for r in iter_journal(j.path)] == ["s0"]


CHILD = """
import sys
from pipeline.generate.sources.http.journal import Record, ResponseJournal
j = ResponseJournal(sys.argv[1], flush_every_s=0.2)
i = 0
while True:
    j.append(Record(sample_id=f"s{i}", dataset="d", source="or", model="m", sampling="{}", request_digest="x",
                    content="y" * 300, billed_completion_tokens=10))
    i += 1
    print(i, j.synced, flush=True)  # only after append returned: record s{i-1} counts as answered
"""


def test_sigkill_mid_stream_loses_nothing_append_returned_from(tmp_path: Path) -> None:
    path = tmp_path / "or-killed.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, env=env, cwd=REPO)
    synced = 0
    try:
        assert proc.stdout is not None
        t0 = time.monotonic()
        for line in proc.stdout:
            synced = int(line.split()[1])
            if synced > 0 and time.monotonic() - t0 > 0.6:
                break
        proc.send_signal(signal.SIGKILL)  # the child is appending flat out: the kill lands mid-stream
        rest = proc.stdout.read()  # what it printed before it died
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert synced > 0  # the timer fsynced while the child ran
    whole = [ln for ln in rest.split(b"\n")[:-1]] or [line]  # a line cut by the kill does not count
    returned = int(whole[-1].split()[0])  # appends that had returned when the child last said so
    ids = [int(r.sample_id[1:]) for r in iter_journal(path)]
    assert ids == list(range(len(ids)))  # in order, no hole, no duplicate
    # Every record whose append returned is in the file; at most one more (returned, not yet reported).
    assert returned <= len(ids) <= returned + 1


def test_the_writer_keeps_its_projection_so_the_next_reader_parses_nothing(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The HTTP source stores its journal's projection when idle: a finished run's status and resume count
    from it without parsing a line, the same figures as a full parse; a reopened file's writer leaves it."""
    from pipeline.generate.sources.http.totals import journal_totals

    folder = RunLayout(tmp_path).responses
    path = RunLayout(tmp_path).response_journal("or", "a1")
    j = ResponseJournal(path)
    for i in range(5):
        j.append(rec(f"s{i}", billed=10 + i, cost=0.01 * i, generation_id=f"g{i % 4}",
                     kind="gave_up" if i == 3 else "response", error="timeout" if i == 3 else ""))
    j.store_projection()
    stored = http_journal.projection_path(path).stat().st_mtime_ns
    j.store_projection()  # nothing appended since: not written again
    assert http_journal.projection_path(path).stat().st_mtime_ns == stored
    j.close()
    parses = []
    real = http_totals.record_fields
    monkeypatch.setattr(http_totals, "record_fields", lambda line: parses.append(1) or real(line))
    assert journal_totals(folder, "or") == full_parse_totals(folder) and parses == []
    again = ResponseJournal(path)  # reopened (a restarted actor of the same id): readers parse its appends
    again.append(rec("s9", billed=1))
    again.store_projection()
    again.close()
    assert http_journal.projection_path(path).stat().st_mtime_ns == stored
    http_totals._TOTALS.clear()
    assert journal_totals(folder, "or") == full_parse_totals(folder) and len(parses) == 1


def test_a_journal_read_in_small_chunks_projects_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader holds a chunk, not the file (a 200,000-response journal is ~150 MB): lines cut at any chunk
    boundary give the same projection as one read, and the torn last line stays out."""
    path = RunLayout(tmp_path).response_journal("or", "a1")
    with ResponseJournal(path) as j:
        for i in range(50):
            j.append(rec(f"s{i}", billed=i, generation_id=f"g{i % 7}"))
    with open(path, "ab") as f:
        f.write(b'{"torn')
    whole = http_totals.file_projection(path)
    http_journal.projection_path(path).unlink()
    monkeypatch.setattr(http_totals, "READ_CHUNK", 37)
    assert http_totals.file_projection(path).equals(whole) and whole.num_rows == 50
