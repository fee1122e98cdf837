"""Extraction sizing: `load_config` and `check` refuse an extraction backend that cannot hold the target's
weights (read off the model folder's checkpoint index, or `model.weights_gb` away from the weights); an
engine backend with TP > 1 is placed like a vLLM source (a placement group of TP GPU bundles)."""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path

import pytest
import yaml

from pipeline.base.config import ConfigError, ExtractionConfig
from pipeline.base.sizing import checkpoint_bytes
from pipeline.run.config import load_config

ROOT = Path(__file__).resolve().parents[2]
BIG = 600 * 10**9  # bytes: a ~1T-parameter MoE in INT4


@pytest.fixture(autouse=True)
def _no_tokenizer_check(monkeypatch):
    """These folders hold a config and an index only (sizing reads nothing else); the tokenizer check that
    load_config also runs on a model folder is tested in test_profiles and test_config."""
    monkeypatch.setattr("pipeline.profiles.check_model_folder", lambda name, model_dir: None)


def fake_model(folder: Path, total_size: int | None = BIG) -> Path:
    """A model folder holding only a config.json and (optionally) a safetensors index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "hidden_size": 7168,
                                                    "num_hidden_layers": 61}))
    if total_size is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total_size}, "weight_map": {"model.norm.weight": "model-1.safetensors"}}))
    return folder


def run_config(tmp_path: Path, extraction: dict, model: dict | None = None, **top) -> Path:
    (tmp_path / "p.jsonl").write_text("{}\n")
    cfg = {"output_dir": "out", "model": model or {"profile": "kimi-k2.5", "path": "model"},
           "datasets": [{"name": "d", "path": "p.jsonl"}], "sources": [{"kind": "vllm", "name": "local"}],
           "extraction": extraction, **top}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def load(tmp_path: Path, extraction: dict, **kw):
    return load_config(run_config(tmp_path, extraction, **kw), base_dir=tmp_path)


def refusal(tmp_path: Path, extraction: dict, **kw) -> str:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, extraction, **kw)
    return str(err.value)


# --------------------------------------------------------------------------- weights of a folder


def test_checkpoint_size_from_the_index_then_the_files(tmp_path):
    assert checkpoint_bytes(fake_model(tmp_path / "indexed")) == (BIG, "model.safetensors.index.json "
                                                                       "metadata.total_size")
    bare = fake_model(tmp_path / "bare", total_size=None)
    assert checkpoint_bytes(bare) is None
    for i, size in enumerate((3 * 10**9, 4 * 10**9)):
        with open(bare / f"model-{i}.safetensors", "wb") as f:
            f.truncate(size)  # sparse: the size is what counts
    assert checkpoint_bytes(bare) == (7 * 10**9, "2 *.safetensors files")
    assert checkpoint_bytes(tmp_path / "missing") is None


# --------------------------------------------------------------------------- the check


def test_transformers_without_device_map_cannot_hold_a_large_target(tmp_path):
    fake_model(tmp_path / "model")
    msg = refusal(tmp_path, {"backend": "transformers", "num_gpus": 8})
    assert "extraction cannot hold the target: weights 600.0 GB (model.safetensors.index.json" in msg
    assert "> 1 GPU × 141 GB = 141 GB" in msg and "without device_map puts the whole model on one GPU" in msg
    assert "tensor_parallel_size 8" in msg  # what would fit: 600 / 141 -> 5 GPUs -> TP 8


def test_vllm_with_enough_tensor_parallelism_passes(tmp_path):
    fake_model(tmp_path / "model")
    cfg = load(tmp_path, {"backend": "vllm", "tensor_parallel_size": 8, "num_gpus": 8})
    assert cfg.sizing_misfit() is None
    msg = refusal(tmp_path, {"backend": "vllm", "tensor_parallel_size": 4, "num_gpus": 8})
    assert "weights 600.0 GB" in msg and "> 4 GPUs × 141 GB = 564 GB" in msg and "tensor_parallel_size 4" in msg
    # an H100 figure: 8 x 80 GB = 640 GB still holds 600 GB; 4 x 80 does not
    assert load(tmp_path, {"backend": "vllm", "tensor_parallel_size": 8, "num_gpus": 8, "gpu_memory_gb": 80})
    assert "4 GPUs × 80 GB = 320 GB" in refusal(tmp_path, {"backend": "vllm", "tensor_parallel_size": 4,
                                                           "num_gpus": 8, "gpu_memory_gb": 80})


def test_device_map_spreads_the_target_over_the_actors_gpus(tmp_path):
    fake_model(tmp_path / "model")
    assert load(tmp_path, {"backend": "transformers", "device_map": "auto", "num_gpus": 8})
    assert "4 GPUs × 141 GB" in refusal(tmp_path, {"backend": "transformers", "device_map": "auto", "num_gpus": 4})


def test_weights_gb_stands_in_away_from_the_weights_and_the_folder_wins(tmp_path):
    model = {"profile": "kimi-k2.5", "path": "absent", "weights_gb": 595}
    path = run_config(tmp_path, {"backend": "transformers", "num_gpus": 1}, model=model)
    with pytest.raises(ConfigError, match=r"weights 595.0 GB \(model.weights_gb\) > 1 GPU × 141 GB"):
        load_config(path, base_dir=tmp_path, check_paths=False)
    fake_model(tmp_path / "small", total_size=10 * 10**9)  # a readable folder wins over weights_gb
    path = run_config(tmp_path, {"backend": "transformers", "num_gpus": 1}, model={**model, "path": "small"})
    assert load_config(path, base_dir=tmp_path).sizing_misfit() is None


def test_cpu_extraction_and_unknown_sizes_are_not_checked(tmp_path):
    fake_model(tmp_path / "model")
    assert load(tmp_path, {"backend": "transformers", "num_gpus": 0})  # CPU: host memory, not checked
    path = run_config(tmp_path, {"backend": "transformers", "num_gpus": 1},
                      model={"profile": "kimi-k2.5", "path": "absent"})
    assert load_config(path, base_dir=tmp_path, check_paths=False).sizing_misfit() is None


# --------------------------------------------------------------------------- the shipped Kimi config


def _kimi(tmp_path: Path, **extraction) -> Path:
    raw = yaml.safe_load((ROOT / "configs" / "kimi_k25.yaml").read_text())
    raw = copy.deepcopy(raw)
    for k, v in extraction.items():
        if v is None:
            raw["extraction"].pop(k, None)
        else:
            raw["extraction"][k] = v
    path = tmp_path / "kimi.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_check_passes_the_kimi_config_and_refuses_it_with_transformers_extraction(tmp_path, capsys):
    from pipeline.run.cli import main

    assert main(["check", str(ROOT / "configs" / "kimi_k25.yaml"), "--no-paths"]) == 0
    out = capsys.readouterr().out
    assert "extraction sizing: weights 595.0 GB (model.weights_gb) <= 8 GPUs × 141 GB" in out
    assert "training: 2,540 steps, " in out and "defaults" not in out

    assert main(["check", str(_kimi(tmp_path, backend="transformers", tensor_parallel_size=None)), "--no-paths"]) == 2
    err = capsys.readouterr().err
    assert ("extraction cannot hold the target: weights 595.0 GB (model.weights_gb) > 1 GPU × 141 GB = 141 GB "
            "(backend transformers without device_map puts the whole model on one GPU)") in err
    # only the backend switched: TP 8 is refused first, naming the key
    assert main(["check", str(_kimi(tmp_path, backend="transformers")), "--no-paths"]) == 2
    assert "extraction.tensor_parallel_size 8 needs backend vllm" in capsys.readouterr().err


def test_kimi_extraction_is_a_tp8_engine_on_h200_nodes(repo_root):
    from pipeline.base.layout import RunLayout
    from pipeline.generate.sources.chain import ENGINE_ACTOR_ENV, placement_strategy
    from pipeline.hidden.handoff import Handoff, extraction_resources

    cfg = load_config(repo_root / "configs" / "kimi_k25.yaml", check_paths=False)
    ex = cfg.extraction
    assert (ex.backend, ex.tensor_parallel_size, ex.mode) == ("vllm", 8, "shards")
    res = extraction_resources(ex)
    assert res["num_cpus"] == 0 and res["num_gpus"] == 0  # the 8 bundles hold the GPUs
    fn = res["ray_remote_args_fn"]
    assert isinstance(fn, partial) and fn.func is placement_strategy and fn.args == (8, {"h200": 1.0})
    assert res["runtime_env"] == ENGINE_ACTOR_ENV  # the engine actor stops its engine itself when retired
    kw = Handoff(cfg, RunLayout(Path(cfg.output_dir)), [2, 30, 58], 0.01).extractor_kwargs()
    assert kw["backend"] == "vllm" and kw["vllm_options"]["tensor_parallel_size"] == 8
    assert kw["vllm_options"]["distributed_executor_backend"] == "ray"
    assert kw["vllm_options"]["enable_expert_parallel"] is True
    assert cfg.training.resources_per_worker["h100"] == 1


# --------------------------------------------------------------------------- placement and validation


def test_extraction_resources_without_tensor_parallelism_keep_the_actors_own():
    from pipeline.hidden.handoff import extraction_resources

    assert extraction_resources(ExtractionConfig(num_gpus=0.5)) == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert extraction_resources(ExtractionConfig(num_gpus=1, resources={"h200": 1})) == {
        "num_cpus": 1.0, "num_gpus": 1.0, "resources": {"h200": 1.0}}
    assert "runtime_env" in extraction_resources(ExtractionConfig(backend="vllm"))


def test_engine_sources_carry_custom_resources():
    from pipeline.generate.sources.chain import engine_resources, placement_strategy
    from pipeline.generate.sources.engines.config import SGLangSourceConfig, VLLMSourceConfig

    sglang = SGLangSourceConfig(num_gpus=8, tensor_parallel_size=8, resources={"h200": 8})
    assert engine_resources(sglang, ray_tp=False) == {"num_cpus": 1.0, "num_gpus": 8.0, "resources": {"h200": 8.0}}
    tp8 = engine_resources(VLLMSourceConfig(num_gpus=8, tensor_parallel_size=8, resources={"h200": 8}))
    assert tp8["ray_remote_args_fn"].args == (8, {"h200": 1.0})
    plain = engine_resources(VLLMSourceConfig(num_gpus=1, tensor_parallel_size=4))["ray_remote_args_fn"]
    assert plain.func is placement_strategy and plain.args == (4,)  # no custom resources: bundles as before


@pytest.mark.parametrize(("extraction", "top", "match"), [
    ({"backend": "transformers", "tensor_parallel_size": 8, "num_gpus": 8}, {}, "needs backend vllm"),
    ({"backend": "vllm", "tensor_parallel_size": 8}, {}, "needs num_gpus > 0"),
    ({"backend": "vllm", "num_gpus": 8, "vllm": {"tensor_parallel_size": 8}}, {},
     "set extraction.tensor_parallel_size"),
    ({"backend": "vllm", "tensor_parallel_size": 8, "num_gpus": 8, "mode": "stream"},
     {"training": {"materialize": False}}, "use extraction.mode shards"),
])
def test_tensor_parallel_extraction_rules(tmp_path, extraction, top, match):
    fake_model(tmp_path / "model")
    assert match in refusal(tmp_path, extraction, **top)


def test_tensor_parallel_stream_is_fine_when_materialized_once(tmp_path):
    fake_model(tmp_path / "model")
    assert load(tmp_path, {"backend": "vllm", "tensor_parallel_size": 8, "num_gpus": 8, "mode": "stream"},
                training={"materialize": True})
