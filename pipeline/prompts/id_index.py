"""Each prompt file's sample ids, kept in the run folder so a resume knows them without parsing the file again.

The index pass parses every row of every dataset file to learn its id (a hash of the row's content); at
200,000 prompts that was ~6 s of one core on each resume, for a file that had not changed. After a full
pass it writes ``prompts/{dataset}.ids.parquet`` (``RunLayout.prompt_index``): one row per input row, in
file order, with the row's ``sample_id`` and whether it parsed (``ok``), and, in the file's metadata, the
key it holds for: the file's resolved path, size and mtime, and the dataset's settings that decide its
ids (name, format, columns, max_rows). A reader trusts it only for that key; anything else (another key, a
file that does not read as this index) means "no index", and the caller parses the file as before.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.base.layout import atomic_write_table

if TYPE_CHECKING:
    from pipeline.base.config import DatasetConfig

# Raised whenever the reading rules change a row's outcome or id (datasets.py): an index an earlier version wrote
# holds a row that now quarantines as a prompt left to do, which a resume would count and never generate.
# 2: a turn without content, tool-call arguments that are not an object, a .json row read by the JSONL rule,
# a BOM opening a later JSONL line.
VERSION = 2
KEY = b"pipeline.prompt_index"
SCHEMA = pa.schema([("sample_id", pa.string()), ("ok", pa.bool_())])


def index_key(d: DatasetConfig) -> dict[str, Any] | None:
    """What an index of ``d``'s file holds for, or None when the file cannot be stat'ed (nothing to key on)."""
    try:
        path = Path(d.path).resolve()
        st = os.stat(path)
    except OSError:
        return None
    return {"v": VERSION, "path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dataset": d.name,
            "format": d.format, "columns": dict(sorted(d.columns.items())), "max_rows": d.max_rows}


class Collector:
    """The ids of a file's rows as they are read, held as Arrow chunks (~40 bytes a row, not a Python string)."""

    CHUNK = 65_536

    def __init__(self) -> None:
        self.chunks: list[pa.RecordBatch] = []
        self.ids: list[str] = []
        self.ok: list[bool] = []

    def add(self, sample_id: str, ok: bool) -> None:
        self.ids.append(sample_id)
        self.ok.append(ok)
        if len(self.ids) >= self.CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self.ids:
            self.chunks.append(pa.record_batch([pa.array(self.ids, pa.string()), pa.array(self.ok, pa.bool_())],
                                               schema=SCHEMA))
            self.ids, self.ok = [], []

    def table(self) -> pa.Table:
        self._flush()
        return pa.Table.from_batches(self.chunks, schema=SCHEMA)


def write_index(path: Path, key: dict[str, Any], table: pa.Table) -> None:
    """The ids of every row of one file (``Collector.table``), written whole, for ``key``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_table(table.replace_schema_metadata({KEY: json.dumps(key, sort_keys=True).encode()}), path)


def read_index(path: Path, key: dict[str, Any] | None) -> pa.Table | None:
    """The index at ``path`` when it holds for ``key``; None when absent, unreadable, of another shape or key."""
    if key is None or not path.is_file():
        return None
    try:
        table = pq.read_table(path)
        meta = (table.schema.metadata or {}).get(KEY)
        stored = json.loads(meta) if meta else None
    except (pa.ArrowException, OSError, ValueError):
        return None
    if stored != json.loads(json.dumps(key, sort_keys=True)) or not table.schema.equals(SCHEMA):
        return None
    if table.column("sample_id").null_count or table.column("ok").null_count:
        return None
    return table


def rows_left(table: pa.Table, skip: set[str], only: set[str] | None = None) -> set[int]:
    """The indices of the rows a generation pass reads (parsed, not in ``skip``, in ``only`` when given): the
    read parses these rows only."""
    ids = table.column("sample_id")
    keep = pc.and_(table.column("ok"), pc.invert(pc.is_in(ids, value_set=pa.array(list(skip), pa.string()))))
    if only is not None:
        keep = pc.and_(keep, pc.is_in(ids, value_set=pa.array(list(only), pa.string())))
    return set(pc.indices_nonzero(keep).to_pylist())


def indexed_counts(table: pa.Table, skip: set[str], worn: set[str]) -> int | None:
    """The prompts left to do by the index alone (rows that parsed, not in ``skip``), or None when a row not in
    ``skip`` needs its content: a malformed or worn-out row the index pass must write to quarantine."""
    ids = table.column("sample_id")
    left = pc.invert(pc.is_in(ids, value_set=pa.array(list(skip), pa.string())))
    needs_row = pc.invert(table.column("ok"))
    if worn:
        needs_row = pc.or_(needs_row, pc.is_in(ids, value_set=pa.array(list(worn), pa.string())))
    if pc.any(pc.and_(left, needs_row)).as_py():
        return None
    return int(pc.sum(left).as_py() or 0)
