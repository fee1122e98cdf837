"""Held-out samples: a fixed slice of the data the drafter never trains on, so its report is honest.

Membership is a hash of the sample id: the same in every attempt of a run, in every stage and on
every worker, with no list to store. The pipeline drops held-out samples from the training stream
(and from the draft-vocabulary count) and, after training, measures the exported drafter on them
with the simulated greedy verification of ``training.simulate``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa


def held_out_score(sample_id: str) -> float:
    """A uniform number in [0, 1) fixed by the sample id (salted: independent of the router's hashes)."""
    digest = hashlib.sha256(f"heldout\x1f{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_held_out(sample_id: str, fraction: float) -> bool:
    return fraction > 0 and held_out_score(sample_id) < fraction


def heldout_mask(sample_ids: Iterable[Any], fraction: float) -> np.ndarray:
    return np.array([is_held_out(str(s), fraction) for s in sample_ids], dtype=bool)


def select_heldout(batch: pa.Table, fraction: float, keep: bool) -> pa.Table:
    """Ray Data map over rows with a ``sample_id`` column: the held-out rows (``keep``) or all the others."""
    mask = heldout_mask(batch.column("sample_id").to_pylist(), fraction)
    return batch.filter(pa.array(mask if keep else ~mask))


def heldout_acceptance(export_dir: str | Path, target_dir: str | Path, rows: Sequence[dict], k: int) -> dict[str, Any]:
    """Simulated greedy acceptance of the exported drafter on extraction rows it never trained on.

    Exact for samples the target generated greedily; for sampled ones it scores the drafter against the
    target's argmax on the recorded contexts (see ``training.simulate``).
    """
    import torch

    from training.export import load_exported
    from training.simulate import simulate_acceptance
    from training.target import load_target_parts

    if not rows:
        return {"samples": 0, "k": k, "skipped": "no held-out samples (raise training.heldout_fraction)"}
    target = load_target_parts(target_dir)  # once: embeddings for the drafter, lm_head for verification
    drafter = load_exported(export_dir, target)
    with torch.no_grad():
        stats = simulate_acceptance(drafter, rows, target.lm_head, k=k)
    return {"samples": len(rows), "k": k, "acceptance_length": round(stats.acceptance_length, 4),
            "per_position": [round(p, 4) for p in stats.per_position], "drafts": stats.num_drafts,
            "tokens": int(sum(int(np.asarray(r["loss_mask"]).sum()) for r in rows))}
