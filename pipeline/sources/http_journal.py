"""A paid response is never paid twice: every billed API response goes to an append-only journal.

Each HTTP source actor appends one JSON line per billed response (or billed
failed attempt) to its own file, ``RunLayout(out).responses /
f"{source}-{actor_uuid}.jsonl"`` (one writer per file: no cross-process locking).
A killed run keeps what it was billed for, and a resumed run reads the journal
(:func:`load_responses`) to rebuild those samples without the network, and
restores the ledger's spend from it (:func:`billed_by_dataset`).

Durability without slowing the event loop: ``append`` only serialises and
buffers; a background thread hands each batch to the OS as soon as it forms
(that survives a SIGKILL of the process) and fsyncs at most once per
``flush_every_s`` (that bounds what a host crash loses). Readers skip a torn
last line (a kill mid-write).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pipeline.layout import RunLayout

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
        """Parse one journal line; ValueError for a torn or foreign line (unknown keys are ignored)."""
        data = _loads(line)
        if not isinstance(data, dict):
            raise ValueError("journal line is not an object")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"journal line lacks {missing}")
        if data.get("kind", "response") not in KINDS:
            raise ValueError(f"unknown record kind {data.get('kind')!r}")
        rec = cls(**{k: v for k, v in data.items() if k in _FIELD_SET})
        if not isinstance(rec.sample_id, str) or not isinstance(rec.dataset, str):
            raise ValueError("sample_id and dataset must be strings")
        if not isinstance(rec.billed_completion_tokens, int):
            raise ValueError("billed_completion_tokens must be an integer")
        return rec


_FIELDS = tuple(f.name for f in fields(Record))
_FIELD_SET = frozenset(_FIELDS)
_REQUIRED = ("sample_id", "dataset", "source", "model", "sampling", "request_digest")


def journal_path(out: str | Path, source: str, actor_uuid: str) -> Path:
    """The journal file of one source actor in run folder ``out``."""
    return RunLayout(out).responses / f"{source}-{actor_uuid}.jsonl"


class JournalError(RuntimeError):
    """The journal could not be written; records stay buffered and are retried."""


class ResponseJournal:
    """Append-only journal of one source actor's billed responses.

    ``append`` is cheap (serialise + buffer) and never blocks on disk; a daemon
    thread writes each batch as it forms and fsyncs at most once per
    ``flush_every_s``. ``flush`` writes and fsyncs now; ``close`` does the same
    and stops the thread (also run at interpreter exit). Safe to call from one
    asyncio loop and from other threads: a lock guards the buffer swap and
    another orders writes, because the flusher is a second thread.
    If writing fails the records stay buffered and are retried; ``error`` says
    why (stop sending new requests while it is set) and ``flush`` raises it.
    """

    def __init__(self, path: str | Path, flush_every_s: float = 1.0) -> None:
        if flush_every_s <= 0:
            raise ValueError("flush_every_s must be > 0")
        self.path = Path(path)
        self.flush_every_s = float(flush_every_s)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._heal_tail()
        self._pending: list[bytes] = []
        self._buf_lock = threading.Lock()  # guards _pending and _closed
        self._io_lock = threading.Lock()  # orders writes and fsyncs
        self._wake = threading.Event()
        self._closed = False
        self._unsynced = False
        self._last_sync = time.monotonic()
        self.error: OSError | None = None
        self.appended = 0  # records accepted
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
        """Buffer one record; the flusher thread writes it within moments."""
        line = record.to_json()
        with self._buf_lock:
            if self._closed:
                raise ValueError(f"journal {self.path} is closed")
            self._pending.append(line)
            self.appended += 1
        if not self._wake.is_set():
            self._wake.set()

    def flush(self) -> None:
        """Write everything buffered and fsync now (blocking); raises :class:`JournalError` if writing fails."""
        self._write(sync=True)
        if self.error is not None:
            raise JournalError(f"journal {self.path}: {self.error}") from self.error

    def close(self) -> None:
        """Flush, fsync and close; idempotent."""
        with self._buf_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30.0)
        try:
            self._write(sync=True)
        finally:
            with self._io_lock:
                os.close(self._fd)
                self._fd = -1
        if self.error is not None:
            raise JournalError(f"journal {self.path}: {self.error} ({len(self._pending)} record(s) not written)")

    def __enter__(self) -> ResponseJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the flusher ---------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._unsynced:
                timeout = max(0.0, self._last_sync + self.flush_every_s - time.monotonic())
            else:
                timeout = self.flush_every_s
            self._wake.wait(timeout)
            self._wake.clear()  # before taking the batch: an append after this sets it again
            if self._closed:
                return  # close() writes the rest on its own thread
            try:
                self._write(sync=False)
            except Exception:  # noqa: BLE001 - a bug must not silently end journaling; flush/close retry
                log.exception("journal %s: flusher failed", self.path)

    def _write(self, *, sync: bool) -> None:
        """Hand the buffer to the OS; fsync if asked or if the last fsync is ``flush_every_s`` old."""
        with self._io_lock:
            if self._fd < 0:
                return
            with self._buf_lock:
                batch, self._pending = self._pending, []
            try:
                if batch:
                    data = b"".join(batch)
                    done = 0
                    try:
                        while done < len(data):
                            done += os.write(self._fd, data[done:])
                    except OSError:
                        # Keep exactly what did not reach the file, so a retry neither loses nor repeats a byte.
                        with self._buf_lock:
                            self._pending.insert(0, data[done:])
                        self.written += data.count(b"\n", 0, done)
                        raise
                    self.written += data.count(b"\n")
                    self._unsynced = True
                if self._unsynced and (sync or time.monotonic() - self._last_sync >= self.flush_every_s):
                    os.fsync(self._fd)
                    self._last_sync = time.monotonic()
                    self._unsynced = False
                    self.synced = self.written
                self.error = None
            except OSError as e:
                if self.error is None:
                    log.error("journal %s: write failed, records kept in memory and retried: %s", self.path, e)
                self.error = e


# -- reading ------------------------------------------------------------------------


def iter_journal(path: str | Path) -> Iterator[Record]:
    """The records of one journal file in write order; skips a torn last line, and (loudly) any other bad line."""
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            yield Record.from_json(line)
        except (ValueError, TypeError) as e:
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


def billed_by_dataset(folder: str | Path, source: str) -> dict[str, int]:
    """Completion tokens journaled per dataset (responses and billed failures), to restore the ledger's spend.

    The provider billed them whether or not a sample was written. A record
    journaled twice under one ``generation_id`` counts once.
    """
    return _per_dataset(folder, source, lambda rec: rec.charged, 0)


def cost_by_dataset(folder: str | Path, source: str) -> dict[str, float]:
    """Reported cost per dataset, counted like :func:`billed_by_dataset` (for ``Ledger.restore``)."""
    return _per_dataset(folder, source, lambda rec: float(rec.cost or 0.0), 0.0)


def _per_dataset(folder: str | Path, source: str, value: Callable[[Record], Any], zero: Any) -> dict[str, Any]:
    totals: dict[str, Any] = {}
    seen: set[str] = set()
    for rec in _records(folder, source):
        if rec.generation_id:
            if rec.generation_id in seen:
                continue
            seen.add(rec.generation_id)
        totals[rec.dataset] = totals.get(rec.dataset, zero) + value(rec)
    return totals


def gave_up_counts(folder: str | Path, source: str) -> dict[str, tuple[int, str]]:
    """sample_id -> (runs that gave up on it after transient failures, the last such error)."""
    out: dict[str, tuple[int, str]] = {}
    for rec in _records(folder, source):
        if rec.kind == "gave_up":
            n, _ = out.get(rec.sample_id, (0, ""))
            out[rec.sample_id] = (n + 1, rec.error)
    return out

