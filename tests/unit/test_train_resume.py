"""What a resumed training reuses, and what it refuses: a metrics log with a torn tail, a vocab file of another
size, a checkpoint made with other training settings (only more steps continue a run)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.training import AUX_IDS, small_cfg
from training.checkpoint import LocalCheckpoints
from training.config import DraftTrainConfig
from training.train import (
    TRAINING_SETTINGS,
    _truncate_log,
    reusable_vocab,
    save_vocab,
    train_drafter,
    train_loop,
)
from training.vocab import build_vocab_mapping

pytestmark = pytest.mark.usefixtures("one_thread")

# Fields that say where and how a run computes, logs, checkpoints and is measured: free to change on a resume.
RUN_ONLY = {"precision", "use_gpu", "resources_per_worker", "checkpoint_every", "keep_checkpoints", "max_failures",
            "log_every", "trackers", "wandb_project", "wandb_entity", "mlflow_tracking_uri", "mlflow_experiment",
            "tracker_run_name", "materialize", "heldout_fraction", "heldout_max_samples", "eval_k", "served_eval"}


def test_every_training_field_is_either_a_training_setting_or_run_only():
    """A new field must be placed: a setting that changes the drafter left out would be silently ignored."""
    assert set(TRAINING_SETTINGS) | RUN_ONLY == set(DraftTrainConfig.model_fields)
    assert not set(TRAINING_SETTINGS) & RUN_ONLY


@pytest.mark.parametrize("tail", ['{"step": 6, "lo', "\x00" * 40, '{"loss": 1.0}', '{"step": "7"}', "[8]",
                                  '{"step": true}'])
def test_a_torn_log_tail_is_dropped_on_resume(tmp_path, tail):
    """A kill mid-line or a crash's NUL-filled tail must not make every resume fail."""
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7)) + tail)
    _truncate_log(log, 5)
    assert [json.loads(ln)["step"] for ln in log.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_a_vocab_file_is_reused_only_at_the_configured_size(tmp_path):
    rows = [{"input_ids": [5, 5, 7, 9, 9, 3], "loss_mask": [0, 1, 1, 1, 1, 1]}]
    path = tmp_path / "vocab.safetensors"
    assert not reusable_vocab(path, 8)
    save_vocab(build_vocab_mapping(rows, 100, 8), path)
    assert reusable_vocab(path, 8) and not reusable_vocab(path, 16)
    path.write_bytes(b"\x00" * 40)  # damaged: counted again, it is derived from the data
    assert not reusable_vocab(path, 8)


def test_a_checkpoint_resumes_only_with_its_settings_or_more_steps(tmp_path, tiny_target, target_parts, tiny_rows):
    cfg = small_cfg(steps=2, checkpoint_every=2, trackers=[])
    vocab = build_vocab_mapping(tiny_rows, target_parts.vocab_size, cfg.draft_vocab_size)
    train_loop(cfg, tiny_target, tmp_path / "run", lambda e: tiny_rows, vocab)
    latest = LocalCheckpoints(tmp_path / "run" / "checkpoints", cfg.keep_checkpoints).latest()
    for change, named in [({"lr": 1e-6}, "lr 0.002 -> 1e-06"), ({"fc_norm": False}, "fc_norm True -> False"),
                          ({"loss": "tv", "seed": 3}, "loss ce -> tv, seed 0 -> 3"), ({"steps": 1}, "steps 2 -> 1")]:
        other = cfg.model_copy(update=change)
        with pytest.raises(ValueError, match="other settings") as e:
            train_loop(other, tiny_target, tmp_path / "run", lambda e: tiny_rows, vocab, resume_from=latest)
        assert named in str(e.value) and str(latest) in str(e.value)
    more = cfg.model_copy(update={"steps": 3, "log_every": 1})
    _, metrics = train_loop(more, tiny_target, tmp_path / "run", lambda e: tiny_rows, vocab, resume_from=latest)
    assert metrics["step"] == 3


def test_train_drafter_refuses_other_settings_before_ray_starts(tmp_path, tiny_target):
    """Ray Train would restore the run and load the old checkpoint: a KeyError on every retry for another
    architecture, the old drafter silently for another vocabulary or loss."""
    import ray

    ckpt = tmp_path / "run" / "ray" / "drafter" / "step_0000002"
    ckpt.mkdir(parents=True)
    cfg = small_cfg(steps=2, trackers=[])
    state = {"step": 2, "epoch": 0, "batch_in_epoch": 2, "config": cfg.model_dump(), "aux_layer_ids": AUX_IDS}
    (ckpt / "state.json").write_text(json.dumps(state))
    other = cfg.model_copy(update={"draft_vocab_size": 128, "norm_output": False})
    started = ray.is_initialized()
    with pytest.raises(ValueError, match=r"norm_output True -> False, draft_vocab_size 1024 -> 128"):
        train_drafter([], other, tiny_target, tmp_path / "run")
    assert ray.is_initialized() == started
