"""What a resume and ``status`` count from a source's response journal, without parsing it whole each time.

Each journal file is append-only (one writer, ``journal.ResponseJournal``), ~770 bytes a record with the answer's
text; at 200,000 records a parse took ~2 s of one core on every resume and every ``status``. Beside each file,
``responses/.totals/{file}.parquet`` keeps the few fields the counts need (source, sample id, dataset, kind,
generation id, charged tokens, cost, error) and the replay index needs (identity, time, each line's byte span:
``replay.ReplayIndex``) for the file's bytes up to its last whole line (a line that does not read is a row too,
with what of it still reads and why: ``journal.unreadable_row``, said by every reader), with that offset and a
digest of the bytes before it: the file's writer stores it when idle (the HTTP source's idle close, so a finished
run leaves it), and a reader that parsed more of the file stores its own. A reader takes the projection while the
file still holds those bytes (same inode, at least as long, the same bytes before the offset) and parses only what
was appended since; anything else (no projection, one that does not read, a file rewritten) is a full parse. Writing
the projection is best effort: a folder this process may not write is only slower to read.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.generate.sources.http.journal import (
    PROJECTION_META,
    PROJECTION_SCHEMA,
    PROJECTION_VERSION,
    file_source,
    journal_files,
    projected_row,
    projection_batch,
    projection_path,
    record_fields,
    store_projection,
    tail_digest,
    unreadable_row,
    unreadable_warning,
)

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class JournalTotals:
    """What the driver and ``status`` count from one source's journal.

    ``billed``/``cost``: per dataset, a record journaled twice under one ``generation_id`` counted once;
    ``gave_up``: sample_id -> (runs that gave up on it, the last error); ``responded``: sample_id -> dataset of
    every prompt with a journaled response (status's paid-not-written count)."""

    billed: dict[str, int]
    cost: dict[str, float]
    gave_up: dict[str, tuple[int, str]]
    responded: dict[str, str]
    # Lines that do not read and name no prompt (no sample id reads in them): if one was a paid response, its
    # prompt is not known as answered and may be asked (and paid for) again; ``status`` says how many.
    nameless: int = 0


def _table(rows: list[tuple[Any, ...]]) -> pa.Table:
    return pa.Table.from_batches([projection_batch(rows)])


def _parse(path: Path, data: bytes, start: int) -> list[tuple[Any, ...]]:
    """The projected rows of whole lines ``data`` (read from byte ``start`` of ``path``); a line that does not
    read is a row too, with what of it still reads and why it does not (``journal.unreadable_row``): its readers
    say so each time they read it (``warn_unreadable``), and the replay index holds its prompt as paid."""
    rows = []
    at = start
    source = file_source(path)
    for line in data.split(b"\n"):
        if line.strip():
            try:
                rows.append(projected_row(record_fields(line), at, at + len(line)))
            except (ValueError, TypeError, RecursionError) as e:  # RecursionError: the stdlib parser, nested deep
                rows.append(unreadable_row(line, at, at + len(line), str(e), source))
        at += len(line) + 1
    return rows


def warn_unreadable(path: Path, table: pa.Table, where: str = "journal") -> None:
    """Log, loudly, each line of journal ``path`` that does not read (``table``: rows of its projection), and
    what becomes of it (``journal.unreadable_warning``)."""
    bad = table.filter(pc.not_equal(table.column("unreadable"), ""))
    for sid, dataset, kind, start, why in zip(*(bad.column(c).to_pylist() for c in (
            "sample_id", "dataset", "kind", "start", "unreadable")), strict=True):
        log.warning("%s %s", where, unreadable_warning(path, start, why, sid, dataset, kind))


def _cached(cache: Path, fh: Any, st: os.stat_result) -> tuple[pa.Table, int] | None:
    """The stored projection and its offset, when it still holds for the open file ``fh``; else None."""
    if not cache.is_file():
        return None
    try:
        table = pq.read_table(cache)
        meta = json.loads((table.schema.metadata or {}).get(PROJECTION_META, b"null"))
        if not isinstance(meta, dict) or meta.get("v") != PROJECTION_VERSION \
                or not table.schema.equals(PROJECTION_SCHEMA):
            return None
        offset = meta["offset"]
        if not isinstance(offset, int) or meta.get("ino") != st.st_ino or not 0 <= offset <= st.st_size:
            return None
        if meta.get("digest") != tail_digest(fh.fileno(), offset):
            return None
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError):
        return None
    return table, offset


READ_CHUNK = 8 << 20  # bytes of a journal parsed at once: a reader's memory is a chunk, not the file


def file_projection(path: Path) -> pa.Table:
    """The projected rows of one journal file, in write order: its stored projection and what was appended
    since, read ``READ_CHUNK`` bytes at a time, the stored one brought up to date; a torn last line (a kill
    mid-write) is left out."""
    return projection_to(path)[0]


def projection_to(path: Path) -> tuple[pa.Table, int]:
    """``file_projection`` and the byte offset it covers (the end of the file's last whole line)."""
    cache = projection_path(path)
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        cached = _cached(cache, fh, st)
        table, start = cached if cached is not None else (_table([]), 0)
        fh.seek(start)
        parts, pos, carry = [table], start, b""
        while chunk := fh.read(READ_CHUNK):
            data = carry + chunk
            whole = data.rfind(b"\n") + 1
            if whole:
                parts.append(_table(_parse(path, data[: whole - 1], pos)))
                pos += whole
            carry = data[whole:]
        if pos > start:
            table = pa.concat_tables(parts)
            store_projection(path, table, fh.fileno(), pos)
    if carry.strip():
        log.info("journal %s: skipping a torn last line (%d bytes)", path, len(carry))
    return table, pos


def totals_of(table: pa.Table) -> JournalTotals:
    """``JournalTotals`` of one source's projected rows (its files' in order). A line that does not read counts
    as far as it does (``journal.unreadable_row``): its bill where its dataset reads (a bill no dataset reads in
    cannot be put on a budget: ``warn_unreadable`` says so), its prompt as answered (or given up on) where its
    sample id reads and its kind is that one or does not read."""
    readable = pc.equal(table.column("unreadable"), "")
    held = pc.and_(pc.invert(readable), pc.not_equal(table.column("sample_id"), ""))
    kind = table.column("kind")
    bills = table.filter(pc.or_(readable, pc.not_equal(table.column("dataset"), "")))
    index = pa.array(range(bills.num_rows), pa.int64())
    generation = bills.column("generation_id")
    named = pc.not_equal(generation, "")
    firsts = pa.table({"g": generation, "i": index}).filter(named).group_by("g", use_threads=False).aggregate(
        [("i", "min")]).column("i_min")
    counted = bills.filter(pc.or_(pc.invert(named), pc.is_in(index, value_set=firsts)))
    sums = counted.group_by("dataset", use_threads=False).aggregate([("charged", "sum"), ("cost", "sum")])
    billed = dict(zip(sums.column("dataset").to_pylist(), sums.column("charged_sum").to_pylist(), strict=True))
    cost = dict(zip(sums.column("dataset").to_pylist(), sums.column("cost_sum").to_pylist(), strict=True))
    gave_up: dict[str, tuple[int, str]] = {}
    gave = pc.and_(pc.equal(kind, "gave_up"), pc.or_(readable, held))
    for sid, error in zip(*(table.filter(gave).column(c).to_pylist() for c in ("sample_id", "error")), strict=True):
        gave_up[sid] = (gave_up.get(sid, (0, ""))[0] + 1, error)
    answered = table.filter(pc.or_(pc.and_(pc.equal(kind, "response"), pc.or_(readable, held)),
                                   pc.and_(held, pc.equal(kind, ""))))
    responded = dict(zip(answered.column("sample_id").to_pylist(), answered.column("dataset").to_pylist(),
                         strict=True))
    nameless = pc.and_(pc.invert(readable), pc.equal(table.column("sample_id"), ""))
    maybe_response = pc.or_(pc.equal(kind, "response"), pc.equal(kind, ""))
    return JournalTotals(billed, cost, gave_up, responded,
                         int(pc.sum(pc.and_(nameless, maybe_response).cast(pa.int64())).as_py() or 0))


_TOTALS: dict[tuple[str, str], tuple[tuple[tuple[str, int, int], ...], JournalTotals]] = {}


def journal_totals(folder: str | Path, source: str) -> JournalTotals:
    """``JournalTotals`` of ``source`` in a responses folder: each file's stored projection plus what was
    appended since (``file_projection``), and one count per process while the files are unchanged (a resume
    asks for three of its figures at three places)."""
    files = journal_files(folder, source)
    signature = tuple((str(p), st.st_size, st.st_mtime_ns) for p in files for st in (p.stat(),))
    key = (str(Path(folder)), source)
    cached = _TOTALS.get(key)
    if cached is not None and cached[0] == signature:
        return cached[1]
    tables = [file_projection(p) for p in files]
    for path, t in zip(files, tables, strict=True):
        warn_unreadable(path, t.filter(pc.equal(t.column("source"), source)))
    table = pa.concat_tables(tables) if tables else _table([])
    totals = totals_of(table.filter(pc.equal(table.column("source"), source)))  # "a-*" also matches "a-b"'s
    _TOTALS[key] = (signature, totals)
    return totals


def billed_by_dataset(folder: str | Path, source: str) -> dict[str, int]:
    """Completion tokens journaled per dataset (responses and billed failures), to restore the ledger's spend.

    The provider billed them whether or not a sample was written. A record journaled twice under one
    ``generation_id`` counts once."""
    return dict(journal_totals(folder, source).billed)


def cost_by_dataset(folder: str | Path, source: str) -> dict[str, float]:
    """Reported cost per dataset, counted like :func:`billed_by_dataset` (for ``Ledger.restore``)."""
    return dict(journal_totals(folder, source).cost)


def gave_up_counts(folder: str | Path, source: str) -> dict[str, tuple[int, str]]:
    """sample_id -> (runs that gave up on it after transient failures, the last such error)."""
    return dict(journal_totals(folder, source).gave_up)
