"""Attention for training-time test (TTT): step-0 keys causal, later-step keys on the diagonal only.

At inference a draft chain that starts at index t sees the prefix keys (computed from the target's
hidden states, i.e. step 0) up to t, plus the keys of its own earlier draft steps. Training unrolls
every chain in parallel, so step k's query at index t attends to:
  * step-0 keys at indices s <= t of the same document (`step0_mask`), and
  * keys produced by steps 1..k at index t only (the "diagonal").
The cache keeps one (K, V) pair per step; the diagonal keys need only a dot product per index, so
memory stays O(L^2 + k*L) instead of O(k*L^2) for an explicit (k+1)L-wide mask.

A packed row holds many short documents, and no query sees a key further back than the longest
document. So queries are taken in chunks of that span S, each against the 2S-1 keys it can reach:
O(L*S) work instead of O(L^2) (a 2,048-token row of ~150-token samples: ~6x fewer scores). Keys
outside the window are masked in the dense form anyway, so the result is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepKVCache:
    """Per-TTT-step keys/values, each (B, heads, L, head_dim), in step order."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    span: int | None = None  # longest reach of a query into earlier keys (set on the first step)

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


def attention_span(mask0: torch.Tensor) -> int:
    """1 + the largest distance from a query back to a key it may see, over a (B, 1, L, L) step-0 mask."""
    length = mask0.shape[-1]
    first = mask0.to(torch.uint8).argmax(-1)  # first visible key per query (every row sees itself)
    return int((torch.arange(length, device=mask0.device) - first).max()) + 1


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
    attention over all (k+1)L keys with the TTT mask. Long rows are done in span-sized chunks."""
    cache.append(k, v)
    if cache.span is None:
        cache.span = attention_span(mask0)
    length, span = q.shape[-2], cache.span
    if 2 * span >= length:
        return _attend(q, cache, mask0, 0, length, 0)
    chunks = [_attend(q, cache, mask0, a, min(a + span, length), max(0, a - span + 1))
              for a in range(0, length, span)]
    return torch.cat(chunks, dim=-2)


def _attend(q: torch.Tensor, cache: StepKVCache, mask0: torch.Tensor, a: int, b: int, lo: int) -> torch.Tensor:
    """Queries [a, b) against step-0 keys [lo, b) and their own later-step keys."""
    qc = q[..., a:b, :]
    scale = q.shape[-1] ** -0.5
    scores0 = (qc @ cache.keys[0][..., lo:b, :].transpose(-1, -2)) * scale
    scores0 = scores0.masked_fill(~mask0[..., a:b, lo:b], torch.finfo(scores0.dtype).min)
    diag = [(qc * kj[..., a:b, :]).sum(-1, keepdim=True) * scale for kj in cache.keys[1:]]
    probs = torch.softmax(torch.cat([scores0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    width = b - lo
    out = probs[..., :width] @ cache.values[0][..., lo:b, :]
    for j, vj in enumerate(cache.values[1:]):
        out = out + probs[..., width + j : width + j + 1] * vj[..., a:b, :]
    return out
