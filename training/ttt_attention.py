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
    packed: PackedSegments | None = None  # the compact queries' segments side by side (``compact``)

    def layout(self, first: torch.Tensor) -> None:
        """The rows' segments from each index's first visible key (B, L), once per batch (``segments``; None:
        one segment per row)."""
        if self.span is None:
            self.span = attention_span(first)
            self.segments = None if 2 * self.span >= first.shape[-1] else segments(first, self.span)

    def compact(self, rows: torch.Tensor, cols: torch.Tensor, doc_ids: torch.Tensor) -> None:
        """Ask queries only at indices (rows, cols), sorted row-major, of the (B, L) documents' batch: the
        first step still takes keys at every index, its queries and every later step on this (1, N) layout,
        all segments in one padded batch (``PackedSegments``)."""
        first = doc_starts(doc_ids)
        self.layout(first)
        batch, length = doc_ids.shape
        segs = self.segments or [(r, 0, length) for r in range(batch)]
        self.queries = (rows, cols)
        self.packed = PackedSegments.build(segs, rows, cols, first)

    def query_subset(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) when the next step's keys are full-width but its queries compact (the first step
        after ``compact``), else None."""
        return self.queries if self.queries is not None and not self.keys else None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys.append(k)
        self.values.append(v)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class PackedSegments:
    """The compact queries' segments side by side, padded to the widest: one batched attention for all of
    them instead of a few dozen small kernels per segment, which cost more than the segments' arithmetic.

    Slot i of segment s holds compact query ``query[s, i]`` and key slot j its segment's key ``key[s, j]``
    (flat row * L + index); padded slots point at index 0 and are masked (a padded query sees no key, so its
    softmax goes to its diagonal keys, and its output is never read)."""

    query: torch.Tensor  # (S, n) long: compact index of each query slot
    key: torch.Tensor  # (S, w) long: flat (row * L + index) step-0 key of each key slot
    mask: torch.Tensor  # (S, 1, n, w) bool: query slot sees key slot (same document, not after it)
    slot: torch.Tensor  # (N,) long: flat (s * n + i) slot of each compact query

    @classmethod
    def build(cls, segs: list[tuple[int, int, int]], rows: torch.Tensor, cols: torch.Tensor, first: torch.Tensor
              ) -> PackedSegments:
        length, dev = first.shape[-1], rows.device
        seg = torch.tensor(segs, device=dev).reshape(-1, 3)
        r, a, b = seg.unbind(-1)
        ca, cb = torch.searchsorted(rows * length + cols, torch.stack([r * length + a, r * length + b], -1)).unbind(-1)
        keep = cb > ca  # segments with no trained index ask nothing
        r, a, b, ca, cb = r[keep], a[keep], b[keep], ca[keep], cb[keep]
        n, w = int((cb - ca).max()) if len(r) else 1, int((b - a).max()) if len(r) else 1
        i, j = torch.arange(n, device=dev), torch.arange(w, device=dev)
        q_ok, k_ok = i < (cb - ca)[:, None], j < (b - a)[:, None]
        query = torch.where(q_ok, ca[:, None] + i, 0)
        kpos = torch.where(k_ok, a[:, None] + j, 0)
        qpos, qfirst = cols[query], first[r[:, None], cols[query]]
        mask = (q_ok[:, :, None] & k_ok[:, None, :] & (kpos[:, None, :] >= qfirst[:, :, None])
                & (kpos[:, None, :] <= qpos[:, :, None]))
        slot = (torch.arange(len(r), device=dev)[:, None] * n + i)[q_ok]
        return cls(query, r[:, None] * length + kpos, mask[:, None], slot)


def doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) document ids (-1 = padding) -> (B, L) the start of each index's document (padding: itself):
    ``first_visible(step0_mask(doc_ids))`` in O(L), since a packed row's documents are contiguous runs."""
    idx = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]) | (doc_ids[:, 1:] < 0)
    return torch.where(new, idx, 0).cummax(-1).values


def step0_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) document ids (-1 = padding) -> (B, 1, L, L) bool mask: causal within a document.

    Padding tokens see only themselves so no softmax row is empty."""
    length = doc_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=doc_ids.device).tril()
    same_doc = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, None, :] >= 0)
    eye = torch.eye(length, dtype=torch.bool, device=doc_ids.device)
    return ((same_doc & causal) | eye)[:, None]


def first_visible(mask0: torch.Tensor) -> torch.Tensor:
    """(B, L): the first key each query of a (B, 1, L, L) step-0 mask sees (every row sees itself)."""
    return mask0[:, 0].to(torch.uint8).argmax(-1)


def attention_span(first: torch.Tensor) -> int:
    """1 + the largest distance from a query back to a key it may see, given each index's first visible key
    (B, L) (``first_visible`` of a step-0 mask, or ``doc_starts``)."""
    return int((torch.arange(first.shape[-1], device=first.device) - first).max()) + 1


def segments(first: torch.Tensor, width: int) -> list[tuple[int, int, int]]:
    """(row, start, end) cuts of each row, given each index's first visible key (B, L), into runs of whole
    documents (a cut where a query sees no key before itself), each at most ``width`` wide unless one
    document is wider: no query of a segment sees a key outside it."""
    b, length = first.shape
    starts = first == torch.arange(length, device=first.device)
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
    mask0: torch.Tensor | None,
) -> torch.Tensor:
    """Attend query q (B, h, L, d) over the cache after adding this step's (k, v).

    Scores against step-0 keys use `mask0`; each later step contributes one score per index
    (its key at the same index). A joint softmax over both parts keeps this exactly equal to
    attention over all (k+1)L keys with the TTT mask. Rows of several documents are done per segment.
    After ``cache.compact``, q is on its (1, h, N, d) layout, and so are k and v of the steps after the first;
    the cache then holds the documents' masks and `mask0` is not read."""
    cache.append(k, v)
    if cache.packed is not None:
        return _attend_packed(q, cache, cache.packed)
    if cache.span is None:
        cache.layout(first_visible(mask0))
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


def _attend_packed(q: torch.Tensor, cache: StepKVCache, packed: PackedSegments) -> torch.Tensor:
    """Compact queries (1, h, N, d) against their segment's step-0 keys (B, h, L, d) and their own later-step
    keys (on the compact layout), every segment in one padded batch (S, h, n|w, d)."""

    def flat(t: torch.Tensor) -> torch.Tensor:  # (B, h, L, d) -> (B * L, h, d)
        return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[-1])

    def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # -> (S, h, n|w, d)
        return flat(t).index_select(0, index.flatten()).view(*index.shape, *t.shape[1:2], t.shape[-1]).transpose(1, 2)

    out = _joint_softmax(take(q, packed.query), take(cache.keys[0], packed.key), take(cache.values[0], packed.key),
                         packed.mask, [take(k, packed.query) for k in cache.keys[1:]],
                         [take(v, packed.query) for v in cache.values[1:]])
    return flat(out).index_select(0, packed.slot).transpose(0, 1)[None]


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
