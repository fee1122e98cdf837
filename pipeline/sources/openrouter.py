"""The OpenRouter / OpenAI-compatible HTTP source as a Ray Data stage.

Use::

    ledger = ledger_for(cfg)                     # one Ray actor shared by every source actor
    out = map_openrouter(ds, cfg, "deepseek", model_dir, ledger, sampling=run_cfg.sampling)
    samples, quarantine, not_generated = split_outcomes(out.take_all())
    report = ray.get(ledger.report.remote())     # tokens and cost per dataset and provider, exclusions

Each actor runs its batches on one asyncio loop with up to ``cfg.max_in_flight``
requests in flight. Every input row comes back as exactly one output row:
SAMPLE_SCHEMA columns plus ``status`` ("ok" | "quarantined" | "not_generated"),
``error``, ``attempts`` and ``generation_id``.
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from pipeline.config import SamplingConfig
from pipeline.ledger import Ledger, create_ledger
from pipeline.profiles import load_profile
from pipeline.records import SAMPLE_COLUMNS, SAMPLE_SCHEMA, quarantine_row
from pipeline.sources.http_config import HealthConfig, OpenRouterSourceConfig, ProviderPreferences
from pipeline.sources.http_engine import NOT_GENERATED, OK, QUARANTINED, HttpEngine, Secret
from pipeline.sources.http_ledger_client import ledger_client

__all__ = [
    "HealthConfig", "OUTPUT_SCHEMA", "OpenRouterGenerator", "OpenRouterSourceConfig", "ProviderPreferences",
    "STATUS_COLUMNS", "create_ledger", "ledger_for", "local_ledger", "map_openrouter", "read_api_key", "rows_of",
    "split_outcomes",
]

# Columns the stage adds to SAMPLE_SCHEMA so one table carries all three outcomes.
STATUS_COLUMNS = ["status", "error", "attempts", "generation_id"]
OUTPUT_SCHEMA = pa.schema(list(SAMPLE_SCHEMA) + [
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    pa.field("attempts", pa.int32()),
    pa.field("generation_id", pa.string()),
])


def read_api_key(cfg: OpenRouterSourceConfig) -> Secret:
    """The key from the environment variable the config names; errors name the variable, never a value."""
    key = os.environ.get(cfg.api_key_env, "")
    if not key and cfg.api_key_required:
        raise RuntimeError(f"source {cfg.name!r}: environment variable {cfg.api_key_env} is not set "
                           "(it must be set where the source actors run, before Ray starts)")
    return Secret(key)


def ledger_for(cfg: OpenRouterSourceConfig, *, spent: Mapping[str, int] | None = None, name: str | None = None,
               strict: bool = False, journal: str | None = None) -> Any:
    """The shared ledger Ray actor for this source's budgets and health policy (journaled when given a path)."""
    return create_ledger(cfg.budgets, name=name, default_budget=cfg.default_budget, health=cfg.health.policy(),
                         strict=strict, spent=spent, journal=journal)


def rows_of(batch: Any) -> list[dict[str, Any]]:
    """Rows of a Ray Data batch in any format (pyarrow, pandas, dict of columns, list of rows)."""
    if isinstance(batch, list):
        return [dict(r) for r in batch]
    if isinstance(batch, pa.Table):
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return [{k: _plain(v) for k, v in r.items()} for r in batch.to_dict("records")]
    if isinstance(batch, Mapping):
        cols = {k: list(v) for k, v in batch.items()}
        n = len(next(iter(cols.values()), []))
        return [{k: _plain(v[i]) for k, v in cols.items()} for i in range(n)]
    raise TypeError(f"unsupported batch type {type(batch).__name__}")


def tune_gc(young_threshold: int = 50_000) -> None:
    """Freeze what start-up allocated and collect young objects less often (process-wide; meant for actors).

    Most per-request garbage dies by reference counting; the cyclic collector's
    frequent young passes and full passes over the start-up heap are what cost.
    """
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(max(young_threshold, gc.get_threshold()[0]), g1, g2)


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


class OpenRouterGenerator:
    """Ray Data callable class: prompt rows in, one outcome row per prompt out (see module doc)."""

    def __init__(self, cfg: OpenRouterSourceConfig | Mapping[str, Any], profile_name: str, model_dir: str | None,
                 ledger_handle: Any, *, sampling: SamplingConfig | Mapping[str, Any] | None = None,
                 source_name: str | None = None, seed: int | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, OpenRouterSourceConfig) else OpenRouterSourceConfig.model_validate(cfg)
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            sampling = SamplingConfig.model_validate(sampling)
        self.profile = load_profile(profile_name, model_dir)
        self.engine = HttpEngine(self.cfg, self.profile, ledger_client(ledger_handle), read_api_key(self.cfg),
                                 sampling=sampling, source_name=source_name,
                                 rng=random.Random(seed) if seed is not None else None)
        if self.cfg.tune_gc:
            tune_gc()

    async def __call__(self, batch: Any) -> pa.Table:
        rows = rows_of(batch)
        out = await self.engine.run_rows(rows)
        return pa.Table.from_pylist(out, schema=OUTPUT_SCHEMA)

    async def close(self) -> None:
        await self.engine.close()


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
    """(samples with SAMPLE_COLUMNS, quarantine rows at stage "generate", not-generated rows).

    Not-generated rows are ``{sample_id, dataset, row_index, reason}``: not
    failures, and simply absent from the samples, so a resumed run picks them up.
    """
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
    """An in-process ledger for single-process use (tests, benchmarks); not shareable across actors."""
    return Ledger(cfg.budgets, default_budget=cfg.default_budget, health=cfg.health.policy(), strict=strict,
                  spent=spent)
