"""The columns a generated sample carries through the pipeline and into its Parquet shards.

One schema for every source (local engine or HTTP API) so validation, audit
and extraction never care where a sample came from. Quarantine rows keep a
small fixed set of columns plus the whole sample as JSON in ``detail``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SAMPLE_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("dataset", pa.string()),
    ("row_index", pa.int64()),
    ("source", pa.string()),        # configured source name
    ("source_kind", pa.string()),   # vllm | sglang | transformers | openrouter
    ("provider", pa.string()),      # API provider that served it, or the engine name
    ("model", pa.string()),
    ("messages", pa.string()),      # JSON
    ("tools", pa.string()),         # JSON or ""
    ("thinking", pa.bool_()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("prompt_assistant_mask", pa.list_(pa.int8())),
    ("output_ids", pa.list_(pa.int32())),
    ("ids_from", pa.string()),      # "engine" (exact) | "rebuilt" (from API text)
    ("reasoning", pa.string()),
    ("content", pa.string()),
    ("tool_calls", pa.string()),    # JSON or ""
    ("finish_reason", pa.string()),
    ("truncated", pa.bool_()),
    ("billed_completion_tokens", pa.int64()),  # -1 where the source bills nothing
    ("cost", pa.float64()),
    ("sampling", pa.string()),      # JSON of the parameters sent
    ("t_generate_s", pa.float64()),
    ("checks_failed", pa.list_(pa.string())),
    ("checks_flagged", pa.list_(pa.string())),
    ("check_details", pa.string()),  # JSON {check: detail}
])

QUARANTINE_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("dataset", pa.string()),
    ("row_index", pa.int64()),
    ("stage", pa.string()),   # read | render | generate | validate | extract
    ("source", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),  # JSON: the sample as far as it got
])

SAMPLE_COLUMNS = SAMPLE_SCHEMA.names


def quarantine_row(row: dict[str, Any], stage: str, reason: str) -> dict[str, Any]:
    """A quarantine row for a sample that failed at ``stage``; nothing of it is lost."""
    detail = {k: v for k, v in row.items() if k not in ("sample_id", "dataset", "row_index")}
    return {
        "sample_id": row["sample_id"],
        "dataset": row["dataset"],
        "row_index": int(row["row_index"]),
        "stage": stage,
        "source": str(row.get("source") or ""),
        "reason": reason,
        "detail": json.dumps(detail, default=_jsonable, ensure_ascii=False),
    }


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def empty_sample(prompt_row: dict[str, Any]) -> dict[str, Any]:
    """A sample with every column present, filled from a rendered prompt row."""
    out: dict[str, Any] = dict.fromkeys(SAMPLE_COLUMNS)
    out.update({
        "tools": "", "tool_calls": "", "reasoning": None, "content": None, "ids_from": "engine",
        "billed_completion_tokens": -1, "cost": 0.0, "truncated": False, "checks_failed": [],
        "checks_flagged": [], "check_details": "{}", "provider": "", "model": "",
    })
    for k in ("sample_id", "dataset", "row_index", "messages", "tools", "thinking",
              "prompt_ids", "prompt_assistant_mask"):
        if k in prompt_row:
            out[k] = prompt_row[k]
    return out


def read_rows(folder: Path, columns: list[str]) -> list[dict[str, Any]]:
    """The named columns of every parquet shard in a folder (samples/ or quarantine/), in file order."""
    rows: list[dict[str, Any]] = []
    for f in sorted(Path(folder).glob("*.parquet")):
        rows += pq.read_table(f, columns=columns).to_pylist()
    return rows
