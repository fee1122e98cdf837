"""The tiny target's two variants: what each writes, and that a build never clobbers another model."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.checks.validate import check_structure, check_tool_semantics
from pipeline.demo.tiny_model import (
    EOS_ID,
    THINK_END_ID,
    TOOL_MARKER_IDS,
    build_tiny_target,
    built_variant,
    recipe,
    weights_digest,
)
from pipeline.profiles import load_profile


@pytest.fixture(scope="module")
def well_formed(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = build_tiny_target(tmp_path_factory.mktemp("wf"), variant="well-formed")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_variants_are_recorded_and_rebuilt_on_change(tmp_path, tiny_target):
    assert built_variant(tiny_target) == "wild"
    build_tiny_target(tmp_path, variant="wild")
    wild = weights_digest(tmp_path)
    assert wild == weights_digest(tiny_target)  # byte-identical builds
    build_tiny_target(tmp_path)  # the default variant replaces the other one
    assert built_variant(tmp_path) == "well-formed" and weights_digest(tmp_path) != wild
    assert json.loads((tmp_path / "config.json").read_text())["tiny_target_variant"] == "well-formed"
    # a folder built by other code (another recipe) is rebuilt; one built by this code is kept
    stamp = (tmp_path / "model.safetensors").stat().st_mtime_ns
    build_tiny_target(tmp_path)
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tiny_target_recipe": "built-by-older-code"}))
    build_tiny_target(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tiny_target_recipe"] == recipe("well-formed")
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns != stamp
    with pytest.raises(ValueError, match="unknown tiny target variant 'tame'"):
        build_tiny_target(tmp_path / "x", variant="tame")
    assert not (tmp_path / "x").exists()


def test_a_folder_holding_another_model_is_never_overwritten(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}))
    (tmp_path / "model.safetensors").write_bytes(b"real weights")
    with pytest.raises(ValueError, match="not the tiny target; refusing to overwrite"):
        build_tiny_target(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == b"real weights"


def _next_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_state_channels_gate_the_format_tokens(well_formed):
    path, model = well_formed
    profile = load_profile("deepseek", str(path))
    thinking = profile.render_prompt([{"role": "user", "content": "Why is the sky blue?"}], None, True).ids
    plain = profile.render_prompt([{"role": "user", "content": "Why is the sky blue?"}], None, False).ids
    assert thinking[-1] == profile.think_start_id and plain[-1] == THINK_END_ID
    reasoning = _next_logits(model, thinking)  # after <think>: reasoning state
    just_closed = _next_logits(model, plain)  # after </think>: content, but not the end of turn yet
    content = _next_logits(model, plain + [int(just_closed.argmax())])
    top = {name: float(lg.max()) for name, lg in (("r", reasoning), ("j", just_closed), ("c", content))}
    assert reasoning[THINK_END_ID] > top["r"] - 8 and reasoning[EOS_ID] < top["r"] - 40
    assert just_closed[THINK_END_ID] < top["j"] - 40 and just_closed[EOS_ID] < top["j"] - 40
    assert content[EOS_ID] > top["c"] - 8 and content[THINK_END_ID] < top["c"] - 40
    for lg, top_value in ((reasoning, top["r"]), (just_closed, top["j"]), (content, top["c"])):
        assert float(lg[list(TOOL_MARKER_IDS)].max()) < top_value - 40
        assert float(lg[sorted(profile.forbidden_output_ids)].max()) < top_value - 40
    # reasoning and content draw from disjoint halves of the vocabulary
    assert int(reasoning.argmax()) % 2 == 0 and int(content.argmax()) % 2 == 1


def test_sampled_responses_are_well_formed(well_formed):
    path, model = well_formed
    profile = load_profile("deepseek", str(path))
    from pipeline.base.config import ChecksConfig

    torch.manual_seed(0)
    finished = 0
    for i in range(12):
        thinking = i % 2 == 0
        prompt = profile.render_prompt([{"role": "user", "content": f"Question {i}: name a prime."}], None, thinking)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt.ids]), do_sample=True, temperature=1.0, top_p=1.0,
                                 max_new_tokens=96, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
        ids = out[0, len(prompt.ids):].tolist()
        sample = {"output_ids": ids, "prompt_ids": prompt.ids, "thinking": thinking, "tools": "",
                  "messages": "[]", "finish_reason": "stop" if ids[-1] == EOS_ID else "length"}
        assert check_structure(sample, profile, ChecksConfig()) is None, profile.decode(ids)
        assert check_tool_semantics(sample, profile, ChecksConfig()) is None
        if ids[-1] == EOS_ID:
            finished += 1
            assert ids.count(THINK_END_ID) == int(thinking)
    assert finished >= 9  # ~36 tokens on average against a 96-token cap


def test_is_built_says_whether_a_run_would_build(tmp_path):
    """The run shows a ``[build]`` line (minutes for a trained variant) only when there is something to build."""
    from pipeline.demo.tiny_model import build_tiny_target, is_built

    assert not is_built(tmp_path / "t", "well-formed")
    build_tiny_target(tmp_path / "t", variant="well-formed")
    assert is_built(tmp_path / "t", "well-formed") and not is_built(tmp_path / "t", "wild")
