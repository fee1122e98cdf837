"""A paid response is never paid twice: every billed API response goes to an append-only journal.

Each HTTP source actor appends one JSON line per billed response (or billed
failed attempt) to its own file, ``RunLayout(out).responses /
f"{source}-{actor_uuid}.jsonl"`` (one writer per file: no cross-process locking).
A killed run keeps what it was billed for, and a resumed run reads the journal
(:func:`load_responses`) to rebuild those samples without the network, and
restores the ledger's spend from it (``totals.billed_by_dataset``).

Durability without slowing the event loop: ``append`` writes each record
through to the OS before it returns (one ``os.write``; that survives a SIGKILL
of the process), and a background thread fsyncs at most once per
``flush_every_s`` (that bounds what a host crash loses). A failed write stops
the journal and, through :class:`JournalError`, the source. Readers skip a torn
last line (a kill mid-write).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

import pyarrow as pa

from pipeline.base.layout import atomic_write_table

try:
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)  # serialises dataclasses natively

    _loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is a declared dependency
    def _dumps(obj: Any) -> bytes:
        if not isinstance(obj, dict):
            obj = {name: getattr(obj, name) for name in _FIELDS}
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    _loads = json.loads

log = logging.getLogger(__name__)
T = TypeVar("T")

# response: a served, billed answer; billed_failure: a failed attempt that was (or may have been) billed;
# gave_up: a run ran out of retries on transient failures for this prompt (bills nothing; counted across runs).
Kind = Literal["response", "billed_failure", "gave_up"]
KINDS = ("response", "billed_failure", "gave_up")
SCHEMA_VERSION = 1


def request_digest(body: Mapping[str, Any]) -> str:
    """sha256 of a request body in canonical JSON (sorted keys, no spaces, UTF-8).

    Digest the body as built from the prompt and the configuration only (no
    run-time provider exclusions), so the same prompt under the same settings
    gets the same digest in a resumed run; stdlib json keeps it stable whether
    or not orjson is installed.
    """
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


@dataclass(slots=True)
class Record:
    """One billed attempt: a served response, or a failed attempt the provider still billed.

    ``billed_completion_tokens`` is ``usage.completion_tokens`` as the API sent it
    (-1: no usage); ``charged_tokens`` is what the ledger was settled with when
    that differs (the whole reservation when no usage came back). A
    ``billed_failure`` carries the billing fields only.
    """

    sample_id: str
    dataset: str
    source: str
    model: str
    sampling: str  # JSON string, as in the sample rows
    request_digest: str
    kind: Kind = "response"
    provider: str = ""
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str = ""
    native_finish_reason: str | None = None
    billed_completion_tokens: int = 0
    charged_tokens: int | None = None
    cost: float = 0.0
    generation_id: str = ""
    t_generate_s: float = 0.0
    attempts: int = 0
    error: str = ""  # gave_up: the last failure (secrets redacted)
    identity: str = ""  # the source's identity (model, endpoint, budget scope): what a renamed source replays
    at: float = field(default_factory=time.time)  # when it was journaled (orders records across files)
    v: int = SCHEMA_VERSION

    @property
    def charged(self) -> int:
        """Tokens this attempt counts against its dataset's budget."""
        if self.charged_tokens is not None:
            return max(0, int(self.charged_tokens))
        return max(0, int(self.billed_completion_tokens))

    def to_json(self) -> bytes:
        """One journal line, newline included."""
        return _dumps(self) + b"\n"

    @classmethod
    def from_json(cls, line: bytes | str) -> Record:
        """Parse one journal line; ValueError for a torn or foreign line (unknown keys are ignored).

        Every field is checked against its declared type (``record_fields``, then ``replay_fields``), so a record
        it returns replays into a sample row without raising; a field of the wrong type is a ValueError naming
        it, never a Record that fails later."""
        data = replay_fields(record_fields(line))
        return cls(**{k: v for k, v in data.items() if k in _FIELD_SET})


def record_fields(line: bytes | str) -> dict[str, Any]:
    """One journal line's fields, checked as a ``Record`` needs them (ValueError for a torn or foreign line): the
    parse of ``Record.from_json`` without building the record, for a reader that only counts (``totals``).

    Every field a reader turns into an Arrow column (``projected_row``) is checked against that column's type
    here, inside the readers' per-line skip: a foreign value found later, at the conversion of a whole chunk,
    would stop a resume instead of skipping its one line."""
    data = _loads(line)
    if not isinstance(data, dict):
        raise ValueError("journal line is not an object")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"journal line lacks {missing}")
    if data.get("kind", "response") not in KINDS:
        raise ValueError(f"unknown record kind {data.get('kind')!r}")
    for key in _TEXT:
        if not _is_text(data[key]):
            raise ValueError(f"{key} must be a string")
    for key in _OPTIONAL_TEXT:
        if data.get(key) is not None and not _is_text(data[key]):
            raise ValueError(f"{key} must be a string or null")
    if not _is_int64(data.get("billed_completion_tokens", 0)):
        raise ValueError("billed_completion_tokens must be a 64-bit integer")
    if data.get("charged_tokens") is not None and not _is_int64(data["charged_tokens"]):
        raise ValueError("charged_tokens must be a 64-bit integer or null")
    if data.get("cost") is not None and not _is_finite(data["cost"]):
        raise ValueError("cost must be a finite number or null")
    if "at" in data and not _is_finite(data["at"]):  # ``load_responses`` orders by it
        raise ValueError("at must be a finite number")
    return data


def readable_fields(line: bytes | str) -> dict[str, Any]:
    """What of a line that fails ``record_fields`` still reads: its JSON object (empty when the line is no JSON
    object at all: torn, foreign, nested past the parser's depth). Never raises; each field is to be checked
    before use (``unreadable_row``)."""
    try:
        data = _loads(line)
    except (ValueError, TypeError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def unreadable_row(line: bytes | str, start: int, end: int, reason: str, source: str) -> tuple[Any, ...]:
    """The projected row (``PROJECTION_SCHEMA``) of a line that fails ``record_fields`` (``reason``: why), so that
    no reader forgets it was there: each counted field that still reads (a value of its column's type), the
    others blank, and ``unreadable`` the reason.

    ``source``: the source of the file's writer (``{source}-{actor}.jsonl``), for a line whose own does not read.
    ``kind`` is "" when it does not read (the line may be a response: the replay index holds its prompt). The
    bill is counted as far as it reads, never under what the provider may have billed: tokens whose field does
    not read count as the request's whole reservation (``max_tokens`` of its ``sampling``, when that reads) or
    the billed count if larger, as the engine charges a bill it cannot read; dollars that do not read count 0
    here (the request's dollar reservation is not journaled: the ledger's journal, which holds every granted
    reservation before its request goes out, is what a resume restores them from)."""
    data = readable_fields(line)

    def text(key: str, default: str = "") -> str:
        value = data.get(key)
        return value if _is_text(value) else default

    kind = data.get("kind", "response") if data else ""  # absent: a response, as ``record_fields`` reads it
    kind = kind if isinstance(kind, str) and kind in KINDS else ""
    at, cost = data.get("at"), data.get("cost")
    why = (reason or "unreadable").encode("utf-8", "backslashreplace").decode()  # an Arrow string, whatever it says
    return (text("source", source), text("sample_id"), text("dataset"), kind, text("generation_id"),
            _charged_bound(data, kind), float(cost) if _is_finite(cost) else 0.0, text("error"), text("identity"),
            float(at) if _is_finite(at) else 0.0, start, end, why)


def _charged_bound(data: Mapping[str, Any], kind: str) -> int:
    """Tokens to count for a line that fails ``record_fields``: what the writer charged where that reads, else
    the most its request can have been charged (see ``unreadable_row``)."""
    if kind == "gave_up":
        return 0  # no request billed
    charged, billed = data.get("charged_tokens"), data.get("billed_completion_tokens", 0)
    if _is_int64(charged):
        return max(0, charged)
    if charged is None and _is_int64(billed) and billed >= 0:
        return billed  # the writer charges what was billed when it says nothing else (``projected_row``)
    reserved = 0
    sampling = data.get("sampling")
    if _is_text(sampling):
        try:
            asked = json.loads(sampling)
        except (ValueError, RecursionError):
            asked = None
        if isinstance(asked, dict) and _is_int64(asked.get("max_tokens")):
            reserved = max(0, asked["max_tokens"])
    return max(reserved, billed if _is_int64(billed) else 0)


def file_source(path: str | Path) -> str:
    """The source whose actor writes journal file ``path`` (``RunLayout.response_journal``: ``{source}-{actor}``,
    the actor a hex id)."""
    return Path(path).stem.rsplit("-", 1)[0]


def unreadable_warning(path: str | Path, start: int, why: str, sample_id: str, dataset: str, kind: str) -> str:
    """The warning for a line of ``path`` at byte ``start`` that fails ``record_fields`` (``why``; the other
    arguments: its ``unreadable_row``'s fields): what becomes of it."""
    bill = "its bill counted as far as it reads" if dataset else "its bill not counted (no dataset reads in it)"
    if not sample_id:
        return (f"{path}: skipping the unreadable line at byte {start} ({why}): no sample id reads in it, so if it "
                f"was a paid response its prompt may be asked (and paid for) again; {bill}; repair the line to "
                "keep it")
    head = f"{path}: the line at byte {start} does not read ({why})"
    if kind in ("response", ""):
        return (f"{head}: its prompt {sample_id} is held as paid (left to do, class journal), not asked again on "
                f"its own; {bill}")
    return f"{head}: {bill}"


def replay_fields(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a line's ``record_fields``) with the fields a replay reads checked too: the answer's text, tool
    calls and the figures that go into the sample row (ValueError naming the first of the wrong type).

    Apart from ``record_fields``: the counting readers (``totals``, the replay index) need only what it checks,
    so a line with a bad answer still counts as billed; only its replay (``Record.from_json``) refuses it."""
    for key in _REPLAY_TEXT:
        if key in data and not _is_text(data[key]):
            raise ValueError(f"{key} must be a string")
    for key in _REPLAY_OPTIONAL_TEXT:
        if data.get(key) is not None and not _is_text(data[key]):
            raise ValueError(f"{key} must be a string or null")
    if data.get("tool_calls") is not None and not _is_tool_calls(data["tool_calls"]):
        raise ValueError("tool_calls must be null or a list of {function: {name, arguments}} objects of strings")
    if "t_generate_s" in data and not _is_finite(data["t_generate_s"]):
        raise ValueError("t_generate_s must be a finite number")
    if "attempts" in data and not _is_int64(data["attempts"]):
        raise ValueError("attempts must be a 64-bit integer")
    return data


def _is_tool_calls(value: Any) -> bool:
    """Tool calls as the journal writes them (``wire`` normalises an answer's): objects whose ``function`` has a
    string ``name`` and string ``arguments``."""
    if not isinstance(value, list):
        return False
    for call in value:
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and _is_text(fn.get("name")) and _is_text(fn.get("arguments"))
                and (call.get("id") is None or _is_text(call["id"]))):
            return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int64(value: Any) -> bool:
    """An int an Arrow int64 column holds (orjson reads up to 2**64 - 1, the stdlib parser any size)."""
    return _is_int(value) and -(1 << 63) <= value < 1 << 63


def _is_finite(value: Any) -> bool:
    """A JSON number that is not NaN or infinite (the stdlib parser reads those; a sum would carry them)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_text(value: Any) -> bool:
    """A str that encodes as UTF-8 (the stdlib parser keeps a lone surrogate escape, which Arrow refuses)."""
    if not isinstance(value, str):
        return False
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


_FIELDS = tuple(f.name for f in fields(Record))
_FIELD_SET = frozenset(_FIELDS)
_REQUIRED = ("sample_id", "dataset", "source", "model", "sampling", "request_digest")
_TEXT = ("sample_id", "dataset", "source")  # required, and string columns of the projection
_OPTIONAL_TEXT = ("generation_id", "error", "identity")  # string columns too; null projects as ""
_REPLAY_TEXT = ("model", "sampling", "request_digest", "provider", "finish_reason")  # strings where present
_REPLAY_OPTIONAL_TEXT = ("reasoning", "content", "native_finish_reason")


# -- the projection: the fields a resume and ``status`` count, kept beside each file ----------------------------
# (read by ``totals``; written by a file's writer when idle and by a reader that parsed the file)

# 2: identity, at and each line's byte span (the replay index reads them); 3: the lines that do not read, as rows
# with ``unreadable`` set (``unreadable_row``): a projection that left them out forgot a paid prompt
PROJECTION_VERSION = 3
PROJECTION_META = b"pipeline.journal_projection"
PROJECTION_DIR = ".totals"
DIGEST_BYTES = 4096  # the bytes before the offset that must still be there for a projection to hold
PROJECTION_SCHEMA = pa.schema([("source", pa.string()), ("sample_id", pa.string()), ("dataset", pa.string()),
                               ("kind", pa.string()), ("generation_id", pa.string()), ("charged", pa.int64()),
                               ("cost", pa.float64()), ("error", pa.string()), ("identity", pa.string()),
                               ("at", pa.float64()), ("start", pa.int64()), ("end", pa.int64()),
                               ("unreadable", pa.string())])  # "" for a line that reads; else why it does not
PROJECTION_CHUNK = 65_536  # rows a writer holds as Python before they become an Arrow batch


def projection_path(path: Path) -> Path:
    """Where the projection of journal file ``path`` is kept."""
    return path.parent / PROJECTION_DIR / f"{path.name}.parquet"


def projected_row(rec: Mapping[str, Any], start: int, end: int) -> tuple[Any, ...]:
    """One checked journal line's (``record_fields``) counted fields and where the line lies (bytes ``start`` to
    ``end``, its newline excluded), in ``PROJECTION_SCHEMA``'s order."""
    charged = rec.get("charged_tokens")
    charged = rec.get("billed_completion_tokens", 0) if charged is None else charged
    at = rec.get("at")
    return (rec["source"], rec["sample_id"], rec["dataset"], rec.get("kind", "response"),
            str(rec.get("generation_id") or ""), max(0, int(charged)), float(rec.get("cost") or 0.0),
            str(rec.get("error") or ""), str(rec.get("identity") or ""),
            float(at) if isinstance(at, int | float) and not isinstance(at, bool) else 0.0, start, end, "")


def projection_batch(rows: list[tuple[Any, ...]]) -> pa.RecordBatch:
    columns = list(zip(*rows, strict=True)) if rows else [[] for _ in PROJECTION_SCHEMA]
    return pa.record_batch([pa.array(c, f.type) for c, f in zip(columns, PROJECTION_SCHEMA, strict=True)],
                           schema=PROJECTION_SCHEMA)


def tail_digest(fd: int, offset: int) -> str:
    """A digest of the ``DIGEST_BYTES`` of open file ``fd`` before ``offset``: what must not have changed."""
    start = max(0, offset - DIGEST_BYTES)
    return hashlib.sha256(os.pread(fd, offset - start, start)).hexdigest()


def store_projection(path: Path, table: pa.Table, fd: int, offset: int) -> None:
    """Keep ``table`` as the projection of ``path``'s first ``offset`` bytes (``fd``: the file, open). Best
    effort: a folder this process may not write (status run by another user) is only slower to read later."""
    st = os.fstat(fd)
    meta = {"v": PROJECTION_VERSION, "offset": offset, "ino": st.st_ino, "digest": tail_digest(fd, offset)}
    cache = projection_path(path)
    try:
        cache.parent.mkdir(exist_ok=True)
        atomic_write_table(table.replace_schema_metadata({PROJECTION_META: json.dumps(meta).encode()}), cache)
    except OSError as e:
        log.debug("journal projection %s not written: %s", cache, e)


class JournalError(RuntimeError):
    """The journal cannot record billed responses (a write or fsync failed): the source must stop sending.

    Raised by every ``append`` from the failing one on, and by ``flush``/``close``
    of a failed journal. The message names the file and the OS error, never a record's content.
    """


class ResponseJournal:
    """Append-only journal of one source actor's billed responses.

    ``append`` writes its record through: one ``os.write`` of the whole line on an
    O_APPEND descriptor (no Python-side buffer) before it returns, so a record is
    the OS's once a request counts as answered and survives a SIGKILL of the
    process. Writing to the page cache takes microseconds; what can stall
    (``fsync``, slow on NFS) stays off the event loop: a daemon thread fsyncs at
    most once per ``flush_every_s`` when something was written since, so a host
    crash loses at most that window. ``flush`` fsyncs now; ``close`` fsyncs and
    closes (also run at interpreter exit).

    A failed write or fsync marks the journal failed for good (``error`` holds the
    OS error) and raises :class:`JournalError`, then and on every later append:
    a billed response that cannot be journaled must stop the source rather than
    pile up in memory. Safe to call from one asyncio loop and from other threads:
    a lock orders appends (a short write is finished before the next line starts),
    another keeps ``fsync`` and ``close`` apart, and neither is held across the other's I/O.
    """

    def __init__(self, path: str | Path, flush_every_s: float = 1.0) -> None:
        if flush_every_s <= 0:
            raise ValueError("flush_every_s must be > 0")
        self.path = Path(path)
        self.flush_every_s = float(flush_every_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._heal_tail()
        # The projection of what this writer appends (``store_projection``), kept only for a file it began:
        # a reopened file's readers parse what it held, then take the stored rest.
        self._start = os.fstat(self._fd).st_size
        self._bytes = 0  # appended by this writer
        self._stored = -1  # self._bytes when the projection was last stored
        self._batches: list[pa.RecordBatch] = []
        self._rows: list[tuple[Any, ...]] = []
        self._write_lock = threading.Lock()  # orders appends; guards _closed and the descriptor's life
        self._sync_lock = threading.Lock()  # one fsync at a time, never across close
        self._stop = threading.Event()
        self._closed = False
        self.error: OSError | None = None  # why the journal failed (it accepts nothing more)
        self._failed_op = ""  # "write" or "fsync", once it failed
        self.written = 0  # records handed to the OS (survive a kill of this process)
        self.synced = 0  # records fsynced (survive a crash of the host)
        self._thread = threading.Thread(target=self._run, name=f"journal:{self.path.name}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _heal_tail(self) -> None:
        """Reopening a file whose last line was torn: start on a fresh line so the next record parses."""
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")

    def append(self, record: Record) -> None:
        """Write one record through to the OS before returning; :class:`JournalError` if it cannot be."""
        line = record.to_json()
        with self._write_lock:
            if self.error is not None:
                raise self._failure()
            if self._closed:
                raise ValueError(f"journal {self.path} is closed")
            try:
                done = os.write(self._fd, line)
                while done < len(line):  # a short write (nearly full disk, a signal): finish this line first
                    n = os.write(self._fd, memoryview(line)[done:])
                    if n <= 0:
                        raise OSError(errno.EIO, "write wrote nothing")
                    done += n
            except OSError as e:
                self._fail(e, "write")
                raise self._failure() from e
            self.written += 1
            self._rows.append((record.source, record.sample_id, record.dataset, record.kind,
                               record.generation_id or "", record.charged, float(record.cost or 0.0),
                               record.error or "", record.identity or "", float(record.at), self._bytes,
                               self._bytes + len(line) - 1, ""))
            self._bytes += len(line)
            if len(self._rows) >= PROJECTION_CHUNK:
                self._batches.append(projection_batch(self._rows))
                self._rows = []

    def store_projection(self) -> None:
        """Keep the projection of everything this writer appended beside the file (``totals`` reads it), when
        the file is the writer's own from its first byte and holds exactly what it appended; a writer calls
        it when idle (the HTTP source's idle close). Skipped when nothing was appended since the last one."""
        with self._write_lock:
            if self._closed or self.error is not None or self._start or self._stored == self._bytes:
                return
            if os.fstat(self._fd).st_size != self._bytes:  # written by someone else too: leave it to readers
                return
            if self._rows:
                self._batches.append(projection_batch(self._rows))
                self._rows = []
            table = pa.Table.from_batches(self._batches, schema=PROJECTION_SCHEMA)
            store_projection(self.path, table, self._fd, self._bytes)
            self._stored = self._bytes

    def flush(self) -> None:
        """fsync now (blocking); raises :class:`JournalError` if the journal failed (now or before)."""
        self._sync()
        if self.error is not None:
            raise self._failure()

    def close(self) -> None:
        """fsync and close; idempotent. Raises :class:`JournalError` if the journal failed."""
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self._sync()
        finally:
            with self._write_lock, self._sync_lock:
                os.close(self._fd)
                self._fd = -1
        if self.error is not None:
            raise self._failure()

    def __enter__(self) -> ResponseJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- durability and failure ------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            self._sync()

    def _sync(self) -> None:
        """fsync if anything was written since the last one (every record counted in ``written`` is covered)."""
        with self._sync_lock:
            target = self.written
            # After a failed write the lines before it are still worth an fsync; after a failed fsync,
            # another one proves nothing (the kernel reports a lost writeback once).
            if self._fd < 0 or target == self.synced or self._failed_op == "fsync":
                return
            try:
                os.fsync(self._fd)
            except OSError as e:
                self._fail(e, "fsync")
                return
            self.synced = target

    def _fail(self, e: OSError, what: str) -> None:
        if self.error is None:
            self.error, self._failed_op = e, what
            log.error("journal %s: %s failed, the source must stop: %s", self.path, what, _os_error_text(e))

    def _failure(self) -> JournalError:
        assert self.error is not None
        return JournalError(f"journal {self.path}: {self._failed_op} failed: {_os_error_text(self.error)}"
                            f" ({self.written} record(s) written before)")


def _os_error_text(e: OSError) -> str:
    """``No space left on device (ENOSPC)``: the errno's text and name, without whatever else an OSError carries."""
    if e.errno is None:
        return type(e).__name__
    return f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"


# -- reading ------------------------------------------------------------------------


def iter_journal(path: str | Path, parse: Callable[[bytes], T] = Record.from_json) -> Iterator[T]:  # type: ignore[assignment]
    """The records of one journal file in write order (``parse`` of each line: a ``Record`` unless told);
    skips a torn last line, and (loudly) any other bad line."""
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield parse(line)
        except (ValueError, TypeError, RecursionError) as e:  # RecursionError: the stdlib parser, nested deep
            if i == last:
                log.info("journal %s: skipping a torn last line (%d bytes)", path, len(line))
            else:
                log.warning("journal %s: skipping unreadable line %d: %s", path, i + 1, e)


def journal_files(folder: str | Path, source: str) -> list[Path]:
    """The journal files of one source in a responses folder (``RunLayout(out).responses``)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"{_glob_escape(source)}-*.jsonl") if p.is_file())


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _records(folder: str | Path, source: str) -> Iterator[Record]:
    for path in journal_files(folder, source):
        for rec in iter_journal(path):
            if rec.source == source:  # "a-*" also matches source "a-b"'s files
                yield rec


def load_responses(folder: str | Path, source: str) -> dict[str, Record]:
    """sample_id -> the latest journaled response of ``source`` across all its actors' files.

    ``folder`` is the responses folder (``RunLayout(out).responses``). Compare a
    record's ``request_digest`` with the request a resumed run would send before
    reusing it: a changed prompt or setting needs a new response.
    """
    out: dict[str, Record] = {}
    for rec in _records(folder, source):
        if rec.kind != "response":
            continue
        seen = out.get(rec.sample_id)
        if seen is None or rec.at >= seen.at:
            out[rec.sample_id] = rec
    return out
