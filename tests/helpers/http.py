"""Test helpers for the HTTP source outside the generation chain: one stage, split outcomes, in-process ledger."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from pipeline.base.config import SamplingConfig
from pipeline.base.records import SAMPLE_COLUMNS, quarantine_row
from pipeline.generate.ledger import Ledger
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.sources.http.engine import NOT_GENERATED, OK, QUARANTINED
from pipeline.generate.sources.http.openrouter import OpenRouterGenerator


def map_openrouter(ds: Any, cfg: OpenRouterSourceConfig, profile_name: str, model_dir: str | None, ledger: Any, *,
                   sampling: SamplingConfig | None = None, source_name: str | None = None) -> Any:
    """``ds.map_batches`` with an actor pool of OpenRouterGenerator, sized from the config."""
    import ray

    compute = ray.data.ActorPoolStrategy(min_size=cfg.num_actors, max_size=max(cfg.max_actors or 0, cfg.num_actors),
                                         max_concurrent_calls_per_actor=cfg.max_concurrent_batches)
    return ds.map_batches(
        OpenRouterGenerator, fn_constructor_args=(cfg, profile_name, model_dir, ledger),
        fn_constructor_kwargs={"sampling": sampling, "source_name": source_name},
        compute=compute, batch_size=cfg.batch_size, batch_format="pyarrow", num_cpus=cfg.num_cpus)


def split_outcomes(rows: Iterable[Mapping[str, Any]] | pa.Table) -> tuple[list[dict], list[dict], list[dict]]:
    """(samples with SAMPLE_COLUMNS, quarantine rows at stage "generate", not-generated rows)."""
    if isinstance(rows, pa.Table):
        rows = rows.to_pylist()
    samples, quarantine, not_generated = [], [], []
    for r in rows:
        status = r["status"]
        if status == OK:
            samples.append({k: r[k] for k in SAMPLE_COLUMNS})
        elif status == QUARANTINED:
            detail = {k: v for k, v in r.items() if k not in ("status", "error")}
            quarantine.append(quarantine_row(detail, "generate", r["error"]))
        elif status == NOT_GENERATED:
            not_generated.append({"sample_id": r["sample_id"], "dataset": r["dataset"],
                                  "row_index": int(r["row_index"]), "reason": r["error"]})
        else:
            raise ValueError(f"unknown status {status!r}")
    return samples, quarantine, not_generated


def local_ledger(cfg: OpenRouterSourceConfig, *, spent: Mapping[str, int] | None = None,
                 strict: bool = False) -> Ledger:
    """An in-process ledger (tests, benchmarks); not shareable across actors."""
    return Ledger(cfg.budgets, default_budget=cfg.default_budget, health=cfg.health, strict=strict, spent=spent)
