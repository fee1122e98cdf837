"""One output folder, named in one place, and the one way files in it are written.

Every module that reads or writes a run's folder asks ``RunLayout`` for the path,
so the layout the README documents is the layout the code uses. Every file that
a reader may see half-written (shards, reports, journals, manifests) goes through
``atomic_write``: a hidden temp file in the same folder, fsynced, then renamed over
the target, so a reader sees the old file or the new one, never a torn one (a full
disk or a kill mid-write leaves the old file in place).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run's output folder."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def hidden(self) -> Path:
        return self.root / "hidden"

    @property
    def hidden_index(self) -> Path:
        """The hidden-state shards' index (see pipeline.hidden.shards)."""
        return self.hidden / "index.json"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def export(self) -> Path:
        return self.drafter / "export"

    @property
    def export_config(self) -> Path:
        """The exported drafter's config (written last by the export: its presence means a whole export)."""
        return self.export / "config.json"

    @property
    def metrics(self) -> Path:
        return self.drafter / "metrics.jsonl"

    @property
    def extract_stats(self) -> Path:
        return self.root / "extract_stats"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def report(self) -> Path:
        return self.root / "report.json"

    @property
    def report_html(self) -> Path:
        """The run report as a page with figures (pipeline.report.html)."""
        return self.root / "report.html"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files of the drafter's training (training.trackers)."""
        return self.drafter / "tensorboard"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def source_identities(self) -> Path:
        """Every identity (model, endpoint, budget scope) each spending source name has had in this folder."""
        return self.root / "sources.json"

    @property
    def lock(self) -> Path:
        return self.root / "run.lock"

    @property
    def responses(self) -> Path:
        """Journals of paid API responses, one file per source actor (see pipeline.generate.sources.http.journal)."""
        return self.root / "responses"

    @property
    def value(self) -> Path:
        """The value curves' drafters and results (``python -m pipeline value``, pipeline.value)."""
        return self.root / "value"

    @property
    def value_hidden(self) -> Path:
        """Hidden-state shards the value drafters read when the run streamed its states (nothing on disk)."""
        return self.value / "hidden"

    @property
    def value_report(self) -> Path:
        return self.value / "value.json"

    @property
    def value_stats(self) -> Path:
        """The value run's own extraction statistics (the run's report sums ``extract_stats`` only)."""
        return self.value / "stats"

    def value_arm(self, arm: str) -> Path:
        """One value drafter's folder: checkpoints, export, ``result.json`` (pipeline.value.arms)."""
        return self.value / file_part(arm)

    @property
    def plan(self) -> Path:
        """The latest ``python -m pipeline plan``: its budgets and the predicted gain (read by report.html)."""
        return self.value / "plan.json"

    def prompt_index(self, dataset: str) -> Path:
        """One dataset file's sample ids, for a resume that would otherwise parse the file again
        (pipeline.prompts.id_index)."""
        return self.root / "prompts" / f"{file_part(dataset)}.ids.parquet"

    @property
    def engine_deaths(self) -> Path:
        """Notes of the batches each engine source is serving, and of prompts its process died on alone
        (pipeline.generate.sources.engines.deaths)."""
        return self.root / "engine_deaths"

    def response_journal(self, source: str, actor: str) -> Path:
        """The response journal of one HTTP source actor (one writer per file; see
        pipeline.generate.sources.http.journal)."""
        return self.responses / f"{source}-{actor}.jsonl"

    def ledger(self, source: str) -> Path:
        """An API source's budget journal."""
        return self.root / f"ledger-{file_part(source)}.json"


def shard_name(sample_ids: list[str]) -> str:
    """Content-addressed: a retried batch rewrites the same file instead of adding a copy."""
    digest = hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()[:20]
    return f"part-{digest}.parquet"


def file_part(name: str) -> str:
    """``name`` when it can be part of a file name in the run folder (config checks source names; this keeps
    a name from elsewhere from ever writing outside the folder)."""
    if not name or any(c in name for c in "/\\\0") or name in (".", ".."):
        raise ValueError(f"{name!r} cannot be part of a file name")
    return name


def temp_path(path: str | Path) -> Path:
    """The hidden temp name a write to ``path`` goes through: ``.NAME.PID.RANDOM.tmp`` in the same
    folder (same file system, so the rename is atomic; hidden, so globs for ``NAME``'s kind skip it)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """For writers that need a file name (streaming writers, ``safetensors.save_file``): yields a
    temp path (``temp_path``); on a clean exit the file written there is fsynced and renamed over
    ``path``. On an exception the temp file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` all at once (hidden temp file, fsync, rename)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


NON_FINITE = "non_finite"  # the key beside a JSON object's nulls that were NaN or infinite, and what each was


def finite_json(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float as None: JSON has no such numbers (``json.dumps`` writes a bare
    ``NaN`` that strict readers, jq and browsers refuse). An object that had one says which and what in its
    ``non_finite`` entry ({key: "nan" | "inf" | "-inf"}), so a reader tells a diverged loss from a missing one."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        out = {k: finite_json(v) for k, v in obj.items()}
        bad = {str(k): str(v).lower() for k, v in obj.items() if isinstance(v, float) and not math.isfinite(v)}
        if bad and NON_FINITE not in out:
            out[NON_FINITE] = bad
        return out
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 2, sort_keys: bool = False,
                      ensure_ascii: bool = True) -> None:
    """``obj`` as strict JSON (``finite_json``: no NaN or Infinity, which ``json.loads`` of other languages
    refuses), written whole."""
    atomic_write(path, json.dumps(finite_json(obj), indent=indent, default=str, sort_keys=sort_keys,
                                  ensure_ascii=ensure_ascii, allow_nan=False) + "\n")


def atomic_write_table(table: pa.Table, path: str | Path) -> None:
    """A parquet file written whole (same temp-fsync-rename rule as ``atomic_write``)."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def last_json_line(path: str | Path) -> dict[str, Any] | None:
    """The last whole JSON object of a JSONL log (its writer may have died mid-line), or None."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            return rec
    return None
