"""The walking skeleton end to end: one config, local Ray, vLLM CPU actor, validation, extraction, training."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.profiles import load_profile
from pipeline.records import QUARANTINE_SCHEMA, SAMPLE_SCHEMA

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, repo_root: Path, tiny_target: Path, ray_session):
    from pipeline.run import run

    out = tmp_path_factory.mktemp("run")
    cfg = load_config(repo_root / "configs" / "tiny.yaml", base_dir=repo_root)
    cfg.output_dir = str(out)
    cfg.model.path = str(tiny_target)
    cfg.sampling.max_tokens = 64
    cfg.training.steps = 12
    cfg.training.checkpoint_every = 6
    report = run(cfg)
    return cfg, out, report


def _read(folder: Path):
    return [r for f in sorted(folder.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]


def test_every_row_ends_passed_or_quarantined(tiny_run):
    cfg, out, report = tiny_run
    samples, quarantine = _read(out / "samples"), _read(out / "quarantine")
    assert report["rows_in"] == 68
    assert len(samples) + len(quarantine) == 68
    ids = [r["sample_id"] for r in samples] + [r["sample_id"] for r in quarantine]
    assert len(set(ids)) == 68
    assert report["passed"] == len(samples) and report["quarantined"] == len(quarantine)
    assert samples, "the tiny target should pass some samples"
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["passed"] == report["passed"]


def test_shards_have_the_documented_schema(tiny_run):
    _, out, _ = tiny_run
    for f in (out / "samples").glob("*.parquet"):
        assert pq.read_schema(f).names == SAMPLE_SCHEMA.names
    for f in (out / "quarantine").glob("*.parquet"):
        assert pq.read_schema(f).names == QUARANTINE_SCHEMA.names


def test_samples_hold_exact_engine_ids_and_checks(tiny_run, tiny_target):
    cfg, out, _ = tiny_run
    profile = load_profile("deepseek", str(tiny_target))
    for s in _read(out / "samples"):
        messages = json.loads(s["messages"])
        tools = json.loads(s["tools"]) if s["tools"] else None
        assert s["prompt_ids"] == profile.render_prompt(messages, tools, s["thinking"]).ids
        assert s["source"] == "vllm-cpu" and s["ids_from"] == "engine"
        ids = s["output_ids"]
        assert 0 < len(ids) <= 64
        assert s["truncated"] == (s["finish_reason"] == "length")
        if not s["truncated"]:
            assert ids[-1] == profile.eot_id
        assert s["checks_failed"] == []
        assert s["t_generate_s"] > 0


def test_quarantine_rows_carry_reasons(tiny_run):
    _, out, _ = tiny_run
    for q in _read(out / "quarantine"):
        assert q["reason"] and q["stage"] in {"read", "render", "generate", "validate", "extract"}
        detail = json.loads(q["detail"])
        if q["stage"] == "validate":
            assert detail["checks_failed"]


def test_drafter_is_trained_and_exported(tiny_run):
    _, out, report = tiny_run
    export = Path(report["training"]["export_dir"])
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (export / "model.safetensors").stat().st_size > 0
    assert report["training"]["metrics"]["step"] == 12


def test_rerun_resumes_without_regenerating(tiny_run):
    from pipeline.run import finished_ids, read_prompts

    cfg, out, report = tiny_run
    prompts, counts = read_prompts(cfg, out)
    assert prompts == []
    assert counts["resumed_done"] == len(finished_ids(out)) == 68
