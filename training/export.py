"""Export the drafter as an EAGLE-3 checkpoint folder that vLLM/SGLang load with method `eagle3`.

The drafter's parameter names already are the checkpoint keys, so the weights file is its state
dict minus the frozen target embeddings (both engines share the target's embeddings). vLLM's loader
prefixes "model." to every name but lm_head's, so the EAGLE-3.1 norms `input_norm.weight` and
`fc_norm.{i}.weight` land on its `model.input_norm` / `model.fc_norm.{i}`. The structure flags that are on
go to config.json top-level under vLLM's names; an export with all of them off has exactly the plain
EAGLE-3 keys, so older engines keep loading it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from pipeline.base.layout import atomic_path, atomic_write_json
from training.config import ARCHITECTURE_FLAGS
from training.model import Eagle3Drafter, architecture_of

if TYPE_CHECKING:
    from training.target import TargetParts

ARCHITECTURE = "LlamaForCausalLMEagle3"
AUX_CONVENTION = "vllm: id i = input of target decoder layer i = HF output_hidden_states[i]"
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")


def export_config(drafter: Eagle3Drafter, target_config: dict, dtype: torch.dtype) -> dict:
    """config.json contents: a one-layer Llama shaped like the target, plus EAGLE-3 fields."""
    c = drafter.config
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(c.eagle_aux_hidden_state_layer_ids),
            "use_aux_hidden_state": True,
        },
        "aux_hidden_state_convention": AUX_CONVENTION,
    }
    cfg.update({flag: True for flag, on in architecture_of(c).items() if on})
    for key in _ROPE_KEYS:
        if target_config.get(key) is not None:
            cfg[key] = target_config[key]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in target_config:
            cfg[key] = target_config[key]
    return cfg


def export_tensors(drafter: Eagle3Drafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating weights in `dtype`; d2t (int64) and t2d (bool) unchanged. When the draft vocab
    is the whole target vocab the mapping is the identity and is left out, because vLLM then
    builds no `draft_id_to_target_id` parameter and would reject a `d2t` tensor."""
    out = {}
    for name, t in drafter.trainable_state_dict().items():
        out[name] = (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        out.pop("d2t")
        out.pop("t2d")
    return out


def export_draft(
    drafter: Eagle3Drafter,
    out_dir: str | Path,
    *,
    target_config: dict,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write model.safetensors, then config.json (each whole; a folder with config.json is a
    complete export, which ``pipeline status`` relies on); returns the folder. A previous export's config.json
    goes first: a kill while the new weights are written leaves no config beside them, never the old one."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(export_tensors(drafter, dtype), str(tmp), metadata={"format": "pt"})
    atomic_write_json(out / "config.json", export_config(drafter, target_config, dtype))
    return out


def load_exported(export_dir: str | Path, target_dir: str | Path | TargetParts | None = None) -> Eagle3Drafter:
    """Rebuild the drafter from an export folder (float32). Embeddings come from `target_dir` (or its
    already loaded parts) when given, else stay zero (the export has none)."""
    export_dir = Path(export_dir)
    raw = json.loads((export_dir / "config.json").read_text())
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "eagle_config", "torch_dtype")}
    config = LlamaConfig(**kwargs)
    config.draft_vocab_size = raw["draft_vocab_size"]
    config.target_hidden_size = raw["target_hidden_size"]
    config.eagle_aux_hidden_state_layer_ids = raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    for flag in ARCHITECTURE_FLAGS:  # as vLLM reads them: truthy top-level values, norm_before_fc first in eagle_config
        nested = raw["eagle_config"] if flag == "norm_before_fc" else {}
        setattr(config, flag, bool(nested.get(flag, raw.get(flag, False))))
    drafter = Eagle3Drafter(config)
    raw_tensors = load_file(str(export_dir / "model.safetensors"))
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in raw_tensors.items()}
    if "d2t" not in tensors:  # identity mapping (full vocab)
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    with torch.no_grad():
        drafter.embed_tokens.weight.zero_()
        if target_dir is not None:
            from training.target import as_target_parts

            drafter.embed_tokens.weight.copy_(as_target_parts(target_dir).embed_tokens)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    if missing != ["embed_tokens.weight"] or unexpected:
        raise KeyError(f"export mismatch: missing {missing}, unexpected {unexpected}")
    return drafter.eval()
