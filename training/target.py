"""Read the few target tensors the drafter needs (embeddings, lm_head, final norm) from a HF folder.

Multimodal checkpoints (Kimi-K2.5: ``KimiK25ForConditionalGeneration``) nest the language model: its
config under ``text_config`` and its weights under ``language_model.`` (or ``model.language_model.`` in
newer transformers layouts). Everything here reads the language model's config and tensors, whichever
layout the folder has.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
NORM_KEY = "model.norm.weight"
# Where a multimodal checkpoint keeps the language model's tensors, tried in this order.
WEIGHT_PREFIXES = ("", "language_model.", "model.language_model.")


@dataclass
class TargetParts:
    """Frozen target pieces: embeddings feed the draft, lm_head defines the teacher distribution."""

    config: dict
    embed_tokens: torch.Tensor  # (V, H)
    lm_head: torch.Tensor  # (V, H)
    final_norm: torch.Tensor | None  # (H,)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])


def read_target_config(target_dir: str | Path) -> dict:
    """The target's language-model config: config.json, or its ``text_config`` when the model nests one."""
    return text_config(json.loads((Path(target_dir) / "config.json").read_text()))


def text_config(config: dict) -> dict:
    """The language model's part of a (possibly multimodal) config.json."""
    nested = config.get("text_config")
    return dict(nested) if isinstance(nested, dict) and "hidden_size" in nested else config


def weight_key(keys: Iterable[str], key: str) -> str | None:
    """``key`` (a language-model tensor name) as the checkpoint spells it, or None when absent."""
    have = set(keys)
    return next((p + key for p in WEIGHT_PREFIXES if p + key in have), None)


def _key_to_file(target_dir: Path) -> dict[str, Path]:
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: target_dir / f for k, f in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {target_dir}")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def read_target_tensor(target_dir: str | Path, key: str) -> torch.Tensor:
    """One language-model tensor (e.g. ``NORM_KEY``) as stored, without loading the rest of the checkpoint."""
    target_dir = Path(target_dir)
    where = _key_to_file(target_dir)
    if (stored := weight_key(where, key)) is None:
        raise KeyError(f"{key} not in {target_dir} (looked under prefixes {WEIGHT_PREFIXES})")
    with safe_open(str(where[stored]), "pt") as fh:
        return fh.get_tensor(stored)


def read_lm_head(target_dir: str | Path) -> torch.Tensor:
    """The output projection as stored: ``lm_head``, or the embeddings of a model that ties them."""
    try:
        return read_target_tensor(target_dir, LM_HEAD_KEY)
    except KeyError:
        if not read_target_config(target_dir).get("tie_word_embeddings", False):
            raise
        return read_target_tensor(target_dir, EMBED_KEY)


def load_target_parts(target_dir: str | Path) -> TargetParts:
    """Load embeddings, lm_head (tied embeddings allowed) and final norm as float32 CPU tensors."""
    target_dir = Path(target_dir)
    config = read_target_config(target_dir)
    where = _key_to_file(target_dir)

    def get(key: str) -> torch.Tensor | None:
        if (stored := weight_key(where, key)) is None:
            return None
        with safe_open(str(where[stored]), "pt") as fh:
            return fh.get_tensor(stored).float()

    embed = get(EMBED_KEY)
    if embed is None:
        raise KeyError(f"{EMBED_KEY} missing in {target_dir}")
    lm_head = get(LM_HEAD_KEY)
    if lm_head is None:
        if not config.get("tie_word_embeddings", False):
            raise KeyError(f"{LM_HEAD_KEY} missing in {target_dir}")
        lm_head = embed
    return TargetParts(config=config, embed_tokens=embed, lm_head=lm_head, final_norm=get(NORM_KEY))


def as_target_parts(target: str | Path | TargetParts) -> TargetParts:
    """``target`` itself when already loaded, else its parts read from the folder: the callers that need the
    parts twice in one process (train, export, held-out measure) pass them on instead of reading ~2 x V x H
    floats again (4.7 GB each for Kimi-K2.5's embeddings and lm_head in float32)."""
    return target if isinstance(target, TargetParts) else load_target_parts(target)


@torch.no_grad()
def greedy_ids(final_hidden: torch.Tensor, lm_head: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Target argmax over the full vocab, chunked over positions to bound the (T, V) logits."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    w = lm_head.to(flat.device, flat.dtype)
    for s in range(0, flat.shape[0], chunk):
        out[s : s + chunk] = (flat[s : s + chunk] @ w.T).argmax(-1)
    return out.reshape(final_hidden.shape[:-1])
