"""Rows from the extraction stage -> validated samples -> packed fixed-shape batches.

Row contract: `sample_id` str, `input_ids` (T,) int, `loss_mask` (T,) 0/1, `aux_hidden` (T, 3*H_t)
float, `final_hidden` (T, H_t) float (after the target's final norm); states may also come as
bfloat16 bits in uint16 arrays (half the bytes in Ray's object store). Optional `target_ids` (T,)
int: the target's full-vocab argmax per position (computed from `final_hidden` when absent).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

REQUIRED_KEYS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")


@dataclass
class Sample:
    """One training sequence, truncated to `max_len`."""

    input_ids: np.ndarray  # (T,) int64
    loss_mask: np.ndarray  # (T,) bool
    aux_hidden: np.ndarray  # (T, 3*H_t) float32
    final_hidden: np.ndarray  # (T, H_t) float32
    target_ids: np.ndarray  # (T,) int64: target argmax at each position

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class Batch:
    """Packed batch of `rows` rows of `row_len` tokens; documents never attend across boundaries."""

    input_ids: torch.Tensor  # (B, L) int64
    loss_mask: torch.Tensor  # (B, L) bool
    doc_ids: torch.Tensor  # (B, L) int64, -1 = padding
    position_ids: torch.Tensor  # (B, L) int64, restart at 0 per document
    aux_hidden: torch.Tensor  # (B, L, 3*H_t)
    final_hidden: torch.Tensor  # (B, L, H_t)
    target_ids: torch.Tensor  # (B, L) int64

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{k: v.to(device, non_blocking=True) for k, v in vars(self).items()})


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as its uint16 bit pattern -> float32 (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def as_float32(states) -> np.ndarray:
    """Hidden states as float32; uint16 arrays are bfloat16 bits (extraction's compact row format)."""
    a = np.asarray(states)
    return from_bf16_bits(a) if a.dtype == np.uint16 else a.astype(np.float32, copy=False)


def to_sample(
    row: dict,
    max_len: int,
    target_ids_fn: Callable[[np.ndarray], np.ndarray] | None = None,
) -> Sample:
    """Validate one row against the contract and truncate it."""
    missing = [k for k in REQUIRED_KEYS if k not in row]
    if missing:
        raise KeyError(f"row {row.get('sample_id')!r} lacks {missing}")
    ids = np.asarray(row["input_ids"], dtype=np.int64).reshape(-1)
    length = ids.shape[0]
    aux, final = as_float32(row["aux_hidden"]), as_float32(row["final_hidden"])
    mask = np.asarray(row["loss_mask"]).reshape(-1).astype(bool)
    if aux.shape[0] != length or final.shape[0] != length or mask.shape[0] != length:
        raise ValueError(
            f"row {row.get('sample_id')!r}: lengths differ "
            f"(ids {length}, mask {mask.shape}, aux {aux.shape}, final {final.shape})"
        )
    if aux.ndim != 2 or final.ndim != 2 or aux.shape[1] != 3 * final.shape[1]:
        raise ValueError(f"row {row.get('sample_id')!r}: aux {aux.shape} is not (T, 3*{final.shape})")
    n = min(length, max_len)
    if row.get("target_ids") is not None:
        tgt = np.asarray(row["target_ids"], dtype=np.int64).reshape(-1)
        if tgt.shape[0] != length:
            raise ValueError(f"row {row.get('sample_id')!r}: {tgt.shape[0]} target_ids for {length} tokens")
        tgt = tgt[:n]
    elif target_ids_fn is not None:
        tgt = target_ids_fn(final[:n])
    else:
        raise ValueError("row has no target_ids and no target_ids_fn was given")
    return Sample(ids[:n], mask[:n], aux[:n], final[:n], tgt)


def shuffled(items: Iterable, buffer_size: int, seed: int) -> Iterator:
    """Seeded bounded shuffle: deterministic for a deterministic input order."""
    rng = random.Random(seed)
    buf: list = []
    for item in items:
        buf.append(item)
        if len(buf) >= buffer_size:
            yield buf.pop(rng.randrange(len(buf)))
    rng.shuffle(buf)
    yield from buf


def pack_rows(samples: Iterable[Sample], row_len: int) -> Iterator[list[Sample]]:
    """Next-fit packing of samples (each <= row_len tokens) into rows of at most row_len tokens."""
    row: list[Sample] = []
    used = 0
    for s in samples:
        if used + len(s) > row_len and row:
            yield row
            row, used = [], 0
        row.append(s)
        used += len(s)
    if row:
        yield row


def collate(rows: list[list[Sample]], num_rows: int, row_len: int) -> Batch:
    """Lay packed rows into zero-padded (num_rows, row_len) tensors."""
    first = rows[0][0]
    ht = first.final_hidden.shape[1]
    ids = np.zeros((num_rows, row_len), np.int64)
    mask = np.zeros((num_rows, row_len), bool)
    docs = np.full((num_rows, row_len), -1, np.int64)
    pos = np.zeros((num_rows, row_len), np.int64)
    aux = np.zeros((num_rows, row_len, 3 * ht), np.float32)
    final = np.zeros((num_rows, row_len, ht), np.float32)
    tgt = np.zeros((num_rows, row_len), np.int64)
    doc = 0
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            sl = slice(at, at + len(s))
            ids[r, sl], mask[r, sl], aux[r, sl], final[r, sl] = (
                s.input_ids, s.loss_mask, s.aux_hidden, s.final_hidden
            )
            tgt[r, sl] = s.target_ids
            docs[r, sl] = doc
            pos[r, sl] = np.arange(len(s))
            doc += 1
            at += len(s)
    t = torch.from_numpy
    return Batch(t(ids), t(mask), t(docs), t(pos), t(aux), t(final), t(tgt))


def batches(samples: Iterable[Sample], batch_tokens: int, row_len: int) -> Iterator[Batch]:
    """Pack samples into batches of `max(1, batch_tokens // row_len)` rows of `row_len` tokens."""
    num_rows = max(1, batch_tokens // row_len)
    pending: list[list[Sample]] = []
    for row in pack_rows(samples, row_len):
        pending.append(row)
        if len(pending) == num_rows:
            yield collate(pending, num_rows, row_len)
            pending = []
    if pending:
        yield collate(pending, num_rows, row_len)
