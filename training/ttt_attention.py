"""Attention for training-time test (TTT): step-0 keys causal, later-step keys on the diagonal only.

At inference a draft chain that starts at index t sees the prefix keys (computed from the target's
hidden states, i.e. step 0) up to t, plus the keys of its own earlier draft steps. Training unrolls
every chain in parallel, so step k's query at index t attends to:
  * step-0 keys at indices s <= t of the same document (`step0_mask`), and
  * keys produced by steps 1..k at index t only (the "diagonal").
The cache keeps one (K, V) pair per step; the diagonal keys need only a dot product per index, so
memory stays O(L^2 + k*L) instead of O(k*L^2) for an explicit (k+1)L-wide mask.

A packed row holds many short documents, and no query sees a key before its document's start. So the
rows are cut into segments of whole documents, each at most S wide (S: the longest document), and each
segment attends within itself only: sum of w^2 scores instead of L^2 (a 2,048-token row of ~150-token
samples: ~9x fewer), and ~2.5x fewer than chunks of S queries against the 2S-1 keys before them. Keys
outside a segment are masked in the dense form anyway, so the result is the same.

Queries are needed only at the indices some step trains (``StepKVCache.compact``): a prompt index's
chain is never scored, and its step-0 key is all that any query reads of it. So the first step takes
keys at every index but queries on a compact (1, N) layout of just the trained indices, and the later
steps run wholly on that layout; each query still attends its own segment's step-0 keys and its own
diagonal, so values and gradients at the kept indices are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepKVCache:
    """Per-TTT-step keys/values, each (B, heads, L, head_dim), in step order."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    span: int | None = None  # longest reach of a query into earlier keys (set once per batch by ``layout``)
    segments: list[tuple[int, int, int]] | None = None  # (row, start, end) of each segment (``segments``)
    queries: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, cols) of the compact queries
    ranges: list[tuple[int, int, int, int, int]] = field(default_factory=list)  # (row, a, b, ca, cb) per segment

    def layout(self, mask0: torch.Tensor) -> None:
        """The rows' segments, once per batch (``segments``; None: one segment per row)."""
        if self.span is None:
            first = first_visible(mask0)
            self.span = attention_span(mask0, first)
            self.segments = None if 2 * self.span >= mask0.shape[-1] else segments(mask0, self.span, first)

    def compact(self, rows: torch.Tensor, cols: torch.Tensor, mask0: torch.Tensor) -> None:
        """Ask queries only at indices (rows, cols), sorted row-major, of the (B, 1, L, L) mask's batch: the
        first step still takes keys at every index, its queries and every later step on this (1, N) layout.
        Each segment's queries are the contiguous run [ca, cb) of it."""
        self.layout(mask0)
        batch, length = mask0.shape[0], mask0.shape[-1]
        segs = self.segments or [(r, 0, length) for r in range(batch)]
        edges = torch.tensor([[r * length + a, r * length + b] for r, a, b in segs], device=rows.device)
        bounds = torch.searchsorted(rows * length + cols, edges).tolist()
        self.queries = (rows, cols)
        self.ranges = [(r, a, b, ca, cb) for (r, a, b), (ca, cb) in zip(segs, bounds, strict=True) if cb > ca]

    def query_subset(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) when the next step's keys are full-width but its queries compact (the first step
        after ``compact``), else None."""
        return self.queries if self.queries is not None and not self.keys else None

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


def first_visible(mask0: torch.Tensor) -> torch.Tensor:
    """(B, L): the first key each query of a (B, 1, L, L) step-0 mask sees (every row sees itself)."""
    return mask0[:, 0].to(torch.uint8).argmax(-1)


def attention_span(mask0: torch.Tensor, first: torch.Tensor | None = None) -> int:
    """1 + the largest distance from a query back to a key it may see, over a (B, 1, L, L) step-0 mask
    (``first``: its ``first_visible``, when already computed)."""
    first = first_visible(mask0) if first is None else first
    return int((torch.arange(mask0.shape[-1], device=mask0.device) - first).max()) + 1


def segments(mask0: torch.Tensor, width: int, first: torch.Tensor | None = None) -> list[tuple[int, int, int]]:
    """(row, start, end) cuts of each row of a (B, 1, L, L) step-0 mask into runs of whole documents (a
    cut where a query sees no key before itself), each at most ``width`` wide unless one document is
    wider: no query of a segment sees a key outside it. ``first``: the mask's ``first_visible``."""
    b, length = mask0.shape[0], mask0.shape[-1]
    first = first_visible(mask0) if first is None else first
    starts = first == torch.arange(length, device=mask0.device)
    out = []
    for row in range(b):
        cuts = [*starts[row].nonzero().flatten().tolist(), length]
        a = 0
        for prev, cut in zip(cuts, cuts[1:], strict=False):
            if cut - a > width and prev > a:  # the document that ends at `cut` would overfill: close before it
                out.append((row, a, prev))
                a = prev
        out.append((row, a, length))
    return out


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
    attention over all (k+1)L keys with the TTT mask. Rows of several documents are done per segment.
    After ``cache.compact``, q is on its (1, h, N, d) layout, and so are k and v of the steps after the first."""
    cache.append(k, v)
    cache.layout(mask0)
    if cache.queries is not None:
        return _attend_compact(q, cache, mask0)
    if cache.segments is None:
        return _attend(q, cache, mask0, slice(None), 0, q.shape[-2])
    by_row = [torch.cat([_attend(q, cache, mask0, row, a, b) for r, a, b in cache.segments if r == row], dim=-2)
              for row in range(q.shape[0])]
    return torch.stack(by_row)


def _attend(q: torch.Tensor, cache: StepKVCache, mask0: torch.Tensor, row: int | slice, a: int, b: int
            ) -> torch.Tensor:
    """Queries [a, b) of ``row`` (one index, or every row) against step-0 keys [a, b) and their own
    later-step keys."""
    return _joint_softmax(q[row, ..., a:b, :], cache.keys[0][row, ..., a:b, :], cache.values[0][row, ..., a:b, :],
                          mask0[row, ..., a:b, a:b], [kv[row, ..., a:b, :] for kv in cache.keys[1:]],
                          [kv[row, ..., a:b, :] for kv in cache.values[1:]])


def _attend_compact(q: torch.Tensor, cache: StepKVCache, mask0: torch.Tensor) -> torch.Tensor:
    """Compact queries (1, h, N, d), segment by segment, against their segment's step-0 keys and their own
    later-step keys (stored on the same compact layout)."""
    cols = cache.queries[1]
    outs = [_joint_softmax(q[0, :, ca:cb], cache.keys[0][r, :, a:b], cache.values[0][r, :, a:b],
                           mask0[r, 0, cols[ca:cb], a:b], [kv[0, :, ca:cb] for kv in cache.keys[1:]],
                           [kv[0, :, ca:cb] for kv in cache.values[1:]])
            for r, a, b, ca, cb in cache.ranges]
    return torch.cat(outs, dim=-2)[None] if outs else q.new_zeros(q.shape)


def _joint_softmax(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask: torch.Tensor,
                   diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Queries (..., n, d) against step-0 keys (..., w, d) under ``mask`` (n, w broadcastable) and one
    diagonal key per later step (..., n, d), in one softmax."""
    scale = q.shape[-1] ** -0.5
    scores0 = (q @ k0.transpose(-1, -2)) * scale
    scores0 = scores0.masked_fill(~mask, torch.finfo(scores0.dtype).min)
    diag = [(q * kj).sum(-1, keepdim=True) * scale for kj in diag_k]
    probs = torch.softmax(torch.cat([scores0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    width = k0.shape[-2]
    out = probs[..., :width] @ v0
    for j, vj in enumerate(diag_v):
        out = out + probs[..., width + j : width + j + 1] * vj
    return out
