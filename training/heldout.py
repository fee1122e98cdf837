"""Held-out samples: a fixed slice of the data the drafter never trains on, so its report is honest.

Membership is a hash of the sample id: the same in every attempt of a run, in every stage and on
every worker, with no list to store. The pipeline drops held-out samples from the training stream
(and from the draft-vocabulary count) and, after training, measures the exported drafter on them
with the simulated greedy verification of ``training.simulate``, overall and per dataset and source of
the held-out samples (one simulation; the groups' drafts add up to the whole), so a report shows where
the drafter is weak rather than one average.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from training.simulate import RowCounts
    from training.target import TargetParts

FEW_DRAFTS = 30  # a group with fewer drafts gets its figure marked ``few``: its standard error is itself unsure
UNKNOWN = "unknown"  # the group of a row whose sample is not found (or names no dataset / source)


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


def acceptance_se(counts: Sequence[RowCounts]) -> float | None:
    """Standard error of the acceptance length of rows with these counts (None below two drafts).

    Per draft, the accepted count n has its mean and variance in the per-position counts (n > i for
    ``accepted[i]`` of the drafts, and n^2 is the sum of 2i + 1 over i < n). Drafts of one sample are not
    independent (a repetitive answer accepts most of its drafts), so this is the larger of that per-draft
    error and the one clustered by sample (ratio estimator over the samples that drafted)."""
    drafts = sum(c.drafts for c in counts)
    if drafts < 2:
        return None
    accepted = [sum(col) for col in zip(*(c.accepted for c in counts), strict=True)]
    mean = sum(accepted) / drafts
    square = sum((2 * i + 1) * a for i, a in enumerate(accepted)) / drafts
    per_draft = math.sqrt(max(square - mean * mean, 0.0) / (drafts - 1))  # sample variance / drafts
    drafted = [c for c in counts if c.drafts]
    if len(drafted) < 2:
        return per_draft
    residuals = sum((sum(c.accepted) - mean * c.drafts) ** 2 for c in drafted)
    clustered = math.sqrt(residuals * len(drafted) / (len(drafted) - 1)) / drafts
    return max(per_draft, clustered)


def group_acceptance(rows: Sequence[dict], counts: Sequence[RowCounts], keys: Sequence[str],
                     k: int) -> list[dict[str, Any]]:
    """Per group key, sorted by name: the held-out figures of its rows (``counts[i]`` and ``keys[i]`` belong
    to ``rows[i]``), with the standard error of its acceptance length and ``few`` below ``FEW_DRAFTS``."""
    from training.simulate import stats_from_counts

    members: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    out = []
    for name in sorted(members):
        idx = members[name]
        group = [counts[i] for i in idx]
        stats = stats_from_counts(group, k)
        se = acceptance_se(group)
        out.append({"name": name, "samples": len(idx), "drafts": stats.num_drafts,
                    "acceptance_length": round(stats.acceptance_length, 4),
                    "se": None if se is None else round(se, 4),
                    "per_position": [round(p, 4) for p in stats.per_position],
                    "tokens": int(sum(int(np.asarray(rows[i]["loss_mask"]).sum()) for i in idx)),
                    "few": stats.num_drafts < FEW_DRAFTS})
    return out


def sample_label(row: Mapping[str, Any], labels: Mapping[str, Mapping[str, Any]], field: str) -> str:
    """The row's ``field`` (dataset or source): its own column if it has one, else its sample's in ``labels``."""
    value = row.get(field) or (labels.get(str(row.get("sample_id"))) or {}).get(field)
    return str(value) if value else UNKNOWN


def heldout_acceptance(export_dir: str | Path, target_dir: str | Path | TargetParts, rows: Sequence[dict], k: int,
                       labels: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Simulated greedy acceptance of the exported drafter on extraction rows it never trained on, overall and
    per dataset and source (``labels``: sample id -> its ``dataset`` and ``source``; hidden rows carry neither).

    Exact for samples the target generated greedily; for sampled ones it scores the drafter against the
    target's argmax on the recorded contexts (see ``training.simulate``).
    """
    import torch

    from training.export import load_exported
    from training.simulate import row_counts, stats_from_counts
    from training.target import as_target_parts

    if not rows:
        return {"samples": 0, "k": k, "skipped": "no held-out samples (raise training.heldout_fraction)"}
    target = as_target_parts(target_dir)  # once: embeddings for the drafter, lm_head for verification
    drafter = load_exported(export_dir, target)
    with torch.no_grad():
        counts = row_counts(drafter, rows, target.lm_head, k=k)
    stats = stats_from_counts(counts, k)
    if stats.num_drafts == 0:  # no answer token to draft from: 1.0 would read as a drafter that never drafts right
        return {"samples": len(rows), "k": k, "drafts": 0,
                "skipped": "the held-out samples hold no answer tokens to draft (nothing measured)"}
    labels = labels or {}
    return {"samples": len(rows), "k": k, "acceptance_length": round(stats.acceptance_length, 4),
            "per_position": [round(p, 4) for p in stats.per_position], "drafts": stats.num_drafts,
            "tokens": int(sum(int(np.asarray(r["loss_mask"]).sum()) for r in rows)),
            **{f"by_{field}": group_acceptance(rows, counts, [sample_label(r, labels, field) for r in rows], k)
               for field in ("dataset", "source")}}
