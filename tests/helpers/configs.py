"""Run configs the unit tests start from."""

from __future__ import annotations

from pathlib import Path

from pipeline.run.config import RunConfig, load_config


def formats_config(repo_root: Path, tmp_path: Path) -> RunConfig:
    """``configs/tiny_formats.yaml`` writing under ``tmp_path/out``, its model folder an empty ``tmp_path/model``
    (nothing loads a model: the tests write the run folder's files themselves)."""
    cfg = load_config(repo_root / "configs" / "tiny_formats.yaml", base_dir=repo_root, check_paths=False)
    cfg.output_dir = str(tmp_path / "out")
    model = tmp_path / "model"
    model.mkdir()
    cfg.model.path = str(model)
    return cfg
