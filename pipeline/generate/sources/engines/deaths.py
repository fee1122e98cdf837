"""A prompt that kills its engine's process, found and quarantined instead of ending every re-run.

Ray brings a dead engine actor back and hands it the same batch again (``chain.ACTOR_FAULTS``: 4 restarts),
so a prompt that crashes the engine (a segfault in a kernel, the OOM killer on one huge answer) would kill
each new process until the run ends (``StageDied``, exit 3), and the next run the same way. An engine actor
therefore notes, in the run folder (every node reaches it), the batch it is serving before it hands it to the
engine, and deletes the note when the batch comes back. A note found when a batch arrives means a process
died on that batch:

- after one death on a batch its rows are served one at a time, the note naming the row being served, the
  rows that already died alone first;
- a row named when its process died has died alone: a row that died alone ``ALONE_DEATHS`` times is that
  prompt's own fault (a re-run would die again), so it is quarantined (or handed to the next source the router
  names) with failure class ``sample``, unsent. One death alone is not enough: a lost node or another
  tenant's memory kills a process whatever it serves. Nor is a death before the process's engine served
  anything: an engine that dies on every prompt is broken, not its prompts, so at least one of the deaths must
  come after the same process served another prompt (each pass one at a time starts with a row under no
  suspicion, for that proof); an engine broken for every prompt ends the run instead (``StageDied``), its rows
  left to do.

With 4 restarts a batch holding one such prompt costs three processes (the batch, the prompt alone twice) and
is then served; the counts per prompt are kept across batches and runs, so a run that ends anyway (two such
prompts in one batch) leaves the next run less to find. Batch notes are cleared when a run starts
(``clear_batch_notes``): no actor of an earlier run is alive then, and a driver killed mid-batch did not kill
its engine by a prompt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.base.layout import RunLayout, atomic_write_json, file_part

log = logging.getLogger(__name__)

ALONE_DEATHS = 2  # deaths of a prompt served alone that make it the prompt's fault
KILLER = "engine process died on this prompt"  # the start of a quarantined killer's reason


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def read_note(path: Path) -> dict[str, Any] | None:
    """A note's JSON object, or None when there is none or it does not read (a torn or foreign file counts as
    no note: a death it held is then not counted, never one it did not hold)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


@dataclass(frozen=True)
class Deaths:
    """One prompt's record: deaths of a process serving it alone, and how many came after that process's engine
    had served another prompt."""

    alone: int = 0
    after_served: int = 0

    @property
    def killer(self) -> bool:
        """``ALONE_DEATHS`` deaths alone, one at least after the engine served: the prompt's own fault."""
        return self.alone >= ALONE_DEATHS and self.after_served >= 1


class DeathNotes:
    """One source's notes in a run folder: ``OUTPUT/engine_deaths/<source>/``."""

    def __init__(self, layout: RunLayout, source: str) -> None:
        self.folder = layout.engine_deaths / file_part(source)

    def batch_path(self, ids: list[str]) -> Path:
        return self.folder / f"batch-{_digest(chr(10).join(sorted(ids)))}.json"

    def sample_path(self, sample_id: str) -> Path:
        return self.folder / f"sample-{_digest(sample_id)}.json"

    def suspects(self, ids: list[str]) -> dict[str, Deaths]:
        """The rows of a batch that died alone before, with their counts (one listing, then only their records)."""
        try:
            names = set(os.listdir(self.folder))
        except OSError:
            return {}
        found = {i: self.deaths(i) for i in ids if self.sample_path(i).name in names}
        return {i: d for i, d in found.items() if d.alone}

    def deaths(self, sample_id: str) -> Deaths:
        """What ``sample_id``'s record counts (nothing when there is none, or it does not read)."""
        rec = read_note(self.sample_path(sample_id))
        return Deaths(_count(rec, "deaths_alone"), _count(rec, "after_served"))

    def alone_deaths(self, sample_id: str) -> int:
        """How often a process died serving ``sample_id`` alone."""
        return self.deaths(sample_id).alone

    def is_killer(self, sample_id: str) -> bool:
        return self.deaths(sample_id).killer

    def arrive(self, ids: list[str]) -> bool:
        """A batch arrives: whether a process died on it before. A death while a row was served alone is
        counted against that row (the note is reset first: a death between the two undercounts, never counts
        twice)."""
        note = read_note(self.batch_path(ids))
        if note is None:
            return False
        serving = note.get("serving")
        self._write_batch(ids, serving=None)
        if isinstance(serving, str) and serving in ids:
            had = self.deaths(serving)
            n, after = had.alone + 1, had.after_served + (note.get("after_served") is True)
            atomic_write_json(self.sample_path(serving),
                              {"sample_id": serving, "deaths_alone": n, "after_served": after})
            log.warning("a process died serving prompt %r alone (%d time(s))", serving, n)
        else:
            log.warning("a process died serving a batch of %d prompts: serving them one at a time", len(ids))
        return True

    def serving(self, ids: list[str], sample_id: str | None, after_served: bool = False) -> None:
        """Note the batch as in the engine's hands (``sample_id``: the one row served alone now;
        ``after_served``: this process's engine has served a prompt already)."""
        self._write_batch(ids, serving=sample_id, after_served=after_served)

    def done(self, ids: list[str]) -> None:
        """The batch came back from the engine: no death to count."""
        self.batch_path(ids).unlink(missing_ok=True)

    def _write_batch(self, ids: list[str], serving: str | None, after_served: bool = False) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.batch_path(ids), {"rows": len(ids), "serving": serving, "after_served": after_served},
                          indent=None)


def _count(rec: dict[str, Any] | None, key: str) -> int:
    n = (rec or {}).get(key)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def alone_order(rows: list[Any], suspects: dict[str, int], key: Any) -> list[Any]:
    """The order a batch is served one at a time in: one row under no suspicion first (if the process has
    served nothing yet, it proves the engine serves), then the suspects, most deaths first (a death then
    re-serves fewer of the others), then the rest."""
    clean = [r for r in rows if key(r) not in suspects]
    suspect = sorted((r for r in rows if key(r) in suspects), key=lambda r: -suspects[key(r)])
    return clean[:1] + suspect + clean[1:]


def killer_reason(deaths: int) -> str:
    return (f"{KILLER} alone {deaths} times (a crash in the engine or the OOM killer): it would again; "
            "OUTPUT/logs/ holds the crash")


def clear_batch_notes(layout: RunLayout) -> int:
    """Remove every batch note of earlier runs (their actors are gone; see the module doc); the counts per
    prompt stay. Returns how many were removed."""
    removed = 0
    for path in layout.engine_deaths.glob("*/batch-*.json"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed
