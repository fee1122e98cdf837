"""One value arm, trained for real in this process: it reads hidden-state shards, trains on its own rows,
exports, measures the run's held-out samples per dataset, and writes the result a re-run reuses."""

from __future__ import annotations

import json

from pipeline.hidden.shards import shard_meta, write_shards
from pipeline.value.arms import RESULT_FILE, Arm, arm_settings, fresh_arm_dir, read_result, train_arm
from tests.helpers.training import TINY_AUX_LAYER_IDS, TINY_TARGET, easy_run, torch_threads
from training.heldout import is_held_out

HELDOUT = 0.1


def test_one_arm_trains_exports_and_measures_each_dataset(tmp_path):
    run = easy_run()
    rows = run.train_rows + run.held_rows
    hidden = tmp_path / "hidden"
    write_shards(rows, hidden, shard_meta(TINY_AUX_LAYER_IDS, TINY_TARGET["hidden_size"]), samples_per_shard=128)
    datasets = {r["sample_id"]: "a" if i % 2 else "b" for i, r in enumerate(rows)}
    labels = {sid: {"dataset": d, "source": "local"} for sid, d in datasets.items()}
    cfg = run.cfg.model_copy(update={"steps": 4, "checkpoint_every": 2, "warmup_steps": 1})
    arm = Arm("a", 0.0, seed=1)
    kwargs = dict(train_cfg=cfg.model_dump(), target_dir=str(run.target_dir), hidden_dir=str(hidden),
                  datasets=datasets, labels=labels, heldout_fraction=HELDOUT, heldout_max=64)
    with torch_threads(1):
        res = train_arm(arm, arm_dir=str(tmp_path / arm.name), **kwargs)
    held = sum(is_held_out(sid, HELDOUT) for sid in datasets)
    assert 20 < held < 90
    assert res["heldout"]["samples"] == min(held, 64)
    groups = {g["name"]: g for g in res["heldout"]["by_dataset"]}
    assert set(groups) == {"a", "b"} and all(g["drafts"] > 0 for g in groups.values())
    assert sum(g["drafts"] for g in groups.values()) == res["heldout"]["drafts"]
    assert (tmp_path / arm.name / "export" / "config.json").is_file()
    metrics = [json.loads(ln) for ln in (tmp_path / arm.name / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert json.loads((tmp_path / arm.name / RESULT_FILE).read_text()) == res
    settings = arm_settings(arm, kwargs["train_cfg"])
    assert read_result(tmp_path / arm.name, settings) == res
    assert res["final_loss"] == metrics[-1]["loss"] and set(res["final_acc"]) == {"acc_0", "acc_1", "acc_2"}
    # another budget or another arm: trained again, from nothing
    assert read_result(tmp_path / arm.name, arm_settings(arm, {**kwargs["train_cfg"], "steps": 5})) is None
    assert read_result(tmp_path / arm.name, arm_settings(Arm("a", 0.25, seed=1), kwargs["train_cfg"])) is None
    fresh_arm_dir(tmp_path / arm.name, arm_settings(arm, {**kwargs["train_cfg"], "steps": 5}))
    assert not (tmp_path / arm.name / "checkpoints").exists() and not (tmp_path / arm.name / RESULT_FILE).exists()
