"""Attention for training-time test (TTT): step-0 keys causal, later-step keys on the diagonal only.

At inference a draft chain that starts at index t sees the prefix keys (computed from the target's
hidden states, i.e. step 0) up to t, plus the keys of its own earlier draft steps. Training unrolls
every chain in parallel, so step k's query at index t attends to:
  * step-0 keys at indices s <= t of the same document (`step0_mask`), and
  * keys produced by steps 1..k at index t only (the "diagonal").
The cache keeps one (K, V) pair per step; the diagonal keys need only a dot product per index, so
memory stays O(L^2 + k*L) instead of O(k*L^2) for an explicit (k+1)L-wide mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepKVCache:
    """Per-TTT-step keys/values, each (B, heads, L, head_dim), in step order."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys.append(k)
        self.values.append(v)

    def __len__(self) -> int:
        return len(self.keys)


def step0_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) document ids (-1 = padding) -> (B, 1, L, L) bool mask: causal within a document.

    Padding tokens see only themselves so no softmax row is empty."""
    length = doc_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    eye = torch.eye(length, dtype=torch.bool, device=doc_ids.device)
    return ((same_doc & causal) | eye)[:, None]


def cached_step_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: StepKVCache,
    mask0: torch.Tensor,
) -> torch.Tensor:
    """Attend query q (B, h, L, d) over the cache after adding this step's (k, v).

    Scores against step-0 keys use `mask0`; each later step contributes one score per index
    (its key at the same index). A joint softmax over both parts keeps this exactly equal to
    attention over all (k+1)L keys with the TTT mask."""
    cache.append(k, v)
    scale = q.shape[-1] ** -0.5
    scores0 = (q @ cache.keys[0].transpose(-1, -2)) * scale
    scores0 = scores0.masked_fill(~mask0, torch.finfo(scores0.dtype).min)
    diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in cache.keys[1:]]
    probs = torch.softmax(torch.cat([scores0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    length = scores0.shape[-1]
    out = probs[..., :length] @ cache.values[0]
    for j, vj in enumerate(cache.values[1:]):
        out = out + probs[..., length + j : length + j + 1] * vj
    return out
