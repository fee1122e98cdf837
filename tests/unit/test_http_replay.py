"""The replay index: what every actor of a folder was billed for, read in chunks, torn lines picked up later,
by source name or by identity."""

from __future__ import annotations

import json

import pytest

from pipeline.generate.sources.http import replay as http_replay
from pipeline.generate.sources.http import totals as http_totals
from pipeline.generate.sources.http.journal import Record, ResponseJournal, projection_path
from pipeline.generate.sources.http.replay import ReplayIndex, Unreadable


def rec(i: int, source: str = "api", identity: str = "", kind: str = "response") -> Record:
    return Record(sample_id=f"s{i}", dataset="d", source=source, model="m", sampling="{}", request_digest="x",
                  kind=kind, content="y" * (i * 37 % 500), identity=identity)


def test_the_index_reads_in_chunks_and_picks_up_a_torn_line_once_it_is_whole(tmp_path):
    f = tmp_path / "api-a.jsonl"
    recs = [rec(i) for i in range(300)]
    line = rec(300).to_json()
    f.write_bytes(b"".join(r.to_json() for r in recs) + line[:20])  # the last one still being written
    idx = ReplayIndex(tmp_path, "api")
    idx._scanned.clear()
    idx._where.clear()
    assert idx._scan(f, 0, f.stat().st_size, chunk=1000) == 300
    assert all(idx.get(f"s{i}").content == recs[i].content for i in range(300))
    assert idx.get("s300") is None
    with open(f, "ab") as fh:
        fh.write(line[20:])
    assert idx.refresh() == 1 and idx.get("s300").content == rec(300).content
    assert idx.pop("s3") is not None and idx.pop("s3") is None  # replayed once per actor


def test_own_file_gave_ups_and_other_sources_are_not_replayed(tmp_path):
    own, other = tmp_path / "api-own.jsonl", tmp_path / "api-other.jsonl"
    own.write_bytes(rec(1).to_json())
    other.write_bytes(rec(2).to_json() + rec(3, kind="gave_up").to_json() + rec(4, source="api-b").to_json())
    idx = ReplayIndex(tmp_path, "api", exclude=own)
    assert idx.get("s1") is None and idx.get("s2") is not None and idx.get("s3") is None and idx.get("s4") is None


def test_a_renamed_source_replays_by_identity(tmp_path):
    (tmp_path / "old-name-a.jsonl").write_bytes(rec(1, source="old-name", identity="id1").to_json()
                                                + rec(2, source="other", identity="id2").to_json())
    idx = ReplayIndex(tmp_path, "new-name", identity="id1")
    assert idx.get("s1") is not None and idx.get("s2") is None


def test_a_resumed_actor_indexes_from_the_writers_projections_and_parses_only_what_came_after(
        tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A resume's source actors index every response their predecessors journaled: from the projections the
    writers stored (no line parsed), with each line's byte span right (``get`` reads the record there), the
    same index as a parse of every line; lines appended later are the only ones parsed."""
    run, bare = tmp_path / "run", tmp_path / "bare"
    written = {}
    for name, ids in (("api-a.jsonl", range(0, 40)), ("api-b.jsonl", range(30, 60))):  # 30-39 answered twice
        with ResponseJournal(run / name) as j:
            for i in ids:
                r = rec(i, identity="id1")
                j.append(r)
                written[r.sample_id] = r  # the later file's record is the later one
            j.append(rec(100 + i, kind="gave_up"))
            j.store_projection()
        bare.mkdir(exist_ok=True)
        (bare / name).write_bytes((run / name).read_bytes())  # the same files with no projection beside them
    parses = []
    for module in (http_totals, http_replay):
        real = module.record_fields
        monkeypatch.setattr(module, "record_fields", lambda line, real=real: parses.append(1) or real(line))
    idx = ReplayIndex(run, "api")
    assert parses == [] and len(idx) == 60
    full = ReplayIndex(bare, "api")
    assert len(parses) == 72  # every line of the bare files, parsed once
    assert {k: (v.path.name, v.start, v.end, v.at) for k, v in idx._where.items()} == \
        {k: (v.path.name, v.start, v.end, v.at) for k, v in full._where.items()}
    assert all(idx.get(sid) == r for sid, r in written.items())
    assert idx._where["s35"].path.name == "api-b.jsonl"
    parses.clear()
    with ResponseJournal(run / "api-a.jsonl") as j:  # a reopened file: only its new line is parsed
        j.append(rec(70, identity="id1"))
    assert idx.refresh() == 1 and len(parses) == 1 and idx.get("s70").content == rec(70).content
    renamed = ReplayIndex(run, "renamed", identity="id1")  # by the projection's identity column
    assert len(renamed) == 61 and renamed.get("s100") is None and renamed.get("s59") == written["s59"]


def test_a_line_of_the_wrong_types_appended_later_holds_its_prompt_or_is_skipped_loudly(
        tmp_path, caplog: pytest.LogCaptureFixture):
    """What a refresh parses line by line is checked as the projection is: a line whose counted field is of the
    wrong type (here its source: the file's name says whose it is) still holds its prompt, its sample id reading;
    one in which no sample id reads is skipped and said (its prompt may be paid for again); the good ones around
    them indexed."""
    f = tmp_path / "api-a.jsonl"
    first = rec(1).to_json()
    f.write_bytes(first)
    idx = ReplayIndex(tmp_path, "api")
    bad = rec(2).to_json().replace(b'"source":"api"', b'"source":5')
    nameless = rec(4).to_json().replace(b'"sample_id":"s4"', b'"sample_id":4')
    assert bad != rec(2).to_json() and nameless != rec(4).to_json()
    with open(f, "ab") as fh:
        fh.write(bad + rec(3).to_json() + nameless)
    with caplog.at_level("WARNING", logger=http_replay.__name__):
        assert idx.refresh() == 2
    held = idx.get("s2")
    assert isinstance(held, Unreadable) and "source must be a string" in held.reason
    assert f"the line at byte {len(first)}" in held.reason and str(f) in held.reason
    assert idx.get("s3") is not None and idx.get("s4") is None and len(idx) == 3
    assert "its prompt s2 is held as paid" in caplog.text and "source must be a string" in caplog.text
    assert "skipping the unreadable line" in caplog.text and "may be asked (and paid for) again" in caplog.text


def _bad(r: Record, **patch) -> bytes:
    return json.dumps({**json.loads(r.to_json()), **patch}).encode() + b"\n"


@pytest.mark.parametrize("stored", [False, True], ids=["parsed", "from the stored projection"])
def test_a_line_whose_counted_fields_do_not_read_holds_only_a_prompt_of_this_source_never_over_a_good_one(
        tmp_path, monkeypatch: pytest.MonkeyPatch, stored):
    """Indexed from a file's projection (stored by an earlier reader, so nothing is parsed: a projection that
    once left such a line out forgot the prompt was paid for) or parsed: the line holds its prompt where it may
    be a response of this source; a readable response of the same prompt wins over it, earlier or later; a
    billed failure, a give-up and another source's line hold nothing."""
    a, b = tmp_path / "api-a.jsonl", tmp_path / "api-b.jsonl"
    a.write_bytes(_bad(rec(1), cost="x")  # held
                  + _bad(rec(2), cost="x", at=1e12) + _bad(rec(3), cost="x", at=1.0)  # later, earlier: b's win
                  + _bad(rec(4), cost="x", kind="billed_failure") + _bad(rec(5), cost="x", kind="gave_up")
                  + _bad(rec(6, source="other"), cost="x")  # another source's, in a file of this one's name
                  + _bad(rec(7), kind=["response"], at="now"))  # its kind does not read either: it may be one
    b.write_bytes(rec(2).to_json() + rec(3).to_json())
    parses = []
    if stored:
        http_totals.journal_totals(tmp_path, "api")  # an earlier reader (the run's end, status) stored them
        assert projection_path(a).is_file() and projection_path(b).is_file()
        for module in (http_totals, http_replay):
            real = module.record_fields
            monkeypatch.setattr(module, "record_fields", lambda line, real=real: parses.append(1) or real(line))
    idx = ReplayIndex(tmp_path, "api")
    assert parses == []
    for sid, field in (("s1", "cost must be"), ("s7", "kind")):
        got = idx.pop(sid)
        assert isinstance(got, Unreadable) and field in got.reason and str(a) in got.reason
        assert got.request_digest == "x"  # the engine holds the prompt when it asks this same request
    assert idx._where["s2"].path == idx._where["s3"].path == b
    assert isinstance(idx.get("s2"), Record) and isinstance(idx.get("s3"), Record)
    assert all(idx.get(f"s{i}") is None for i in (4, 5, 6)) and len(idx) == 4
    assert len(ReplayIndex(tmp_path, "renamed", identity="id1")) == 0  # no identity in the lines: by name


def test_a_response_that_no_longer_reads_back_is_unreadable_not_none_and_never_taken(tmp_path):
    """An indexed response whose line does not read back whole (a field of the wrong type, a file gone) was paid
    for all the same: ``get`` says so, naming the file, the line and the field, with the line's request digest
    where it reads; ``pop`` leaves it untaken, so every ask of that prompt is held."""
    f = tmp_path / "api-a.jsonl"
    good, bad = rec(1).to_json(), rec(2).to_json().replace(b'"finish_reason":""', b'"finish_reason":7')
    assert bad != rec(2).to_json()
    f.write_bytes(good + bad)
    idx = ReplayIndex(tmp_path, "api")
    assert len(idx) == 2 and idx.pop("s1") == Record.from_json(good)
    for _ in range(2):
        got = idx.pop("s2")
        assert isinstance(got, Unreadable) and got.request_digest == "x"
        assert got.reason == f"journal {f}, the line at byte {len(good)}: finish_reason must be a string"
    f.unlink()
    gone = idx.get("s1")
    assert isinstance(gone, Unreadable) and gone.request_digest is None and str(f) in gone.reason
