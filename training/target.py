"""Read the few target tensors the drafter needs (embeddings, lm_head, final norm) from a HF folder."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
NORM_KEY = "model.norm.weight"


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
    """The target's config.json as a dict."""
    return json.loads((Path(target_dir) / "config.json").read_text())


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


def load_target_parts(target_dir: str | Path) -> TargetParts:
    """Load embeddings, lm_head (tied embeddings allowed) and final norm as float32 CPU tensors."""
    target_dir = Path(target_dir)
    config = read_target_config(target_dir)
    where = _key_to_file(target_dir)

    def get(key: str) -> torch.Tensor | None:
        if key not in where:
            return None
        with safe_open(str(where[key]), "pt") as fh:
            return fh.get_tensor(key).float()

    embed = get(EMBED_KEY)
    if embed is None:
        raise KeyError(f"{EMBED_KEY} missing in {target_dir}")
    lm_head = get(LM_HEAD_KEY)
    if lm_head is None:
        if not config.get("tie_word_embeddings", False):
            raise KeyError(f"{LM_HEAD_KEY} missing in {target_dir}")
        lm_head = embed
    return TargetParts(config=config, embed_tokens=embed, lm_head=lm_head, final_norm=get(NORM_KEY))


@torch.no_grad()
def greedy_ids(final_hidden: torch.Tensor, lm_head: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Target argmax over the full vocab, chunked over positions to bound the (T, V) logits."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    w = lm_head.to(flat.device, flat.dtype)
    for s in range(0, flat.shape[0], chunk):
        out[s : s + chunk] = (flat[s : s + chunk] @ w.T).argmax(-1)
    return out.reshape(final_hidden.shape[:-1])
