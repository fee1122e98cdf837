"""The target's language model read from a multimodal checkpoint (Kimi-K2.5's layout: ``text_config`` in
config.json, tensors under ``language_model.``) gives what the flat folder gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from training.target import (
    NORM_KEY,
    load_target_parts,
    read_target_config,
    read_target_tensor,
    text_config,
)


@pytest.fixture(scope="module")
def nested_target(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target repackaged as a multimodal checkpoint, sharded with an index as real ones are."""
    out = tmp_path_factory.mktemp("nested-target")
    flat = json.loads((tiny_target / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": flat, "vision_config": {"hidden_size": 8}}))
    tensors = {f"language_model.{k}": v for k, v in load_file(str(tiny_target / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(8, 8)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(out / file))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    for f in tiny_target.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_text_config_is_the_language_models(tiny_target: Path, nested_target: Path):
    flat = read_target_config(tiny_target)
    assert read_target_config(nested_target) == flat
    assert text_config(flat) == flat  # a flat config is its own text config
    assert text_config({"text_config": {"model_type": "x"}, "hidden_size": 4})["hidden_size"] == 4


def test_tensors_found_under_the_language_model_prefix(tiny_target: Path, nested_target: Path):
    assert torch.equal(read_target_tensor(nested_target, NORM_KEY), read_target_tensor(tiny_target, NORM_KEY))
    flat, nested = load_target_parts(tiny_target), load_target_parts(nested_target)
    assert torch.equal(flat.embed_tokens, nested.embed_tokens) and torch.equal(flat.lm_head, nested.lm_head)
    assert torch.equal(flat.final_norm, nested.final_norm)
    assert (nested.hidden_size, nested.num_layers, nested.vocab_size) == (flat.hidden_size, flat.num_layers,
                                                                           flat.vocab_size)
    with pytest.raises(KeyError, match="language_model"):
        read_target_tensor(nested_target, "model.no_such.weight")
