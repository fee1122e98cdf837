"""The replay index: what every actor of a folder was billed for, read in chunks, torn lines picked up later,
by source name or by identity."""

from __future__ import annotations

from pipeline.generate.sources.http.journal import Record
from pipeline.generate.sources.http.replay import ReplayIndex


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
