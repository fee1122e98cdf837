"""The OpenRouter / OpenAI-compatible HTTP source as Ray Data stages.

``OpenRouterGenerator`` turns prompt rows into outcome rows: one per prompt,
SAMPLE_SCHEMA columns plus ``status`` ("ok" | "quarantined" | "not_generated"),
``error``, ``attempts`` and ``generation_id``. ``OpenRouterFlight`` is the same
source in the generation chain's in-flight row contract (pipeline.base.flight): it
serves the rows routed to it and folds each outcome back into its row. Each
actor runs its batches on one asyncio loop with up to ``cfg.max_in_flight``
requests in flight; all actors of a source share one budget ledger actor
(``pipeline.generate.ledger.ledger_for``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.base.config import SamplingConfig
from pipeline.base.flight import NextSource, batch_to_rows, fail_row, leave_to_do, rows_to_table, served, serves
from pipeline.base.layout import RunLayout
from pipeline.base.records import SAMPLE_COLUMNS, SAMPLE_SCHEMA
from pipeline.generate.ledger import halt
from pipeline.generate.sources.http.config import OpenRouterSourceConfig
from pipeline.generate.sources.http.engine import NOT_GENERATED, OK, QUARANTINED, HttpEngine, Secret
from pipeline.generate.sources.http.journal import Record, ResponseJournal
from pipeline.generate.sources.http.ledger_client import ledger_client
from pipeline.generate.sources.http.replay import ReplayIndex
from pipeline.profiles import load_profile

log = logging.getLogger(__name__)

# Columns the stage adds to SAMPLE_SCHEMA so one table carries all three outcomes.
IDLE_CLOSE_S = 2.0  # an HTTP actor idle this long closes its session (see OpenRouterGenerator.run)
STATUS_COLUMNS = ["status", "error", "failure_class", "attempts", "generation_id"]
OUTPUT_SCHEMA = pa.schema(list(SAMPLE_SCHEMA) + [
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    pa.field("failure_class", pa.string()),  # not ok: transient | sample | account | budget
    pa.field("attempts", pa.int32()),
    pa.field("generation_id", pa.string()),
])


class MissingKey(RuntimeError):
    """The API key's environment variable is not set where the source runs."""


def read_api_key(cfg: OpenRouterSourceConfig) -> Secret:
    """The key from the environment variable this source may send (``cfg.key_env()``: OpenRouter's default
    variable only to OpenRouter's host, another endpoint only the variable it names itself; None sends no key).
    Errors name the variable, never a value."""
    env = cfg.key_env()
    key = os.environ.get(env, "") if env else ""
    if not key and cfg.api_key_required:
        raise MissingKey(f"source {cfg.name!r}: environment variable {env or cfg.api_key_env} is not set "
                         "(it must be set where the source actors run, before Ray starts)")
    return Secret(key)


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
                 source_name: str | None = None, seed: int | None = None, layout: RunLayout | None = None,
                 replay: Mapping[str, Any] | None = None) -> None:
        self.cfg = cfg if isinstance(cfg, OpenRouterSourceConfig) else OpenRouterSourceConfig.model_validate(cfg)
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            sampling = SamplingConfig.model_validate(sampling)
        self.profile = load_profile(profile_name, model_dir)
        self.profile.warm()  # built lazily otherwise: a half-second stall of the event loop at the first answer
        name = source_name or self.cfg.name
        holder = f"{_actor_id()}:{uuid.uuid4().hex[:12]}"  # whose reservations: this engine in this actor
        # One journal file per actor (one writer per file); none outside a run folder (tests, benches).
        journal, index = None, None
        if layout is not None:
            path = layout.response_journal(name, holder.rsplit(":", 1)[1])
            # What any actor of this folder was billed for, the dead predecessor's included, before sending.
            index = ReplayIndex(path.parent, name, exclude=path, identity=self.cfg.identity())
            journal = ResponseJournal(path, flush_every_s=self.cfg.journal_flush_s)
        ledger = ledger_client(ledger_handle, holder, self.cfg.lease_s)
        self.engine = HttpEngine(self.cfg, self.profile, ledger, read_api_key(self.cfg),
                                 sampling=sampling, source_name=name,
                                 rng=random.Random(seed) if seed is not None else None, journal=journal,
                                 replay=index if replay is None and index is not None
                                 else {k: _record(v) for k, v in (replay or {}).items()})
        self._active = self._calls = 0
        self.idle_close_s = IDLE_CLOSE_S
        self._idle: asyncio.Task[None] | None = None  # the pending idle close (held: the loop keeps weak refs)
        if self.cfg.tune_gc:
            tune_gc()

    async def __call__(self, batch: Any) -> pa.Table:
        return pa.Table.from_pylist(await self.run(rows_of(batch)), schema=OUTPUT_SCHEMA)

    async def run(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One outcome row per prompt row, in order. Idle (no batch in flight), the journal is flushed at once
        and the session closed ``idle_close_s`` later if still idle: a Ray Data actor gets no shutdown call,
        and the short gaps between batches keep their connections (closing at each one reopened all
        ``max_in_flight`` of them)."""
        self._active += 1
        self._calls += 1
        try:
            return await self.engine.run_rows(rows)
        finally:
            self._active -= 1
            if self._active == 0:
                self.engine.flush()
                if self.idle_close_s <= 0:
                    await self.engine.close()
                else:
                    self._idle = asyncio.get_running_loop().create_task(self._close_if_idle(self._calls))

    async def _close_if_idle(self, calls: int) -> None:
        await asyncio.sleep(self.idle_close_s)
        if self._active == 0 and self._calls == calls:  # no batch since: close (a later one opens its own)
            await self.engine.close()

    async def close(self) -> None:
        await self.engine.close()


def _actor_id() -> str:
    """This Ray actor's id, or the process id outside an actor (tests, benches)."""
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a local Ray here
            return f"pid{os.getpid()}"
        return ray.get_runtime_context().get_actor_id() or f"pid{os.getpid()}"
    except Exception:  # noqa: BLE001 - no Ray here
        return f"pid{os.getpid()}"


def _record(value: Any) -> Record:
    return value if isinstance(value, Record) else Record.from_json(value)


def merge_outcome(row: dict[str, Any], outcome: Mapping[str, Any], source_name: str,
                  router: NextSource | None) -> dict[str, Any]:
    """Fold one outcome row of ``OpenRouterGenerator`` into the in-flight row it answered."""
    status = outcome["status"]
    error = str(outcome.get("error") or "")
    for k in ("source_kind", "provider", "model", "ids_from", "sampling"):
        if outcome.get(k) is not None:
            row[k] = outcome[k]
    row["attempts"] = (row.get("attempts") or 0) + int(outcome.get("attempts") or 0)
    row["failure_class"] = outcome.get("failure_class")
    if status == OK:
        keep = ("prompt_ids", "prompt_assistant_mask", "sample_id", "dataset", "row_index")
        row.update({k: outcome[k] for k in SAMPLE_COLUMNS if k in outcome and k not in keep})
        served(row, source_name)
    elif status == QUARANTINED:
        fail_row(row, error or "quarantined by the HTTP source", source_name, router)
    elif status == NOT_GENERATED:
        leave_to_do(row, error, source_name, router)
    else:
        raise ValueError(f"unknown outcome status {status!r} from source {source_name!r}")
    return row


class OpenRouterFlight:
    """The HTTP source in the in-flight row contract: serves its routed rows, passes the rest on."""

    def __init__(self, model_dir: str | None, profile: str, sampling: SamplingConfig | Mapping[str, Any],
                 cfg: OpenRouterSourceConfig, router: NextSource | None = None, *, ledger: Any,
                 layout: RunLayout | None = None, replay: Mapping[str, str] | None = None) -> None:
        self.name = cfg.name
        self.router = router
        self.start_error: str | None = None
        try:
            self.inner = OpenRouterGenerator(cfg, profile, model_dir, ledger, sampling=sampling,
                                             source_name=cfg.name, layout=layout, replay=replay)
        except MissingKey as e:  # an account problem: its prompts stay to do (or move on), the run goes on
            self.start_error = str(e)
            log.error("%s; its prompts are left to do", e)
            halt(ledger, self.start_error)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch_to_rows(batch)
        todo = [r for r in rows if serves(r, self.name)]
        if todo and self.start_error is not None:
            for r in todo:
                r["failure_class"] = "account"
                leave_to_do(r, f"source {self.name!r} halted: {self.start_error}", self.name, self.router)
        elif todo:
            outcomes = await self.inner.run(todo)
            for r, o in zip(todo, outcomes, strict=True):
                merge_outcome(r, o, self.name, self.router)
        return rows_to_table(rows)
