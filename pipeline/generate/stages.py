"""The Ray Data stages around the pure logic: render prompts, validate samples, write shards.

Each is a callable class over batches of in-flight rows (pipeline.base.flight), configured
by its constructor arguments; the generation sources sit between render and validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from pipeline.base.config import ChecksConfig, PoolConfig
from pipeline.base.flight import as_flight, batch_to_rows, mark, marked, rows_to_table, tally_of
from pipeline.base.layout import RunLayout, atomic_write_table, shard_name
from pipeline.base.records import QUARANTINE_SCHEMA, SAMPLE_SCHEMA, empty_sample, quarantine_row, read_ids
from pipeline.checks.validate import annotate, quarantine_reason, validate_sample
from pipeline.generate.router import Router
from pipeline.generate.sources.chain import assign_sources, close_unserved
from pipeline.profiles import load_profile


def pool_bounds(pool: PoolConfig, sources: Sequence[Any], cluster_cpus: float | None) -> tuple[int, int]:
    """(min, max) actors of a CPU stage's pool. Unset, the maximum follows the sources: as many actors as the
    sources may run at their largest (each engine or HTTP actor's output is about one validate actor's work),
    capped by the cluster's CPUs (more would only queue for them), never below ``min_actors``."""
    if pool.max_actors is not None:
        return pool.min_actors, pool.max_actors
    most = sum(max(s.max_actors or 0, s.num_actors) for s in sources)
    if cluster_cpus is not None:
        most = min(most, max(1, int(cluster_cpus)))
    return pool.min_actors, max(pool.min_actors, most)


class RenderPrompts:
    """Chat-template each prompt into the exact ids the engine is given, then (given a ``router``) write each
    rendered row's source, as ``chain.assign_sources`` does (``overrides``: a re-fed re-route's sources).

    ``max_prompt_tokens`` (dataset -> limit): a prompt that leaves no room for a response under its
    dataset's ``max_length`` check is quarantined here, before any source spends compute or money on it.
    """

    def __init__(self, profile: str, model_dir: str | None, max_prompt_tokens: dict[str, int] | None = None,
                 router: Router | None = None, overrides: Mapping[str, str] | None = None) -> None:
        self.profile = load_profile(profile, model_dir)
        self.max_prompt_tokens = dict(max_prompt_tokens or {})
        self.router, self.overrides = router, dict(overrides or {})

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = []
        for row in batch_to_rows(batch):
            sample = empty_sample(row)
            sample.update(status="ok", stage="", reason="")
            try:
                tools = json.loads(row["tools"]) if row["tools"] else None
                rendered = self.profile.render_prompt(json.loads(row["messages"]), tools, bool(row["thinking"]))
                sample["prompt_ids"] = rendered.ids
                sample["prompt_assistant_mask"] = rendered.assistant_mask
                sample["thinking"] = rendered.thinking
            except Exception as e:  # a prompt the template cannot render is quarantined, not fatal
                mark(sample, "quarantine", "render", f"render failed: {type(e).__name__}: {e}")
            limit = self.max_prompt_tokens.get(str(row["dataset"]))
            if sample["status"] == "ok" and limit is not None and len(sample["prompt_ids"]) >= limit:
                mark(sample, "quarantine", "render", f"max_length: prompt of {len(sample['prompt_ids'])} tokens "
                     f"leaves no room for a response under max_total_tokens {limit} (nothing was generated)")
            out.append(sample)
        table = rows_to_table(out)
        return table if self.router is None else assign_sources(table, self.router, self.overrides)


class ValidateSamples:
    """Run the named checks; failures in quarantine mode route the sample to quarantine.

    ``closes_chain``: the rows come straight from the source stages, so first an ok row no stage generated is
    quarantined (``chain.close_unserved``)."""

    def __init__(self, profile: str, model_dir: str | None, checks: dict[str, dict[str, Any]],
                 closes_chain: bool = False) -> None:
        self.profile = load_profile(profile, model_dir)
        self.profile.warm()  # the round trip's plain encoder, here rather than on the first batch
        self.checks = {name: ChecksConfig.model_validate(c) for name, c in checks.items()}
        self.closes_chain = closes_chain

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.closes_chain:
            batch = close_unserved(batch)
        out = []
        for row in batch_to_rows(batch):
            if row["status"] == "ok":
                verdict = validate_sample(row, self.profile, self.checks[row["dataset"]])
                row = annotate(row, verdict)
                row["checks_ran"] = verdict.ran
                if not verdict.passed:
                    mark(row, "quarantine", "validate", quarantine_reason(verdict))
            out.append(row)
        return rows_to_table(out)


class WriteShards:
    """Write ok rows to samples/, quarantined rows to quarantine/, return one tally row per sample
    (``flight.TALLY_SCHEMA``: the driver counts, it never holds the ids or texts).

    With the run lock's ``lock_path`` and ``token`` (the actor runs in another process than the driver that
    holds the lock) every shard is committed under ``run_lock.fence``: after a takeover nothing is written
    and ``LockLost`` ends the Ray Data job. No sample is written twice, by construction: a row whose id is in
    ``done_ids`` (passed or quarantined when the run started) or was written by this actor is left out of
    the shard and comes back with status ``duplicate`` (the driver must not count it again), and the shard
    is named by the ids it holds. The actor reads the ids already in samples/ and quarantine/ when it starts
    (a restarted actor too), and the driver runs one WriteShards actor per generation pass (pool size 1), so
    its memory holds every write of its pass.
    """

    def __init__(self, layout: RunLayout, token: str | None = None, done_ids: Iterable[str] | None = None) -> None:
        self.samples, self.quarantine = layout.samples, layout.quarantine
        self.samples.mkdir(parents=True, exist_ok=True)
        self.quarantine.mkdir(parents=True, exist_ok=True)
        # ``token``: the run lock's (layout.lock), checked before every shard; None: no lock to honour
        self.lock_path, self.token = (str(layout.lock), token) if token is not None else (None, None)
        self.written: set[str] = set() if done_ids is None else set(done_ids)
        self.written.update(read_ids(self.samples) | read_ids(self.quarantine))

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Columns in, columns out: only ``status`` and ``sample_id`` become Python objects (the rows of a
        quarantine shard too, which are rare); the samples' ids and texts go to Parquet as Arrow arrays."""
        batch = as_flight(batch)
        if self.lock_path is not None:
            from pipeline.base.run_lock import check_token

            check_token(self.lock_path, self.token or "")  # a lost lock writes nothing, not even a temp file
        status, ids = batch.column("status").to_pylist(), batch.column("sample_id").to_pylist()
        ok, bad, dup, fresh = [], [], [], set()
        for i, (st, sid) in enumerate(zip(status, ids, strict=True)):
            if st not in ("ok", "quarantine"):
                continue
            if sid in self.written or sid in fresh:
                dup.append(i)
                continue
            fresh.add(sid)
            (ok if st == "ok" else bad).append(i)
        if ok:
            table = batch.take(ok).select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA)
            self._commit(table, self.samples / shard_name([ids[i] for i in ok]))
            self.written.update(ids[i] for i in ok)
        if bad:
            q = [quarantine_row(r, r["stage"], r["reason"]) for r in batch.take(bad).to_pylist()]
            self._commit(rows_to_table(q, QUARANTINE_SCHEMA), self.quarantine / shard_name([r["sample_id"] for r in q]))
            self.written.update(r["sample_id"] for r in q)
        if dup:
            batch = marked(batch, dup, "duplicate", "write", "already written as passed or quarantined")
        return tally_of(batch)

    def _commit(self, table: pa.Table, path: Path) -> None:
        """Write one shard whole; with a lock, only while it is still ours (fence: guard, token check, write)."""
        if self.lock_path is None:
            atomic_write_table(table, path)
            return
        from pipeline.base.run_lock import fence

        with fence(self.lock_path, self.token or ""):
            atomic_write_table(table, path)
