"""The one atomic-write rule: hidden temp file in the same folder, fsync, rename; a failure keeps the old file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base.layout import RunLayout, atomic_path, atomic_write, atomic_write_json, atomic_write_table, temp_path


def test_temp_names_are_hidden_and_beside_the_target(tmp_path: Path) -> None:
    t = temp_path(tmp_path / "report.json")
    assert t.parent == tmp_path and t.name.startswith(".report.json.") and t.name.endswith(".tmp")
    assert t != temp_path(tmp_path / "report.json")


def test_writes_replace_the_file_and_leave_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    atomic_write(p, b"old")
    atomic_write_json(p, {"b": 1, "a": "é"}, sort_keys=True, ensure_ascii=False)
    assert p.read_text(encoding="utf-8") == '{\n  "a": "é",\n  "b": 1\n}\n'
    atomic_write_table(pa.table({"x": [1, 2]}), tmp_path / "t.parquet")
    assert pq.read_table(tmp_path / "t.parquet").column("x").to_pylist() == [1, 2]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["f.json", "t.parquet"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    p = tmp_path / "shard.arrow"
    p.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        tmp.write_text("half a ")
        raise RuntimeError("killed mid-write")
    assert p.read_text() == "old" and [f.name for f in tmp_path.iterdir()] == ["shard.arrow"]
    with atomic_path(p) as tmp:
        tmp.write_text("new")
    assert p.read_text() == "new" and [f.name for f in tmp_path.iterdir()] == ["shard.arrow"]


def test_run_layout_names_every_path(tmp_path: Path) -> None:
    lay = RunLayout(str(tmp_path))
    assert lay.metrics == tmp_path / "drafter" / "metrics.jsonl"
    assert lay.export == tmp_path / "drafter" / "export"
    assert lay.hidden_index == tmp_path / "hidden" / "index.json"
    assert lay.ledger("or") == tmp_path / "ledger-or.json"
    assert (lay.report.name, lay.manifest.name, lay.samples.name) == ("report.json", "manifest.json", "samples")
