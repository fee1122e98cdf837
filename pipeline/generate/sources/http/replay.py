"""What this output folder already paid for: an index of every journaled response, read by each source actor.

A source actor that starts (or restarts after its predecessor was killed) must
not pay again for a response any actor of this run or of an earlier one was
billed for. Each actor reads every response journal of its source in the run
folder before it sends anything, and reads what the other actors appended
since before each batch (a batch retried on a live actor after its first actor
died). The index holds where each response lies (file, offset), not the
response, so a million-response folder costs an actor tens of MB, not GB.

A file seen for the first time is indexed from its projection (``totals.projection_to``: the stored one and
what was appended since), so a resume's actors parse no line their predecessors' writers projected; what is
appended later is parsed line by line, checking only the fields the index keeps (``record_fields``). The one
record replayed is parsed whole when it is taken (``get``).

A response indexed for a prompt that cannot be read back whole (a field of the wrong type, a file gone) was
still paid for: ``get`` gives :class:`Unreadable`, naming the file, the line and the field, and the engine
leaves that prompt to do rather than ask, and pay, a second time (``HttpEngine._replay``). So is a line whose
counted fields themselves do not read (``record_fields`` refuses it) where its sample id still does and it may
be a response of this source (``journal.unreadable_row``): that prompt is indexed, and held, as well. A readable
response of the same prompt wins over it whatever their times. A line in which no sample id reads holds
nothing: it is said, loudly, each time a file is indexed (its prompt may be asked, and paid for, again).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.generate.sources.http.journal import (
    PROJECTION_SCHEMA,
    Record,
    file_source,
    journal_files,
    readable_fields,
    record_fields,
    unreadable_row,
    unreadable_warning,
)
from pipeline.generate.sources.http.totals import projection_to, warn_unreadable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unreadable:
    """A response journaled for a prompt whose line cannot be read back as a ``Record``.

    ``reason`` names the file, the line's byte offset and what is wrong with it (the field of the wrong type).
    ``request_digest``: the line's, when that much of it reads, else None (it may be this request's answer)."""

    reason: str
    request_digest: str | None = None


@dataclass
class _Where:
    path: Path
    start: int
    end: int
    at: float
    readable: bool = True  # False: its counted fields did not read when indexed (``get`` gives Unreadable)


@dataclass
class ReplayIndex:
    """sample id -> the latest journaled response of one source in one run folder's responses/ directory.

    ``exclude``: this actor's own journal file (what it wrote itself it already knows). ``identity``: when
    given, records of another identity (model and endpoint) are skipped, whatever their source name.
    """

    folder: Path
    source: str
    exclude: Path | None = None
    identity: str | None = None
    _where: dict[str, _Where] = field(default_factory=dict)
    _scanned: dict[Path, int] = field(default_factory=dict)  # bytes of each file already indexed
    taken: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self.refresh()

    def refresh(self) -> int:
        """Index what was appended since the last call (new files included); returns how many records."""
        n = 0
        files = sorted(self.folder.glob("*.jsonl")) if self.identity and self.folder.is_dir() \
            else journal_files(self.folder, self.source)
        for path in files:
            if self.exclude is not None and path == self.exclude:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            done = self._scanned.get(path, 0)
            if size <= done:
                continue
            n += self._scan(path, done, size) if done else self._project(path)
        return n

    def _project(self, path: Path) -> int:
        """Index a file not seen before from its projection (no line parsed where one is stored)."""
        try:
            table, offset = projection_to(path)
        except OSError as e:
            log.warning("replay index: cannot read %s: %s", path, e)
            return 0
        table = table.filter(self._wanted_rows(table))
        warn_unreadable(path, table, "replay index: journal")
        table = table.filter(pc.not_equal(table["sample_id"], ""))
        for sid, at, start, end, why in zip(*(table.column(c).to_pylist()
                                              for c in ("sample_id", "at", "start", "end", "unreadable")),
                                            strict=True):
            self._note(sid, path, start, end, at, not why)
        self._scanned[path] = offset
        return table.num_rows

    def _wanted_rows(self, table: pa.Table) -> pa.Array:
        """``_wanted`` over a projection's columns (a line that does not read, whose kind does not either, may be
        a response)."""
        response = pc.or_(pc.equal(table["kind"], "response"),
                          pc.and_(pc.equal(table["kind"], ""), pc.not_equal(table["unreadable"], "")))
        if not self.identity:
            return pc.and_(response, pc.equal(table["source"], self.source))
        by_identity = pc.if_else(pc.not_equal(table["identity"], ""), pc.equal(table["identity"], self.identity),
                                 pc.equal(table["source"], self.source))
        return pc.and_(response, by_identity)

    def _note(self, sample_id: str, path: Path, start: int, end: int, at: float, readable: bool = True) -> None:
        """Index the latest response of a prompt; one that reads wins over one that does not, whatever the times
        (the readable one replays: nothing is paid twice)."""
        seen = self._where.get(sample_id)
        if seen is None or (readable, at) >= (seen.readable, seen.at):
            self._where[sample_id] = _Where(path, start, end, at, readable)

    def _scan(self, path: Path, start: int, size: int, chunk: int = 8 << 20) -> int:
        """Index whole lines in [start, size), ``chunk`` bytes at a time (a journal of long reasoning answers
        can be GBs); a line still being written is left for the next refresh."""
        n, pos, carry = 0, start, b""
        try:
            with open(path, "rb") as f:
                f.seek(start)
                while pos + len(carry) < size:
                    data = carry + f.read(min(chunk, size - pos - len(carry)))
                    if len(data) == len(carry):
                        break  # the file shrank (it never should): index what was read
                    cut = data.rfind(b"\n") + 1
                    n += self._index_lines(path, pos, data[:cut])
                    pos += cut
                    carry = data[cut:]
        except OSError as e:
            log.warning("replay index: cannot read %s: %s", path, e)
        self._scanned[path] = pos
        return n

    def _index_lines(self, path: Path, offset: int, data: bytes) -> int:
        n, at = 0, 0
        while at < len(data):
            nl = data.index(b"\n", at)
            line = data[at:nl]
            if line.strip():
                try:
                    rec = record_fields(line)
                except (ValueError, TypeError, RecursionError) as e:  # a torn line healed by a newline, a
                    # foreign one, a field of the wrong type; RecursionError: the stdlib parser, nested deep
                    n += self._index_unreadable(path, line, offset + at, offset + nl, str(e))
                    rec = None
                if rec is not None and self._wanted(rec):
                    when = rec.get("at")
                    when = float(when) if isinstance(when, int | float) and not isinstance(when, bool) else 0.0
                    self._note(rec["sample_id"], path, offset + at, offset + nl, when)
                    n += 1
            at = nl + 1
        return n

    def _index_unreadable(self, path: Path, line: bytes, start: int, end: int, why: str) -> int:
        """A line ``record_fields`` refuses that may be a response of this source: said loudly, and its prompt
        indexed as unreadable (held) where its sample id reads; returns how many it indexed."""
        row = dict(zip(PROJECTION_SCHEMA.names, unreadable_row(line, start, end, why, file_source(path)),
                       strict=True))
        sid = row["sample_id"]
        if not self._wanted({**row, "kind": row["kind"] or "response"}):
            return 0  # another source's, or not a response: no prompt of this source to hold (totals say it)
        log.warning("replay index: journal %s", unreadable_warning(path, start, why, sid, row["dataset"], row["kind"]))
        if not sid:
            return 0
        self._note(sid, path, start, end, row["at"], False)
        return 1

    def _wanted(self, rec: dict) -> bool:
        """A response of this source (``rec``: a line's ``record_fields``): by identity when both sides have one
        (a renamed source keeps its responses), else by name."""
        if rec.get("kind", "response") != "response":
            return False
        if self.identity and rec.get("identity"):
            return rec["identity"] == self.identity
        return rec["source"] == self.source

    def get(self, sample_id: str) -> Record | Unreadable | None:
        """The journaled response for this prompt, read from its file; None when there is none, and
        :class:`Unreadable` when its line no longer reads whole (never raises: the file is outside input)."""
        where = self._where.get(sample_id)
        if where is None:
            return None
        line = b""
        try:
            with open(where.path, "rb") as f:
                f.seek(where.start)
                line = f.read(where.end - where.start)
            return Record.from_json(line)
        except (OSError, ValueError, TypeError, RecursionError) as e:
            reason = f"journal {where.path}, the line at byte {where.start}: {e}"
            log.warning("replay index: cannot re-read the response of %s: %s", sample_id, reason)
            return Unreadable(reason, _digest_of(line))

    def pop(self, sample_id: str, default: Record | None = None) -> Record | Unreadable | None:
        """Like ``dict.pop``: the engine's replay protocol (a response is replayed at most once per actor). An
        ``Unreadable`` one is not taken: the prompt stays held on every ask."""
        if sample_id in self.taken:
            return default
        rec = self.get(sample_id)
        if rec is None:
            return default
        if isinstance(rec, Record):
            self.taken.add(sample_id)
        return rec

    def __len__(self) -> int:
        return len(self._where)


def _digest_of(line: bytes) -> str | None:
    """The ``request_digest`` of a journal line that does not parse as a ``Record``, when that field reads
    (whatever else does not: a counted field of the wrong type included)."""
    digest = readable_fields(line).get("request_digest")
    return digest if isinstance(digest, str) else None


class DictReplay(dict):
    """A fixed replay set (tests, benches): the same protocol as :class:`ReplayIndex`, nothing to refresh."""

    def refresh(self) -> int:
        return 0


def replay_source(replay: ReplayIndex | Mapping[str, Record] | None) -> ReplayIndex | DictReplay:
    return replay if isinstance(replay, ReplayIndex) else DictReplay(replay or {})
