"""No duplicates by construction: a restarted writer knows what is on disk, and every reader of samples/ keeps
one row per sample id (and says how many extra copies it skipped)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.base.layout import RunLayout
from pipeline.base.records import SAMPLE_SCHEMA, extra_copies, read_samples
from pipeline.checks.audit import main as audit_main
from pipeline.generate.stages import WriteShards
from tests.unit.test_run_lock import _batch, _flight, _ids


def _shard(folder: Path, name: str, *ids: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in _flight(i).items() if k in SAMPLE_SCHEMA.names} for i in ids]
    for i, r in enumerate(rows):
        r["output_ids"] = [3, 4 + i]
    pq.write_table(pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA), folder / name)


def test_a_restarted_writer_skips_what_its_predecessor_wrote(tmp_path):
    """The writer actor died after writing its shard (its summary never reached the driver): Ray re-runs the
    batch on a new actor, which must not write the samples again."""
    layout = RunLayout(tmp_path)
    WriteShards(layout)(_batch(_flight("a"), _flight("b"), _flight("q", "quarantine")))
    again = WriteShards(layout)(_batch(_flight("a"), _flight("b"), _flight("q", "quarantine"), _flight("c")))
    assert again["status"].to_pylist() == ["duplicate", "duplicate", "duplicate", "ok"]
    assert _ids(layout.samples) == ["a", "b", "c"] and _ids(layout.quarantine) == ["q"]


def test_readers_keep_one_row_per_sample_id(tmp_path, capsys):
    samples = RunLayout(tmp_path).samples
    _shard(samples, "part-a.parquet", "x", "y")
    _shard(samples, "part-b.parquet", "y", "z")  # y written twice (a shard from before this rule)
    rows, dropped = read_samples(samples, ["sample_id", "output_ids"])
    assert [r["sample_id"] for r in rows] == ["x", "y", "z"] and dropped == 1
    assert rows[1]["output_ids"] == [3, 5]  # the first file's copy, as every reader keeps
    assert extra_copies(samples) == ({"y": "part-a.parquet"}, 1)
    code = audit_main([str(samples), "--profile", "deepseek"])
    out = capsys.readouterr().out
    assert "3 responses checked" in out and "1 extra copies of sample ids skipped" in out, out
    assert code in (0, 1)
