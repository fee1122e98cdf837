"""The columns a generated sample carries through the pipeline and into its Parquet shards.

One schema for every source (local engine or HTTP API) so validation, audit
and extraction never care where a sample came from. Quarantine rows keep a
small fixed set of columns plus the whole sample as JSON in ``detail``.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

READ_THREADS = 4  # shards read at once (``shard_tables``)
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
    ("engine_s", pa.float64()),     # device-seconds of a local engine's busy time this sample used (0 for APIs)
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
        "billed_completion_tokens": -1, "cost": 0.0, "engine_s": 0.0, "truncated": False, "checks_failed": [],
        "checks_flagged": [], "check_details": "{}", "provider": "", "model": "",
    })
    for k in ("sample_id", "dataset", "row_index", "messages", "tools", "thinking",
              "prompt_ids", "prompt_assistant_mask"):
        if k in prompt_row:
            out[k] = prompt_row[k]
    return out


# Columns added after shards were first written: a shard from an older version lacks them, and reads as None.
OPTIONAL_COLUMNS = frozenset({"engine_s"})


def read_rows(folder: Path, columns: list[str]) -> list[dict[str, Any]]:
    """The named columns of every parquet shard in a folder (samples/ or quarantine/), in file order.

    A file there that is not parquet or lacks a named column raises ``UnreadableFile`` naming it (one line
    and exit 2 from the CLI), never a traceback, and never skipped: its samples would be made again. Only
    the ``OPTIONAL_COLUMNS`` a shard of an older version lacks read as None."""
    return [row for _, table in shard_tables(folder, columns) for row in table.to_pylist()]


def _shard_table(path: Path, columns: list[str]) -> pa.Table:
    """One shard's named columns, in that order; an absent ``OPTIONAL_COLUMNS`` one reads as nulls. Anything
    else that does not read is ``UnreadableFile`` naming the file."""
    from pipeline.base.config import UnreadableFile

    aside = f"move it out of {path.parent} if it does not belong to this run"
    try:
        with pq.ParquetFile(path) as fh:  # one open for the schema and the columns
            names = fh.schema_arrow.names
            missing = [c for c in columns if c not in names and c not in OPTIONAL_COLUMNS]
            if missing:
                raise UnreadableFile(f"{path}: a shard without the columns {missing}; {aside}")
            table = fh.read(columns=[c for c in columns if c in names])
    except (pa.ArrowException, OSError) as e:
        raise UnreadableFile(f"{path}: not a readable parquet file ({' '.join(str(e).split())}); {aside}") from None
    for c in columns:
        if c not in table.column_names:
            table = table.append_column(c, pa.nulls(table.num_rows))
    return table.select(columns)


def shard_tables(folder: Path, columns: list[str]) -> list[tuple[Path, pa.Table]]:
    """(file, ``_shard_table``) of every shard in a folder, in file-name order, read by a few threads (Arrow
    decodes without the GIL: a status or resume of 400 shards waited on one file at a time); the first shard in
    that order that does not read raises its ``UnreadableFile``."""
    files = sorted(Path(folder).glob("*.parquet"))
    if len(files) < 2:
        return [(f, _shard_table(f, columns)) for f in files]
    with ThreadPoolExecutor(max_workers=min(READ_THREADS, len(files))) as pool:
        return list(zip(files, pool.map(lambda f: _shard_table(f, columns), files), strict=True))


def read_ids(folder: Path) -> set[str]:
    """The ``sample_id`` of every shard in a folder, read as one column per shard (no row dicts): what a resume
    and the shard writer know is done. A shard that does not read fails as ``read_rows`` fails on it."""
    out: set[str] = set()
    for _, table in shard_tables(folder, ["sample_id"]):
        out.update(table.column("sample_id").to_pylist())
    return out


def read_samples(folder: Path, columns: list[str]) -> tuple[list[dict[str, Any]], int]:
    """Like ``read_rows``, but one row per sample_id (a sample written twice counts once in spend, counts and
    training): the first in file-name order, then row order, so every reader keeps the same copy. Also
    returns how many duplicate rows were dropped."""
    want = list(columns) if "sample_id" in columns else [*columns, "sample_id"]
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    dropped = 0
    for row in read_rows(folder, want):
        if row["sample_id"] in seen:
            dropped += 1
            continue
        seen.add(row["sample_id"])
        rows.append(row if want == columns else {c: row[c] for c in columns})
    return rows, dropped


def count_values(values: Any) -> dict[Any, int]:
    """value -> how many times, of an Arrow array, in first-seen order (what ``Counter`` gave over rows)."""
    return {r["values"]: r["counts"] for r in pa.compute.value_counts(values).to_pylist()}


def read_sample_table(folder: Path, columns: list[str]) -> tuple[pa.Table, int]:
    """``read_samples`` as one Arrow table in ``SAMPLE_SCHEMA``'s types: the same checks per shard (plus one: a
    named column of another type, e.g. a shard written by hand, is ``UnreadableFile`` too), the same first copy of
    each id kept. Also returns how many copies were left out. For counts over every sample (status at 200,000
    samples) without a Python row each."""
    from pipeline.base.config import UnreadableFile

    want = list(columns) if "sample_id" in columns else [*columns, "sample_id"]
    schema = pa.schema([SAMPLE_SCHEMA.field(c) for c in want])
    tables = []
    for f, t in shard_tables(folder, want):
        try:
            tables.append(t.cast(schema))
        except pa.ArrowException as e:  # a cast that cannot be made: a column of another type
            raise UnreadableFile(f"{f}: a shard whose columns are not of the sample types ({e}); move it out of "
                                 f"{f.parent} if it does not belong to this run") from None
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    ids = table.column("sample_id")
    dropped = 0
    if len(ids) and pa.compute.count_distinct(ids).as_py() < len(ids):
        seen: set[str] = set()
        keep = []
        for i, sid in enumerate(ids.to_pylist()):
            if sid not in seen:
                seen.add(sid)
                keep.append(i)
        dropped = len(ids) - len(keep)
        table = table.take(keep)
    return (table if want == columns else table.drop_columns(["sample_id"])), dropped


def extra_copies(folder: Path) -> tuple[dict[str, str], int]:
    """(sample_id -> the file whose copy is kept, for ids written in more than one file: the first in name
    order; how many copies are left out). Empty for a folder without duplicates. One read of ``sample_id``."""
    first: dict[str, str] = {}
    dup: dict[str, str] = {}
    dropped = 0
    for f in sorted(Path(folder).glob("*.parquet")):
        for sid in set(pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist()):
            if sid in first:
                dup[sid] = first[sid]
                dropped += 1
            else:
                first[sid] = f.name
    return dup, dropped


def read_samples_dataset(folder: Path, columns: list[str]) -> tuple[Any, int]:
    """``samples/`` as a Ray Dataset with one row per sample_id (the copy ``read_samples`` keeps), and how many
    duplicate rows were left out: training and extraction see each sample once, whatever was written."""
    import ray.data

    keep, dropped = extra_copies(folder)
    if not keep:
        return ray.data.read_parquet(str(folder), columns=columns), 0
    log.warning("samples/ holds %d extra copies of %d sample ids: each is read once", dropped, len(keep))
    want = list(columns) if "sample_id" in columns else [*columns, "sample_id"]

    def first_copy(t: Any) -> Any:
        paths = [Path(p).name for p in t["path"].to_pylist()]
        mask = [keep.get(s, name) == name for s, name in zip(t["sample_id"].to_pylist(), paths, strict=True)]
        t = t.filter(pa.array(mask, pa.bool_())).drop_columns(["path"])
        return t if want == columns else t.drop_columns(["sample_id"])

    ds = ray.data.read_parquet(str(folder), columns=want, include_paths=True)
    return ds.map_batches(first_copy, batch_format="pyarrow", num_cpus=0), dropped
