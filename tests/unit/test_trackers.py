"""Training trackers: TensorBoard event files from a short in-process training run (read back with
TensorBoard's own EventAccumulator), the run report's summary, and W&B / MLflow skipped or wired."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.base.layout import RunLayout
from tests.helpers.training import TINY_AUX_LAYER_IDS, build_tiny_llama, generated_rows, random_prompts, torch_threads
from training import trackers as trk
from training.config import DraftTrainConfig
from training.trackers import TENSORBOARD_DIR, Trackers, log_run_summary, open_trackers, report_scalars, scalars


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard would show for ``log_dir``: tag -> [(step, value)] (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tb-target"), seed=0)


@pytest.fixture(scope="module")
def rows(small_target):
    with torch_threads(1):
        return generated_rows(small_target, random_prompts(8, 1000, (6, 12), seed=3), 16, TINY_AUX_LAYER_IDS)


def cfg(**kw) -> DraftTrainConfig:
    base = dict(steps=4, batch_tokens=128, max_len=64, draft_vocab_size=256, aux_layer_ids=TINY_AUX_LAYER_IDS,
                ttt_steps=2, warmup_steps=1, checkpoint_every=2, log_every=2, shuffle_buffer=8)
    return DraftTrainConfig(**{**base, **kw})


def test_a_short_training_run_writes_tensorboard_scalars(tmp_path, small_target, rows, monkeypatch):
    from training.train import train_loop
    from training.vocab import build_vocab_mapping

    monkeypatch.setattr(trk, "FLUSH_EVERY_S", 0.0)  # the killed attempt below must leave its events on disk
    c = cfg()
    vocab = build_vocab_mapping(rows, 1000, c.draft_vocab_size)
    out = tmp_path / "drafter"

    class Killed(Exception):
        pass

    def kill_at_3(step: int) -> None:
        if step == 3:
            raise Killed

    with torch_threads(1):
        with pytest.raises(Killed):  # logged steps 1-3, checkpoint at 2
            train_loop(c, small_target, out, lambda e: rows, vocab, after_step=kill_at_3)
        latest = sorted((out / "checkpoints").iterdir())[-1]
        assert latest.name == "step_0000002"
        train_loop(c, small_target, out, lambda e: rows, vocab, resume_from=latest)

    assert RunLayout(tmp_path).tensorboard == out / TENSORBOARD_DIR
    assert list((out / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    got = read_scalars(out / TENSORBOARD_DIR)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    expected = {"loss/total", "loss/position_0", "loss/position_1", "acc/position_0", "acc/position_1",
                "acceptance_est/position_0", "acceptance_est/position_1", "train/lr", "train/tokens_per_s",
                "train/grad_norm", "train/fill", "train/epoch"}
    assert expected <= set(got)
    for tag_name, key in [("loss/total", "loss"), ("acc/position_1", "acc_1"), ("train/lr", "lr"),
                          ("train/tokens_per_s", "tokens_per_s")]:
        # step 3 of the killed attempt was purged: each step once, with the values metrics.jsonl kept
        assert [s for s, _ in got[tag_name]] == [1, 2, 3, 4], tag_name
        assert [v for _, v in got[tag_name]] == pytest.approx([r[key] for r in records], rel=1e-5), tag_name
    est = [r["acc_0"] * r["acc_1"] for r in records]
    assert [v for _, v in got["acceptance_est/position_1"]] == pytest.approx(est, rel=1e-5, abs=1e-9)


def test_scalars_name_every_position_and_skip_non_numbers():
    m = {"step": 7, "epoch": 1, "loss": 3.0, "lr": 1e-4, "tokens_per_s": 900.0, "loss_0": 1.0, "acc_0": 0.5,
         "loss_1": 2.0, "acc_1": 0.25, "note": "x", "flag": True}
    s = scalars(m)
    assert s == {"train/epoch": 1.0, "loss/total": 3.0, "train/lr": 1e-4, "train/tokens_per_s": 900.0,
                 "loss/position_0": 1.0, "acc/position_0": 0.5, "loss/position_1": 2.0, "acc/position_1": 0.25,
                 "acceptance_est/position_0": 0.5, "acceptance_est/position_1": 0.125}


REPORT = {
    "rows_in": 10, "passed": 7, "quarantined": 2, "not_generated": 1, "tokens_generated": 900,
    "quarantine_reasons": {"roundtrip": 1, "api: HTTP 400 (context) 'too long'": 1},
    "quarantine_by_stage": {"validate": 2}, "flagged": {"truncated": 3},
    "this_attempt": {"cost_usd": 0.25},
    "sources": {"api": {"kind": "openrouter", "served": 4, "spilled": 0, "left_to_do": {"budget": 1}},
                "vllm": {"kind": "vllm", "served": 3, "spilled": 1, "left_to_do": {}}},
    "spend": {"api": {"datasets": {"chat": {"spent": 500, "cost": 0.2}, "code": {"spent": 100, "cost": 0.05}}}},
    "audit": {"billing": {"mean_abs_diff": 0.5}},
    "throughput": {"samples_per_s": 1.5, "tokens_per_s": 80.0, "series": [{"t": 1.0}]},
    "seconds": {"generate": 9.0, "extract+train": 3.0},
    "costs": {"by_dataset": {"chat": {"usd": 0.2, "device_hours": 0.0}, "code": {"usd": 1.05, "device_hours": 0.5}}},
    "training": {"metrics": {"step": 12}, "heldout": {"samples": 4, "k": 2, "acceptance_length": 1.5,
                                                      "per_position": [0.4, 0.1],
                                                      "by_dataset": [{"name": "chat", "acceptance_length": 1.7},
                                                                     {"name": "code", "acceptance_length": 1.2}]},
                 "served": {"k": 2, "acceptance_length": 1.45, "per_position": [0.35, 0.1], "drafts": 20}},
}


def test_report_scalars_carry_the_data_side():
    s = report_scalars(REPORT)
    assert s["data/samples_per_source/api"] == 4 and s["data/samples_per_source/vllm"] == 3
    assert s["data/spend_usd/api"] == pytest.approx(0.25) and s["data/spend_tokens/api"] == 600
    assert s["data/quarantine_reason/roundtrip"] == 1
    assert s["data/quarantine_reason/api: HTTP 400 _context_ _too long_"] == 1  # a name MLflow accepts
    assert s["data/left_to_do_per_source/api"] == 1 and s["data/flagged/truncated"] == 3
    assert s["heldout/acceptance/position_0"] == 0.4 and s["heldout/acceptance_length"] == 1.5
    assert s["served/acceptance/position_0"] == 0.35 and s["served/acceptance_length"] == 1.45
    assert s["throughput/samples_per_s"] == 1.5 and "throughput/series" not in s
    assert s["seconds/extract_train"] == 3.0
    assert s["heldout/by_dataset/code/acceptance_length"] == 1.2 and "heldout/by_source/chat/acceptance_length" not in s
    assert s["data/cost_usd_per_dataset/code"] == 1.05 and s["data/device_hours_per_dataset/code"] == 0.5


def test_run_summary_lands_in_tensorboard_at_the_last_step(tmp_path):
    names = log_run_summary(cfg(), tmp_path, REPORT)
    assert names == ["tensorboard"]
    got = read_scalars(tmp_path / TENSORBOARD_DIR)
    assert got["data/samples_per_source/api"] == [(12, 4.0)]
    assert got["heldout/acceptance/position_1"] == [(12, pytest.approx(0.1))]


def test_publish_report_writes_the_page_and_the_summary(tmp_path):
    from pipeline.report.publish import publish_report

    layout = RunLayout(tmp_path)
    publish_report(SimpleNamespace(training=cfg()), layout, REPORT)
    assert layout.report_html.read_text().startswith("<!DOCTYPE html>")
    assert read_scalars(layout.tensorboard)["data/passed"] == [(12, 7.0)]


def _one_line_warnings(caplog) -> list[str]:
    msgs = [r.getMessage() for r in caplog.records if r.name == "training.trackers" and r.levelno == logging.WARNING]
    assert all("\n" not in m for m in msgs)
    return msgs


def test_unconfigured_trackers_are_skipped_with_one_line_each(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with caplog.at_level(logging.WARNING, logger="training.trackers"):
        t = open_trackers(cfg(trackers=["tensorboard", "wandb", "mlflow"]), tmp_path)
    assert t.names == ["tensorboard"]
    t.close()
    msgs = _one_line_warnings(caplog)
    assert len(msgs) == 2
    assert "tracker wandb skipped: not configured" in msgs[0] and "training.wandb_project" in msgs[0]
    assert "tracker mlflow skipped: not configured" in msgs[1] and "training.mlflow_tracking_uri" in msgs[1]


def test_uninstalled_trackers_are_skipped_with_one_line_each(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed, whatever this machine has
    monkeypatch.setitem(sys.modules, "mlflow", None)
    c = cfg(trackers=["wandb", "mlflow"], wandb_project="p", mlflow_tracking_uri=str(tmp_path / "mlruns"))
    with caplog.at_level(logging.WARNING, logger="training.trackers"):
        t = open_trackers(c, tmp_path)
    assert t.names == []
    msgs = _one_line_warnings(caplog)
    assert msgs == ["tracker wandb skipped: the wandb package is not installed (pip install wandb)",
                    "tracker mlflow skipped: the mlflow package is not installed (pip install mlflow)"]


def test_other_ranks_open_nothing(tmp_path):
    t = open_trackers(cfg(), tmp_path, rank=1)
    assert t.names == [] and not (tmp_path / TENSORBOARD_DIR).exists()


def test_a_failing_tracker_is_dropped_not_raised(caplog):
    class Broken:
        def log_metrics(self, step, metrics):
            raise OSError("disk full\nsecond line")

        def close(self):
            pass

    t = Trackers({"broken": Broken()})
    with caplog.at_level(logging.WARNING, logger="training.trackers"):
        t.log_metrics(1, {"loss": 1.0})
        t.log_metrics(2, {"loss": 1.0})
    assert t.names == []
    assert _one_line_warnings(caplog) == ["tracker broken failed in log_metrics and is dropped: disk full second line"]


def test_wandb_gets_the_tags_and_resumes_its_run(tmp_path, monkeypatch):
    """A stand-in ``wandb`` module: the calls the tracker makes, and the run id kept for a resume."""
    calls: list[tuple] = []

    class Run:
        id = "run-1"
        summary: dict = {}

        def log(self, metrics, step):
            calls.append(("log", step, dict(metrics)))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw["project"], kw["id"], kw["resume"]))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    c = cfg(trackers=["wandb"], wandb_project="drafters")
    t = open_trackers(c, tmp_path)
    t.log_metrics(3, {"step": 3, "loss": 2.0, "acc_0": 0.5})
    t.close()
    assert calls[0] == ("init", "drafters", None, "allow")
    assert calls[1] == ("log", 3, {"loss/total": 2.0, "acc/position_0": 0.5, "acceptance_est/position_0": 0.5})
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"wandb": "run-1"}
    log_run_summary(c, tmp_path, REPORT)
    assert calls[3] == ("init", "drafters", "run-1", "allow")  # the summary joins the training run
    assert Run.summary["data/samples_per_source/api"] == 4
