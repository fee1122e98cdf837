"""A re-run that added samples, or changed a training setting, trains its drafter again: the checkpoints of a
training on other samples are not resumed (they would end at once at the old step count and export the old
drafter), nor those of a training with other settings (they would bring back the old optimizer, schedule,
vocabulary and architecture). More steps continue a training."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.base.console import Console
from pipeline.base.layout import RunLayout
from pipeline.hidden.handoff import DATA_FILE, fresh_drafter, training_data
from tests.helpers.training import AUX_IDS, small_cfg
from training.heldout import is_held_out
from training.train import training_settings

SETTINGS = training_settings(small_cfg(), AUX_IDS)


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
    fresh_drafter(layout, digest, n, Console(buf, tty=False), SETTINGS)
    assert json.loads((layout.drafter / DATA_FILE).read_text()) == {"samples": n, "digest": digest,
                                                                    "settings": SETTINGS}
    _trained(layout)

    fresh_drafter(layout, *training_data(layout, 0.25), Console(buf, tty=False), SETTINGS)  # killed and resumed
    assert (layout.drafter / "ray" / "drafter" / "checkpoint_000001").is_file() and buf.getvalue() == ""

    _samples(layout, 60, "part-1.parquet")  # a follow-up run read more rows (ids s0..s59, s0..s39 again)
    digest2, n2 = training_data(layout, 0.25)
    assert n2 > n and digest2 != digest
    fresh_drafter(layout, digest2, n2, Console(buf, tty=False), SETTINGS)
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


def test_changed_training_settings_start_over_and_more_steps_continue(tmp_path):
    layout = RunLayout(tmp_path)
    _samples(layout, 10)
    data = training_data(layout, 0.0)
    buf = io.StringIO()
    fresh_drafter(layout, *data, Console(buf, tty=False), SETTINGS)
    _trained(layout)

    more = training_settings(small_cfg(steps=20, log_every=1, trackers=[]), AUX_IDS)  # run-only settings: free
    fresh_drafter(layout, *data, Console(buf, tty=False), more)
    assert (layout.drafter / "export").is_dir() and buf.getvalue() == ""
    assert json.loads((layout.drafter / DATA_FILE).read_text())["settings"]["steps"] == 20

    other = training_settings(small_cfg(steps=20, lr=1e-4, draft_vocab_size=64, fc_norm=False), AUX_IDS)
    fresh_drafter(layout, *data, Console(buf, tty=False), other)
    prev = tmp_path / "drafter.previous"
    assert (prev / "ray" / "drafter" / "checkpoint_000001").is_file()
    assert sorted(p.name for p in layout.drafter.iterdir()) == [DATA_FILE]
    line = buf.getvalue().strip()
    assert line.startswith("[train] the training settings changed since the drafter was trained (lr 0.002 -> "
                           "0.0001, fc_norm True -> False, draft_vocab_size 1024 -> 64): training again from step 0")
    assert str(prev) in line and "\n" not in line

    _trained(layout)
    fewer = training_settings(small_cfg(steps=5, lr=1e-4, draft_vocab_size=64, fc_norm=False), AUX_IDS)
    fresh_drafter(layout, *data, Console(buf, tty=False), fewer)  # fewer steps: the old run is past its end
    assert "(steps 20 -> 5)" in buf.getvalue().splitlines()[-1]
    assert not (layout.drafter / "export").exists()


def test_a_data_file_without_settings_is_checked_against_the_newest_checkpoint(tmp_path):
    """data.json written before it recorded settings: the newest checkpoint's state.json says how it trained."""
    layout = RunLayout(tmp_path)
    _samples(layout, 10)
    digest, n = training_data(layout, 0.0)
    layout.drafter.mkdir()
    (layout.drafter / DATA_FILE).write_text(json.dumps({"samples": n, "digest": digest}))
    for step, loss in ((2, "tv"), (4, "ce")):  # Ray Train resumes the newest one
        ckpt = layout.drafter / "ray" / "drafter" / f"step_{step:07d}"
        ckpt.mkdir(parents=True)
        state = {"step": step, "epoch": 0, "batch_in_epoch": step, "config": small_cfg(loss=loss).model_dump(),
                 "aux_layer_ids": AUX_IDS}
        (ckpt / "state.json").write_text(json.dumps(state))
    buf = io.StringIO()
    fresh_drafter(layout, digest, n, Console(buf, tty=False), SETTINGS)
    assert buf.getvalue() == "" and (layout.drafter / "ray").is_dir()
    fresh_drafter(layout, digest, n, Console(buf, tty=False), training_settings(small_cfg(loss="tv"), AUX_IDS))
    assert "(loss ce -> tv)" in buf.getvalue() and not (layout.drafter / "ray").exists()
