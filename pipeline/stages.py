"""The Ray Data stages around the pure logic: render prompts, validate samples, write shards.

Each is a callable class over batches of in-flight rows (pipeline.flight), configured
by its constructor arguments; the generation sources sit between render and validate.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa

from pipeline.config import ChecksConfig
from pipeline.flight import batch_to_rows, mark, rows_to_table
from pipeline.layout import RunLayout, atomic_write_table
from pipeline.profiles import load_profile
from pipeline.records import QUARANTINE_SCHEMA, SAMPLE_SCHEMA, empty_sample, quarantine_row
from pipeline.validate import annotate, quarantine_reason, validate_sample


class RenderPrompts:
    """Chat-template each prompt into the exact ids the engine is given.

    ``max_prompt_tokens`` (dataset -> limit): a prompt that leaves no room for a response under its
    dataset's ``max_length`` check is quarantined here, before any source spends compute or money on it.
    """

    def __init__(self, profile: str, model_dir: str | None, max_prompt_tokens: dict[str, int] | None = None) -> None:
        self.profile = load_profile(profile, model_dir)
        self.max_prompt_tokens = dict(max_prompt_tokens or {})

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
        return rows_to_table(out)


class ValidateSamples:
    """Run the named checks; failures in quarantine mode route the sample to quarantine."""

    def __init__(self, profile: str, model_dir: str | None, checks: dict[str, dict[str, Any]]) -> None:
        self.profile = load_profile(profile, model_dir)
        self.checks = {name: ChecksConfig.model_validate(c) for name, c in checks.items()}

    def __call__(self, batch: pa.Table) -> pa.Table:
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


def shard_name(sample_ids: list[str]) -> str:
    """Content-addressed: a retried batch rewrites the same file instead of adding a copy."""
    digest = hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()[:20]
    return f"part-{digest}.parquet"


class WriteShards:
    """Write ok rows to samples/, quarantined rows to quarantine/, return one summary row per sample."""

    def __init__(self, output_dir: str) -> None:
        layout = RunLayout(output_dir)
        self.samples, self.quarantine = layout.samples, layout.quarantine
        self.samples.mkdir(parents=True, exist_ok=True)
        self.quarantine.mkdir(parents=True, exist_ok=True)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch_to_rows(batch)
        ok = [r for r in rows if r["status"] == "ok"]
        bad = [r for r in rows if r["status"] == "quarantine"]
        if ok:
            path = self.samples / shard_name([r["sample_id"] for r in ok])
            atomic_write_table(rows_to_table(ok, SAMPLE_SCHEMA), path)
        if bad:
            q = [quarantine_row(r, r["stage"], r["reason"]) for r in bad]
            path = self.quarantine / shard_name([r["sample_id"] for r in q])
            atomic_write_table(rows_to_table(q, QUARANTINE_SCHEMA), path)
        return rows_to_table([{**r, "prompt_ids": [], "prompt_assistant_mask": [], "messages": "", "tools": "",
                               "reasoning": None, "content": None, "tool_calls": ""} for r in rows])
