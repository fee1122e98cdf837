"""The base of every local engine source (vLLM, SGLang, transformers): the row plumbing they share.

An engine source receives in-flight rows (pipeline.base.flight) and serves only those
addressed to it (``source`` is its name, or empty in a one-source run); every
other row passes through untouched, so several sources can sit in one chain. The
engine's own output ids are the ground truth: nothing is re-tokenized. A failure
never loses a row, and only a prompt's own failure quarantines it: an engine error
on a batch is isolated by retrying its rows one at a time; a row that still fails
while others of its batch pass is the prompt's fault (it would fail again) and is
handed to the next source the router names (status ``reroute``) or quarantined at
stage ``generate`` with the error (``failure_class`` ``sample``); so is a row
whose output ids the profile cannot read (``engine output unreadable``: an id
past the tokenizer's vocabulary), the rest of its batch going on. When every row
fails alone too, the engine is at fault: the rows are handed on or left to do
(``failure_class`` ``engine``) and the actor serves no more rows of its own (each later one handed on or left to
do), so a re-run does them once the engine is fixed. An error the engine itself says may pass on a retry (vLLM's
``error`` finish) hands its row on or leaves it to do too, without judging the engine. ``on_error: raise`` instead
re-raises so Ray retries the task.

An engine that fails to start (bad model folder, CUDA OOM, package missing) does
not take the run down: the actor records the error (type and message, tokens
blanked), logs it once, and hands every row addressed to it on, or leaves it to
do, with reason ``engine failed to start: ...`` and the ``start_error`` columns
set. With ``on_error: raise`` the start error is raised as before.

A subclass implements ``start`` (once per actor) and ``generate_rows``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pipeline.base.config import SamplingConfig
from pipeline.base.flight import NextSource, batch_to_rows, fail_row, leave_to_do, rows_to_table, served, serves
from pipeline.base.layout import RunLayout
from pipeline.checks.reconstruct import cut_off
from pipeline.generate.sources.engines.config import EngineSourceConfig
from pipeline.generate.sources.engines.deaths import DeathNotes, alone_order, killer_reason
from pipeline.generate.sources.http.wire import redact
from pipeline.profiles import load_profile

log = logging.getLogger(__name__)

START_FAILED = "engine failed to start"
UNREADABLE = "engine output unreadable"  # the ids came back but the profile cannot split or decode them
SAMPLE = "sample"  # failure_class of a prompt quarantined for its own failure (it would fail again)
ENGINE = "engine"  # failure_class of rows an engine's own failure left to do (a re-run does them)
TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENROUTER_API_KEY")  # blanked out of start errors


def request_seed(sample_id: str, seed: int) -> int:
    """A per-sample seed: a retried or resumed sample is generated identically."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:4], "little")


def fill_from_engine(row: dict[str, Any], profile: Any, ids: list[int], finish: str | None, seconds: float) -> None:
    """Fill a sample from engine output ids; text fields are split the way a server's parsers would."""
    finish = finish or "stop"
    comp = profile.split_ids(ids, bool(row["thinking"]))
    row.update(
        output_ids=ids, reasoning=comp.reasoning, content=comp.content,
        tool_calls=json.dumps(comp.tool_calls, ensure_ascii=False) if comp.tool_calls else "",
        finish_reason=finish, truncated=cut_off(finish), t_generate_s=seconds,  # e.g. length, vLLM's repetition
    )


def busy_shares(device_s: float, prompt_lens: list[int], outputs: list[list[int] | None]) -> list[float]:
    """Split one batch's engine time (device-seconds) over its samples by the tokens each made the engine process
    (prompt + output). Rows that came back without ids get nothing: the time spent on them is the price of the
    samples that did come back, so the shares add up to the engine's busy time. Only a call that raised (its
    rows are retried one at a time) or a batch with no sample at all leaves its time unattributed."""
    tokens = [p + len(o) if o is not None else 0 for p, o in zip(prompt_lens, outputs, strict=True)]
    total = sum(tokens)
    return [device_s * t / total if total else 0.0 for t in tokens]


def start_error_text(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` of a failed engine start: one line, capped, tokens blanked (it is copied into rows)."""
    text = redact(f"{type(exc).__name__}: {' '.join(str(exc).split())}", [os.environ.get(k) for k in TOKEN_ENV])
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class EngineResult:
    """One engine answer: exact output ids, or the error that replaced them.

    ``retryable``: the engine says the error was its own and may pass on a retry (vLLM's ``error``): the row is
    handed on or left to do, not quarantined as the prompt's failure.
    """

    ids: list[int] | None
    finish: str | None
    seconds: float
    error: str | None = None
    retryable: bool = False


def sampling_record(sampling: SamplingConfig, sample_id: str, seed_sent: bool = True) -> str:
    """The parameters a sample was generated with, including its own seed (JSON for the shard).

    ``request_seed`` is null when the engine was sent no seed (SGLang with ``deterministic: false``): such a
    sample cannot be made again, and its provenance must not claim a seed it never had.
    """
    seed = request_seed(sample_id, sampling.seed) if seed_sent else None
    return json.dumps({**sampling.model_dump(), "request_seed": seed}, sort_keys=True)


def as_sampling(sampling: SamplingConfig | Mapping[str, Any]) -> SamplingConfig:
    return sampling if isinstance(sampling, SamplingConfig) else SamplingConfig.model_validate(dict(sampling))


class EngineSource:
    """Row plumbing shared by local engines; subclasses implement ``start`` and ``generate_rows``."""

    kind = "engine"

    def __init__(self, model_dir: str, profile: str, sampling: SamplingConfig | Mapping[str, Any],
                 cfg: EngineSourceConfig, router: NextSource | None = None, layout: RunLayout | None = None) -> None:
        self.sampling = as_sampling(sampling)
        # Notes of the batch in the engine's hands, in the run folder: a prompt that kills the process is found
        # (deaths.py). None outside a run (tests, benches that call the engine directly).
        self.deaths = DeathNotes(layout, cfg.name) if layout is not None else None
        self.engine_served = False  # whether this process's engine has served a prompt (deaths.py: the proof)
        self.cfg = cfg
        self.source_name = cfg.name
        self.router = router
        self.model_name = os.path.basename(model_dir.rstrip("/"))
        self.start_error: str | None = None
        self.halted: str | None = None  # why this actor's engine serves no more rows (it failed every prompt)
        try:
            self.preflight()
            self.profile = load_profile(profile, model_dir)
            self.start(model_dir)
        except Exception as e:  # a dead engine must cost its rows a re-route, not the whole run
            if cfg.on_error == "raise":
                raise
            self.start_error = start_error_text(e)
            log.error("source %r (%s): %s: %s; its rows go to their next source or are left to do\n%s",
                      self.source_name, self.kind, START_FAILED, self.start_error,
                      "".join(traceback.format_tb(e.__traceback__)).rstrip())

    def preflight(self) -> None:
        """Cheap checks (e.g. the engine package is installed) run first, so the root cause is what is reported."""

    def start(self, model_dir: str) -> None:
        """Start the engine once per actor; an exception here is recorded as ``start_error`` (see module doc)."""

    def shutdown(self) -> None:
        """Stop the engine and its processes (idempotent). Called from ``__del__``."""

    def __del__(self) -> None:
        # When Ray Data retires an actor it drops the stage object (``__ray_shutdown__``) before Ray kills the
        # actor's child processes. Stopping the engine here, while Python's multiprocessing resource tracker
        # (one of those children) still runs, lets the engine unlink its shared memory in order; killed first,
        # the tracker is relaunched mid-cleanup and prints a KeyError traceback per segment.
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing left to report to
            log.debug("source %r: engine shutdown failed", getattr(self, "source_name", "?"), exc_info=True)

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        raise NotImplementedError(f"{type(self).__name__} must implement generate_rows")

    def seed_sent(self) -> bool:
        """Whether each request carries its per-sample seed (``request_seed`` in the provenance; else null)."""
        return True

    def max_new_tokens(self, prompt_len: int) -> int:
        return min(self.sampling.max_tokens, self.cfg.max_model_len - prompt_len)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch_to_rows(batch)
        todo = []
        spill = getattr(self.router, "spill", None)
        for r in rows:
            if not serves(r, self.source_name):
                continue
            if spill is not None and spill(r, self.source_name, time.time()):
                continue  # past the overflow deadline: an overflow source takes it
            if self.start_error is not None:
                r.update(start_error_source=self.source_name, start_error=self.start_error)
                self._leave(r, f"{START_FAILED}: {self.start_error}")
                continue
            if len(r["prompt_ids"]) >= self.cfg.max_model_len:
                fail_row(r, f"prompt of {len(r['prompt_ids'])} tokens does not fit max_model_len "
                            f"{self.cfg.max_model_len}", self.source_name, self.router)
                self._sample_failure(r)
                continue
            todo.append(r)
        if todo:
            self._serve(todo) if self.deaths is None else self._serve_noted(todo, self.deaths)
        return rows_to_table(rows)

    def _serve_noted(self, rows: list[dict[str, Any]], notes: DeathNotes) -> None:
        """``_serve`` with the batch noted in the run folder while the engine has it (see ``deaths``): after a
        death on the batch its rows go one at a time, and a prompt found to kill the process fails unsent, as its
        own fault."""
        ids = [r["sample_id"] for r in rows]
        died = notes.arrive(ids)
        suspects = notes.suspects(ids)
        todo = []
        for r in rows:
            found = suspects.get(r["sample_id"])
            if found is not None and found.killer:
                fail_row(r, killer_reason(found.alone), self.source_name, self.router)
                self._sample_failure(r)
            else:
                todo.append(r)
        counts = {i: d.alone for i, d in suspects.items()}
        parts = [todo] if not died else [[r] for r in alone_order(todo, counts, lambda r: r["sample_id"])]
        for part in (p for p in parts if p):  # a batch of killers only: nothing to send
            notes.serving(ids, part[0]["sample_id"] if died else None, after_served=self.engine_served)
            self._serve(part)
            self.engine_served = self.engine_served or any(r["status"] == "ok" for r in part)
        notes.done(ids)

    def _serve(self, rows: list[dict[str, Any]]) -> None:
        if self.halted is not None:
            for r in rows:
                self._leave(r, self.halted)
            return
        error = self._attempt(rows)
        if error is None:
            return
        if self.cfg.on_error == "raise":
            raise error
        why = f"engine error: {start_error_text(error)}"
        if self.cfg.isolate_errors and len(rows) > 1:  # one bad prompt must not take its batch with it
            failed = [(r, e) for r, e in ((r, self._attempt([r])) for r in rows) if e is not None]
            if len(failed) < len(rows):  # the others passed alone: these prompts fail, and would again
                for r, e in failed:
                    fail_row(r, f"engine error: {start_error_text(e)}", self.source_name, self.router)
                    self._sample_failure(r)
                return
            self.halted = f"{why} (on every prompt of a batch, each alone too: the engine, not the prompts)"
            log.error("source %r (%s): %s; its rows from now on go to their next source or are left to do",
                      self.source_name, self.kind, self.halted)
            why = self.halted
        for r in rows:  # a whole batch failed: nothing says it was these prompts, so they may pass on a re-run
            self._leave(r, why)

    def engine_dead(self, error: BaseException) -> bool:
        """Whether ``error`` says the engine's own process is gone (not that a request failed). In a run the
        actor then exits (``_exit_dead``): Ray starts a fresh process and engine, and the batch's notes find a
        prompt that kills engines (``deaths``), as for a crash of the actor's own process."""
        return False

    def _exit_dead(self, error: BaseException) -> None:
        log.error("source %r (%s): its engine died (%s); this process exits so that Ray restarts it with a fresh "
                  "engine and serves the batch again", self.source_name, self.kind, start_error_text(error))
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - the engine is gone already; its processes exit with their parent
            log.debug("source %r: shutdown of a dead engine failed", self.source_name, exc_info=True)
        logging.shutdown()
        os._exit(1)

    def _attempt(self, rows: list[dict[str, Any]]) -> Exception | None:
        """Generate ``rows`` in one engine call and fill them; the exception instead, the rows untouched. An
        engine found dead in a run ends the process (``engine_dead``)."""
        t0 = time.perf_counter()
        try:
            results = self.generate_rows(rows)
        except Exception as e:  # noqa: BLE001 - whatever the engine raised decides the rows' fate in _serve
            if self.deaths is not None and self.engine_dead(e):
                self._exit_dead(e)
            return e
        busy = time.perf_counter() - t0
        shares = busy_shares(busy * self.cfg.devices(), [len(r["prompt_ids"]) for r in rows],
                             [None if res.error is not None else res.ids for res in results])
        for r, res, share in zip(rows, results, shares, strict=True):
            self._provenance(r)
            if res.error is not None and res.retryable:  # the engine's own fault, which may pass on a retry
                self._leave(r, f"engine error: {res.error}")
                continue
            if res.error is not None or res.ids is None:  # the engine's own verdict on this one prompt
                fail_row(r, f"engine error: {res.error or 'no output ids'}", self.source_name, self.router)
                self._sample_failure(r)
                continue
            try:
                fill_from_engine(r, self.profile, res.ids, res.finish, res.seconds)
            except Exception as e:  # noqa: BLE001 - e.g. an id past the tokenizer's vocabulary (Qwen3's model has more)
                # This prompt's own output (its seed makes it again on a re-run): it fails alone, the batch goes on.
                fail_row(r, f"{UNREADABLE}: {start_error_text(e)}", self.source_name, self.router)
                self._sample_failure(r)
                continue
            r["engine_s"] = share
            served(r, self.source_name)
        return None

    @staticmethod
    def _sample_failure(row: dict[str, Any]) -> None:
        """Class a row quarantined for its own prompt's failure ``sample``, as the HTTP sources do."""
        if row["status"] == "quarantine":
            row["failure_class"] = SAMPLE

    def _leave(self, row: dict[str, Any], reason: str) -> None:
        """Hand a row on, or leave it to do: the engine failed it, not its prompt."""
        leave_to_do(row, reason, self.source_name, self.router)
        if row["status"] == "not_generated":  # a handed-on row's next source sets its own outcome
            row["failure_class"] = ENGINE

    def _provenance(self, row: dict[str, Any]) -> None:
        row.update(source=self.source_name, source_kind=self.kind, provider=self.kind, model=self.model_name,
                   ids_from="engine", sampling=sampling_record(self.sampling, row["sample_id"], self.seed_sent()))
