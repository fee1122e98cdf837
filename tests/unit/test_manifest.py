"""The run manifest: which setting changes make a resume unsafe, and which are allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.base.config import ChecksConfig
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.run.manifest import (
    MANIFEST_FILE,
    ManifestMismatch,
    check_or_write_manifest,
    differences,
    model_fingerprint,
    run_manifest,
)
from tests.helpers.configs import formats_config


@pytest.fixture
def cfg(repo_root: Path, tmp_path: Path):
    cfg = formats_config(repo_root, tmp_path)
    model = tmp_path / "model"
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "tokenizer.json").write_text('{"model": {}}')
    (model / "model.safetensors").write_bytes(b"\x00" * 64)
    return cfg


def _resume(cfg) -> None:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_or_write_manifest(cfg, out, has_samples=True)


def test_fresh_folder_gets_a_manifest_and_an_identical_resume_passes(cfg):
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    written = check_or_write_manifest(cfg, out, has_samples=False)
    assert json.loads((out / MANIFEST_FILE).read_text()) == written
    assert written["model"]["weights"]["model.safetensors"] != 64  # small weights are hashed, not sized
    _resume(cfg)


@pytest.mark.parametrize("change, expected", [
    (lambda c: setattr(c.sampling, "temperature", 0.6), "sampling.temperature: 1.0 -> 0.6"),
    (lambda c: setattr(c.sampling, "max_tokens", 7), "sampling.max_tokens"),
    (lambda c: setattr(c.model, "profile", "qwen3"), "profile: 'deepseek' -> 'qwen3'"),
    (lambda c: setattr(c.datasets[0], "thinking", not c.datasets[0].thinking), "thinking."),
    (lambda c: (Path(c.model.path) / "model.safetensors").write_bytes(b"\x01" * 64), "model.weights.model.safetensors"),
    (lambda c: (Path(c.model.path) / "tokenizer.json").write_text("{}"), "model.tokenizer.tokenizer.json"),
    (lambda c: setattr(c.extraction, "aux_layer_ids", [0, 1, 2]), "extraction.aux_layer_ids"),
])
def test_changes_that_alter_samples_are_refused(cfg, change, expected):
    _resume(cfg)
    change(cfg)
    with pytest.raises(ManifestMismatch) as err:
        _resume(cfg)
    assert expected in str(err.value)
    assert "new output_dir" in str(err.value)


def test_scaling_budgets_checks_and_new_sources_may_change(cfg):
    _resume(cfg)
    cfg.sources[0].num_actors = 3
    cfg.datasets[0].checks.repetition = "flag"
    cfg.training.steps = 5
    cfg.sources.append(OpenRouterSourceConfig(name="api", model="m", budgets={"x": 10}))
    _resume(cfg)
    cfg.sources[-1].budgets = {"x": 99}
    cfg.sources[-1].num_actors = 9
    _resume(cfg)
    cfg.sources[-1].model = "other/model"
    with pytest.raises(ManifestMismatch, match="sources.api.model: 'm' -> 'other/model'"):
        _resume(cfg)


def test_a_folder_made_before_checks_rebuild_existed_resumes_under_every_rebuild_mode(cfg):
    """``checks.rebuild`` came after some run folders: their config never named it and their manifest never
    recorded checks. A check's mode does not change what a finished sample holds, so the old manifest matches the
    new default config (rebuild: quarantine) and any other rebuild mode too."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    old_checks = {k: v for k, v in cfg.datasets[0].checks.model_dump().items() if k != "rebuild"}
    for d in cfg.datasets:  # the config as a folder made before the field was read it
        d.checks = ChecksConfig.model_validate(old_checks)
    check_or_write_manifest(cfg, out, has_samples=False)
    old = json.loads((out / MANIFEST_FILE).read_text())
    assert "checks" not in old and "rebuild" not in json.dumps(sorted(_keys(old)))
    for mode in ("quarantine", "flag", "off"):
        for d in cfg.datasets:
            d.checks = ChecksConfig.model_validate({**old_checks, "rebuild": mode})
        assert differences(old, run_manifest(cfg)) == []
        _resume(cfg)
        assert json.loads((out / MANIFEST_FILE).read_text()) == old


def _keys(d):
    """Every key of a nested manifest."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield k
            yield from _keys(v)
    elif isinstance(d, list):
        for v in d:
            yield from _keys(v)


def test_folder_without_samples_takes_the_new_settings(cfg):
    out = Path(cfg.output_dir)
    out.mkdir(parents=True)
    check_or_write_manifest(cfg, out, has_samples=False)
    cfg.sampling.temperature = 0.3
    check_or_write_manifest(cfg, out, has_samples=False)  # nothing written yet: nothing to mix
    assert json.loads((out / MANIFEST_FILE).read_text())["sampling"]["temperature"] == 0.3


def test_large_weights_are_fingerprinted_by_size(tmp_path, monkeypatch):
    import pipeline.run.manifest as manifest

    (tmp_path / "model-00001.safetensors").write_bytes(b"\x00" * 100)
    monkeypatch.setattr(manifest, "FULL_HASH_LIMIT", 10)
    assert model_fingerprint(str(tmp_path))["weights"] == {"model-00001.safetensors": 100}
    assert model_fingerprint(None) == {"path": None}


def test_differences_lists_every_changed_leaf():
    old = {"a": 1, "b": {"c": 2, "d": 3}, "sources": [{"name": "s", "x": 1}]}
    new = {"a": 1, "b": {"c": 5}, "sources": [{"name": "s", "x": 2}, {"name": "t", "x": 0}]}
    assert differences(old, new) == ["b.c: 2 -> 5", "b.d: 3 -> '<absent>'", "sources.s.x: 1 -> 2"]
