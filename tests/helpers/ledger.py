"""Ledger helpers for tests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def spent_from_samples(rows: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Billed completion tokens per dataset in already-written samples (a `spent=` for `Ledger`).

    Counts each sample's final billed attempt; failed attempts that were billed
    are not in the samples, so persist ``Ledger.report()`` too and take the max.
    """
    spent: dict[str, int] = {}
    for r in rows:
        billed = int(r.get("billed_completion_tokens") or 0)
        if billed > 0:
            spent[r["dataset"]] = spent.get(r["dataset"], 0) + billed
    return spent
