"""A re-run that added samples trains its drafter again: the checkpoints of a training on other samples are
not resumed (they would end at once at the old step count and export the old drafter)."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.base.console import Console
from pipeline.base.layout import RunLayout
from pipeline.hidden.handoff import DATA_FILE, fresh_drafter, training_data
from training.heldout import is_held_out


def _samples(layout: RunLayout, n: int, name: str = "part-0.parquet") -> None:
    layout.samples.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"sample_id": [f"s{i}" for i in range(n)]}), layout.samples / name)


def _trained(layout: RunLayout) -> None:
    """What a training leaves: a checkpoint and an export."""
    (layout.drafter / "ray" / "drafter").mkdir(parents=True)
    (layout.drafter / "ray" / "drafter" / "checkpoint_000001").write_text("step 150")
    (layout.drafter / "export").mkdir()


def test_the_same_samples_resume_and_new_ones_start_over(tmp_path):
    layout = RunLayout(tmp_path)
    _samples(layout, 40)
    digest, n = training_data(layout, 0.25)
    assert n == sum(not is_held_out(f"s{i}", 0.25) for i in range(40)) < 40  # held-out ones never train
    buf = io.StringIO()
    fresh_drafter(layout, digest, n, Console(buf, tty=False))
    assert json.loads((layout.drafter / DATA_FILE).read_text()) == {"samples": n, "digest": digest}
    _trained(layout)

    fresh_drafter(layout, *training_data(layout, 0.25), Console(buf, tty=False))  # killed and resumed
    assert (layout.drafter / "ray" / "drafter" / "checkpoint_000001").is_file() and buf.getvalue() == ""

    _samples(layout, 60, "part-1.parquet")  # a follow-up run read more rows (ids s0..s59, s0..s39 again)
    digest2, n2 = training_data(layout, 0.25)
    assert n2 > n and digest2 != digest
    fresh_drafter(layout, digest2, n2, Console(buf, tty=False))
    prev = tmp_path / "drafter.previous"
    assert (prev / "ray" / "drafter" / "checkpoint_000001").is_file()  # kept aside, not deleted
    assert sorted(p.name for p in layout.drafter.iterdir()) == [DATA_FILE]  # nothing to resume from
    line = buf.getvalue().strip()
    assert line.startswith(f"[train] the training samples changed since the drafter was trained ({n} then, {n2} now)")
    assert str(prev) in line


def test_a_drafter_from_before_the_data_file_keeps_its_resume(tmp_path):
    layout = RunLayout(tmp_path)
    _samples(layout, 10)
    _trained(layout)
    buf = io.StringIO()
    fresh_drafter(layout, *training_data(layout, 0.0), Console(buf, tty=False))
    assert (layout.drafter / "export").is_dir() and buf.getvalue() == ""
    assert json.loads((layout.drafter / DATA_FILE).read_text())["samples"] == 10
