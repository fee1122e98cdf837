"""Drafter training that runs long or under Ray Train: learning, failed-run rerun, killed-worker restart, DDP."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers.training import (
    easy_run,
    generated_rows,
    kill_worker_at,
    random_prompts,
    small_cfg,
)
from training.config import DraftTrainConfig
from training.export import export_draft, load_exported
from training.train import train_drafter, train_loop
from training.vocab import build_vocab_mapping

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_training_improves_simulated_acceptance():
    run = easy_run()  # 60 steps on a 1000-token target's greedy outputs (shared with the vLLM test)
    assert run.metrics["acc_0"] > 0.25
    # measured 1.00 -> ~1.4 (k=3) on held-out prompts
    assert run.untrained.acceptance_length < 1.05
    assert run.trained.acceptance_length >= run.untrained.acceptance_length + 0.2, (run.untrained, run.trained)
    assert run.trained.per_position[0] >= run.trained.per_position[1] >= run.trained.per_position[2]


@pytest.mark.slow
def test_a_failed_run_rerun_with_the_same_out_dir_continues_from_its_checkpoint(
        tmp_path, ray_session, tiny_target, target_parts, tiny_rows):
    """The driver's view of a kill: the run fails (no restarts left), the user runs it again. Ray Train
    restores the run in OUT/ray/drafter and only the remaining steps run; the result is bit-identical
    to a run that was never interrupted. The rerun's vocab file is gone and it is handed another counted
    vocabulary: the checkpoint's own is kept (its weights were trained on those ids)."""
    import ray.train

    from training.train import VOCAB_FILE

    cfg = small_cfg(max_failures=0)
    with pytest.raises(ray.train.TrainingFailedError):
        train_drafter(tiny_rows, cfg, tiny_target, tmp_path / "run",
                      after_step=kill_worker_at(5, tmp_path / "run", cfg.checkpoint_every))
    vocab = build_vocab_mapping(tiny_rows, target_parts.vocab_size, cfg.draft_vocab_size)
    other = build_vocab_mapping(tiny_rows[:2], target_parts.vocab_size, cfg.draft_vocab_size)
    assert not torch.equal(other.d2t, vocab.d2t)
    (tmp_path / "run" / VOCAB_FILE).unlink()
    again = train_drafter(tiny_rows, cfg, tiny_target, tmp_path / "run", vocab=other)
    assert again.metrics["step"] == cfg.steps
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, cfg.steps + 1))
    reference, _ = train_loop(cfg, tiny_target, tmp_path / "ref", lambda e: tiny_rows, vocab)
    resumed = load_exported(again.export_dir, tiny_target)
    for k, v in reference.trainable_state_dict().items():
        torch.testing.assert_close(resumed.trainable_state_dict()[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
def test_ray_train_restarts_killed_worker_from_checkpoint(tmp_path, ray_session, tiny_target, target_parts, tiny_rows,
                                                          monkeypatch):
    import training.target
    from training.heldout import heldout_acceptance

    reads = []  # the driver's reads of the target's parts (the workers are other processes)
    read = training.target.load_target_parts
    monkeypatch.setattr(training.target, "load_target_parts", lambda d: reads.append(d) or read(d))
    rows = tiny_rows
    cfg = small_cfg(max_failures=1)
    vocab = build_vocab_mapping(rows, target_parts.vocab_size, cfg.draft_vocab_size)
    result = train_drafter(rows, cfg, tiny_target, tmp_path / "ray",
                           after_step=kill_worker_at(5, tmp_path / "ray", cfg.checkpoint_every))
    assert result.metrics["step"] == cfg.steps
    # the driver reads the parts once, after the fit, for the export; the held-out measure takes them as they are
    assert len(reads) == 1 and result.target is not None
    held = heldout_acceptance(result.export_dir, result.target, rows[:4], k=3)
    assert len(reads) == 1 and held["samples"] == 4 and held["drafts"] > 0
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, cfg.steps + 1))  # steps 4-5 of the killed attempt were re-run
    ray_drafter = load_exported(result.export_dir, tiny_target)
    reference, _ = train_loop(cfg, tiny_target, tmp_path / "ref", lambda e: rows, vocab)
    for k, v in reference.trainable_state_dict().items():
        torch.testing.assert_close(ray_drafter.trainable_state_dict()[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.slow
def test_heldout_acceptance_of_the_export_equals_the_in_memory_drafter(tmp_path):
    """Export -> load -> simulate gives the trained drafter's figure; bf16-bit rows (the compact extraction
    format) decode to nearly the same figure."""
    from pipeline.hidden.shards import to_bf16_bits
    from training.heldout import heldout_acceptance
    from training.target import read_target_config

    run = easy_run()
    export = export_draft(run.drafter, tmp_path / "export", target_config=read_target_config(run.target_dir))
    report = heldout_acceptance(export, run.target_dir, run.held_rows, k=3)
    assert report["samples"] == len(run.held_rows) and report["k"] == 3
    assert report["acceptance_length"] == pytest.approx(run.trained.acceptance_length, abs=1e-4)
    assert report["per_position"] == pytest.approx(run.trained.per_position, abs=1e-4)
    bf16 = [{**r, "aux_hidden": to_bf16_bits(np.asarray(r["aux_hidden"], np.float32)),
             "final_hidden": to_bf16_bits(np.asarray(r["final_hidden"], np.float32))} for r in run.held_rows]
    assert abs(heldout_acceptance(export, run.target_dir, bf16, k=3)["acceptance_length"]
               - report["acceptance_length"]) < 0.05
    assert heldout_acceptance(export, run.target_dir, [], k=3)["samples"] == 0


@pytest.fixture(scope="module")
def uneven_target_and_rows(tmp_path_factory):
    """A 1000-token target and two groups of its own greedy rows: ten ~120-token, ten ~25-token."""
    from tests.helpers.training import TINY_AUX_LAYER_IDS, TINY_TARGET, build_tiny_llama

    target = build_tiny_llama(tmp_path_factory.mktemp("ddp") / "target")
    vocab = TINY_TARGET["vocab_size"]
    long = generated_rows(target, random_prompts(10, vocab, (40, 60), seed=2), 64, TINY_AUX_LAYER_IDS)
    short = generated_rows(target, random_prompts(10, vocab, (8, 12), seed=1), 16, TINY_AUX_LAYER_IDS)
    rows = [dict(r, sample_id=f"long{i}") for i, r in enumerate(long)]
    rows += [dict(r, sample_id=f"short{i}") for i, r in enumerate(short)]
    return target, rows


@pytest.mark.slow
def test_ddp_workers_on_uneven_shards_share_epochs_and_resume_exactly(tmp_path, ray_session, uneven_target_and_rows):
    """Two DDP workers whose shards pack into different numbers of batches (one block of long rows, one of
    short). An epoch can only start on every worker together, so the worker that runs out first waits out
    the other's steps at zero weight instead of hanging both. Killed and resumed, the run ends bit-identical
    to an uninterrupted one."""
    import ray.data

    from tests.helpers.training import TINY_AUX_LAYER_IDS

    target, rows = uneven_target_and_rows
    cfg = DraftTrainConfig(steps=12, batch_tokens=256, max_len=128, draft_vocab_size=256, ttt_steps=2,
                           aux_layer_ids=TINY_AUX_LAYER_IDS, warmup_steps=1, checkpoint_every=4, log_every=6,
                           num_workers=2, resources_per_worker={"CPU": 0.5}, shuffle_buffer=8, max_failures=1)

    def dataset():  # two blocks: each worker's shard is one of them
        return ray.data.from_items(rows, override_num_blocks=2)

    def log(run: str) -> list[dict]:
        return [json.loads(ln) for ln in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    full = train_drafter(dataset(), cfg, target, tmp_path / "full")
    records = log("full")
    assert [r["step"] for r in records] == list(range(1, 13)) and full.metrics["step"] == 12
    assert records[-1]["epoch"] >= 2, "12 steps cycle the uneven shards several times"
    assert {r["active_ranks"] for r in records} == {1, 2}, "epoch tails where one worker waits"
    assert all((r["tokens"] == 0) == (r["fill"] == 0) for r in records)

    cut = train_drafter(dataset(), cfg, target, tmp_path / "cut",
                        after_step=kill_worker_at(6, tmp_path / "cut", cfg.checkpoint_every))
    assert [r["step"] for r in log("cut")] == list(range(1, 13))
    assert [r["loss"] for r in log("cut")] == [r["loss"] for r in records]
    a, b = load_exported(full.export_dir, target), load_exported(cut.export_dir, target)
    for k, v in a.trainable_state_dict().items():
        torch.testing.assert_close(b.trainable_state_dict()[k], v, rtol=0, atol=0, msg=k)
