"""Reduced draft vocabulary: the most frequent loss-masked target tokens, as vLLM's d2t/t2d tensors."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class VocabMapping:
    """`d2t[i] = target_id(i) - i` (int64, draft order = ascending target id); `t2d` marks kept ids."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft entry."""
        return torch.arange(self.d2t.numel()) + self.d2t


def count_loss_masked_tokens(rows: Iterable[dict], vocab_size: int) -> np.ndarray:
    """Frequency of each target id among tokens the loss trains on (loss_mask == 1)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for row in rows:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"]).astype(bool)
        counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def select_draft_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """Top-N ids by count (ties: lower id first); if fewer ids were seen, fill with the lowest
    unseen ids so the result is deterministic. Returned ascending."""
    vocab_size = counts.shape[0]
    n = min(draft_vocab_size, vocab_size)
    seen = np.flatnonzero(counts > 0)
    # lexsort: last key is primary -> sort by -count, then by id
    ranked = seen[np.lexsort((seen, -counts[seen]))][:n]
    if ranked.size < n:
        unseen = np.setdiff1d(np.arange(vocab_size), ranked, assume_unique=True)
        ranked = np.concatenate([ranked, unseen[: n - ranked.size]])
    return np.sort(ranked)


def mapping_from_ids(draft_ids: np.ndarray, vocab_size: int) -> VocabMapping:
    """Build d2t/t2d from ascending target ids."""
    ids = torch.as_tensor(np.asarray(draft_ids), dtype=torch.long)
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft ids must be strictly increasing")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return VocabMapping(d2t=ids - torch.arange(ids.numel()), t2d=t2d)


def build_vocab_mapping(rows: Iterable[dict], vocab_size: int, draft_vocab_size: int) -> VocabMapping:
    """Count loss-masked tokens in `rows` and keep the `draft_vocab_size` most frequent."""
    counts = count_loss_masked_tokens(rows, vocab_size)
    return mapping_from_ids(select_draft_ids(counts, draft_vocab_size), vocab_size)
