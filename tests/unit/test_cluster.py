"""Running on a cluster: Ray's own cluster-config validation (no cluster is started here)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml


def _validate(config: dict) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


def test_cluster_yaml_passes_ray_validation(repo_root: Path):
    config = yaml.safe_load((repo_root / "cluster.yaml").read_text())
    _validate(config)
    types = config["available_node_types"]
    gpu_types = [t for t in types.values() if "min_workers" in t]
    assert gpu_types and all(t["max_workers"] >= t["min_workers"] for t in gpu_types)
    assert any("pip install" in c for c in config["setup_commands"])


def test_cluster_yaml_validation_rejects_unknown_keys(repo_root: Path):
    import jsonschema

    config = yaml.safe_load((repo_root / "cluster.yaml").read_text())
    config["head_node_typo"] = "head"
    with pytest.raises(jsonschema.ValidationError, match="head_node_typo"):
        _validate(config)


def test_kimi_production_config_validates(repo_root: Path):
    from pipeline.generate.router import build_router
    from pipeline.run.config import load_config

    cfg = load_config(repo_root / "configs" / "kimi_k25.yaml", check_paths=False)
    assert cfg.model.profile == "kimi-k2.5"
    assert cfg.extraction.aux_layer_ids == [2, 30, 58] == cfg.training.aux_layer_ids
    assert cfg.training.draft_vocab_size == 32000
    kinds = {s.kind: s for s in cfg.sources}
    assert kinds["sglang"].tensor_parallel_size == 8 and kinds["vllm"].tensor_parallel_size == 8
    api = kinds["openrouter"]
    api_datasets = [d.name for d in cfg.datasets if d.sources is None]
    assert api_datasets and all(api.budgets[d] == 10_000_000 for d in api_datasets)
    router = build_router(cfg.sources, cfg.datasets, cfg.routing, 1000)
    for i in range(200):
        row = {"sample_id": f"b1_tool_calls:{i}:x", "dataset": "b1_tool_calls", "tools": "[{}]", "status": "ok"}
        assert router.route(row) in {"sglang-h200", "vllm-h200"}


def test_check_command_reports_missing_paths(repo_root: Path):
    from pipeline.run.cli import main

    assert main(["check", str(repo_root / "configs" / "kimi_k25.yaml"), "--no-paths"]) == 0
    assert main(["check", str(repo_root / "configs" / "kimi_k25.yaml")]) == 2
