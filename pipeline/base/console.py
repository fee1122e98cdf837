"""What a person watching ``python -m pipeline run`` sees: a header, one progress display per phase, the report.

Everything else (vLLM, SGLang, Ray, transformers, torch, the Ray workers' output, the pipeline's own
debug and info logging) goes to files under ``OUTPUT/logs/`` (pipeline.base.logs); ``--verbose`` streams it
here too.

The text comes from pure functions (``header_lines``, ``generate_line``, ``extract_line``,
``train_line``, ``heldout_line``); ``Console`` only decides when and how to write it. On a terminal a
phase redraws one line in place; without one (``ray job submit``, CI, a pipe) it prints a plain line
every ``PIPELINE_PROGRESS_S`` seconds (default 30) and a last line when the phase ends. Lines that need
the user's action start with ``!`` (as the report's ``attention_lines`` do).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger("pipeline.base.console")

PROGRESS_ENV = "PIPELINE_PROGRESS_S"  # seconds between plain progress lines without a terminal
PLAIN_EVERY_S = 30.0
TTY_EVERY_S = 0.5
STALE_S = 5.0  # a progress line unchanged this long also shows the phase's time: a silent wait looks hung


# ----------------------------------------------------------------------------- pure formatting


def duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``; ``--`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def quantity(n: float | None) -> str:
    """``950``, ``3.5k``, ``12k``, ``1.2M``: a count at a glance."""
    if n is None or not math.isfinite(n):
        return "--"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            v = n / div
            return f"{v:.1f}{unit}" if abs(v) < 10 else f"{v:.0f}{unit}"
    return f"{n:.0f}"


def eta(done: float, total: float, elapsed_s: float) -> float | None:
    """Seconds left at the rate so far; None before anything is done."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return max(total - done, 0) * elapsed_s / done


@dataclass(frozen=True)
class GenerateSnapshot:
    """Generation so far, as the rows leaving the chain count it (``pipeline.report.summary.Tally``)."""

    done: int
    total: int
    passed: int
    quarantined: int
    not_generated: int
    tokens: int
    cost: float
    elapsed_s: float
    estimated: bool = False  # ``total`` is the files' row count: the index pass is still counting


Spend = Mapping[str, Mapping[str, tuple[int, int | None]]]  # source -> dataset -> (tokens committed, budget)


def spend_text(spend: Spend, cost: float = 0.0) -> str:
    """``spend api: chat 1.2k/20k, code 300/14k tokens, $0.0123``: committed tokens against each budget."""
    parts = []
    for source, datasets in spend.items():
        items = [f"{d} {quantity(used)}/{quantity(budget) if budget is not None else 'no cap'}"
                 for d, (used, budget) in datasets.items()]
        parts.append(f"{source}: {', '.join(items) if items else 'nothing yet'}")
    text = "spend " + "; ".join(parts) + " tokens" if parts else ""
    if cost:
        text += f"{', ' if text else 'spend '}${cost:.4f}"
    return text


def generate_line(s: GenerateSnapshot, spend: Spend | None = None, *, final: bool = False) -> str:
    head = f"[generate] {s.done}/{'~' if s.estimated else ''}{s.total} done"
    if final:
        head += f" in {duration(s.elapsed_s)}"
    rate = s.tokens / s.elapsed_s if s.elapsed_s > 0 else 0.0
    parts = [f"{head} ({s.passed} passed, {s.quarantined} quarantined, {s.not_generated} not generated)",
             f"{quantity(s.tokens)} tokens", f"{quantity(rate)} tok/s"]
    money = spend_text(spend or {}, s.cost)
    if money:
        parts.append(money)
    if not final:
        parts.append(f"ETA {duration(eta(s.done, s.total, s.elapsed_s))}")
    return ", ".join(parts)


def extract_line(samples: int, total: int | None, tokens: int, elapsed_s: float, *, label: str = "extract",
                 final: bool = False) -> str:
    count = f"{samples}/{total}" if total else str(samples)
    parts = [f"[{label}] {count} samples" + (f" in {duration(elapsed_s)}" if final else ""),
             f"{quantity(tokens)} tokens", f"{quantity(tokens / elapsed_s if elapsed_s > 0 else 0)} tok/s"]
    if not final and total:
        parts.append(f"ETA {duration(eta(samples, total, elapsed_s))}")
    return ", ".join(parts)


def train_line(metrics: Mapping[str, Any], total_steps: int, elapsed_s: float, start_step: int = 0, *,
               final: bool = False) -> str:
    """One drafter-training status from a ``metrics.jsonl`` record (step, loss, acc_k, tokens_per_s)."""
    step = int(metrics.get("step") or 0)
    accs = " ".join(f"{metrics[k]:.2f}" for k in sorted((k for k in metrics if k.startswith("acc_")),
                                                        key=lambda k: int(k[4:])))
    head = f"[train] step {step}/{total_steps}" + (f" done in {duration(elapsed_s)}" if final else "")
    parts = [head, f"loss {float(metrics.get('loss', float('nan'))):.3f}", f"acc/position [{accs}]",
             f"{quantity(metrics.get('tokens_per_s') or 0)} tok/s"]
    if not final:
        parts.append(f"ETA {duration(eta(step - start_step, total_steps - start_step, elapsed_s))}")
    return ", ".join(parts)


def heldout_line(result: Mapping[str, Any], elapsed_s: float) -> str:
    """One line, however many datasets: the figure, and the weakest dataset among those with enough drafts
    (the report lists them all)."""
    if result.get("acceptance_length") is None:
        return f"[held-out] {result.get('skipped') or 'not measured'}"
    by = result.get("by_dataset")
    groups = [g for g in by if isinstance(g, Mapping)] if isinstance(by, list) else []
    sure = [g for g in groups if isinstance(g.get("acceptance_length"), int | float) and not g.get("few")]
    weakest = min(sure, key=lambda g: g["acceptance_length"]) if len(sure) >= 2 else None  # of two or more
    weak = f" (weakest dataset {weakest.get('name')} {weakest['acceptance_length']:.2f})" if weakest else ""
    return (f"[held-out] acceptance length {result['acceptance_length']:.3f} at k={result['k']} on "
            f"{result['samples']} samples never trained on{weak}, done in {duration(elapsed_s)}")


def served_line(result: Mapping[str, Any], elapsed_s: float) -> str:
    """The served measure's console line: vLLM's figure, and whether it agrees with the simulated one."""
    if result.get("acceptance_length") is None:
        return f"[served] {result.get('skipped') or result.get('error') or 'not measured'}"
    agree = result.get("agreement")
    verdict = "" if agree is None else (", agrees with the simulated figure per position" if agree["within"] else
                                        ", DIFFERS from the simulated figure beyond sampling noise (see report.json)")
    return (f"[served] acceptance length {result['acceptance_length']:.3f} at k={result['k']} in vLLM on "
            f"{result['prompts']} held-out prompts{verdict}, done in {duration(elapsed_s)}")


def describe_source(src: Any) -> str:
    """``vllm-cpu (vllm, 1 actor)``, ``api (openrouter, model m, budgets chat 20k)`` from a source config (what
    follows the kind is the schema's own ``describe``)."""
    return f"{src.name} ({', '.join([src.kind, *src.describe()])})"


def describe_training(training: Any, stated: bool) -> str:
    """``80 steps, 3 TTT steps, draft vocab 256, 10% held out``; ``off`` for ``training: null``. A config with
    no ``training:`` section trains with the defaults, which this says, with how to turn training off."""
    if training is None:
        return "off (training: null)"
    held = f", {training.heldout_fraction:.0%} held out" if training.heldout_fraction else ""
    text = (f"{training.steps:,} steps, {training.ttt_steps} TTT steps, draft vocab {training.draft_vocab_size:,}"
            f"{held}")
    return text if stated else f"{text} (defaults: the config has no training section; training: null turns it off)"


def header_lines(title: str, datasets: Sequence[tuple[str, int]], sources: Sequence[str], output: str | Path,
                 resumed_done: int, to_do: int, logs: str | Path | None, training: str | None = None, *,
                 estimated: bool = False) -> list[str]:
    """The lines a run starts with: what it reads, who generates, what it trains, where it writes, what a
    resume skips. ``estimated``: ``to_do`` is the files' row count (a fresh run counts while it generates)."""
    rows = sum(n for _, n in datasets)
    lines = [
        f"pipeline run {title}",
        f"  datasets  {', '.join(f'{name} {n}' for name, n in datasets)} ({rows} rows)",
        f"  sources   {', '.join(sources)}",
        *([f"  training  {training}"] if training else []),
        f"  output    {output}",
        f"  resume    {resumed_done} rows already done, {to_do} to do" if resumed_done else
        f"  to do     {'at most ' if estimated else ''}{to_do} prompts"
        + (" (malformed rows are counted while generation starts)" if estimated else ""),
    ]
    if logs is not None:
        lines.append(f"  logs      {logs}/ (vLLM, Ray, transformers, torch, the pipeline's own; --verbose prints them)")
    return lines


# ----------------------------------------------------------------------------- what the phases watch


def last_json_line(path: Path) -> dict[str, Any] | None:
    """The last complete JSON line of a file that another process appends to (None when there is none yet)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(fh.tell() - 65536, 0))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


class ExtractWatch:
    """Samples and tokens the extraction actors report (``extract_stats/``) since the watch was made."""

    def __init__(self, stats_dir: Path, total: int | None, label: str = "extract") -> None:
        self.stats_dir, self.total, self.label = Path(stats_dir), total, label
        self.base = self._read()
        self.t0 = self.t_last = time.perf_counter()
        self.last = (0, 0)

    def _read(self) -> dict[str, tuple[int, int]]:
        out = {}
        for p in self.stats_dir.glob("extract-*.json"):
            try:
                r = json.loads(p.read_text())
                out[p.name] = (int(r["samples"]), int(r["tokens"]))
            except (OSError, ValueError, KeyError):
                continue
        return out

    def counts(self) -> tuple[int, int]:
        now = self._read()
        samples = max(sum(s - self.base.get(k, (0, 0))[0] for k, (s, _) in now.items()), 0)
        tokens = max(sum(t - self.base.get(k, (0, 0))[1] for k, (_, t) in now.items()), 0)
        if (samples, tokens) != self.last:
            self.last, self.t_last = (samples, tokens), time.perf_counter()
        return samples, tokens

    def line(self, final: bool = False) -> str:
        samples, tokens = self.counts()
        if not samples and not final:
            return f"[{self.label}] starting the extraction actors" + (f" ({self.total} samples)" if self.total else "")
        # seconds until the last sample was counted: a finished extraction does not go on ageing
        elapsed = (self.t_last if final else time.perf_counter()) - self.t0
        return extract_line(samples, self.total, tokens, elapsed, label=self.label, final=final)


class TrainWatch:
    """Drafter training as ``metrics.jsonl`` shows it; before its first new step, the extraction feeding it."""

    def __init__(self, metrics_path: Path, total_steps: int, extract: ExtractWatch | None) -> None:
        self.path, self.total, self.extract = Path(metrics_path), total_steps, extract
        self.t0 = time.perf_counter()
        self.started_at = time.time()
        self.t_train: float | None = None
        self.start_step: int | None = None
        self.extract_done = extract is None

    def _latest(self) -> dict[str, Any] | None:
        """The newest step record written since the watch started (a resumed run's old records do not count)."""
        try:
            if self.path.stat().st_mtime < self.started_at:
                return None
        except OSError:
            return None
        return last_json_line(self.path)

    def lines(self, final: bool = False) -> list[str]:
        m = self._latest()
        out = []
        if (m is not None or final) and not self.extract_done:
            self.extract_done = True  # training steps once the stream's rows are extracted (materialized)
            if self.extract is not None and self.extract.counts()[0]:
                out.append(self.extract.line(final=True))
        if m is None:
            if not final:
                out.append(self.extract.line() if self.extract is not None and not self.extract_done
                           else "[train] starting the training workers")
            return out
        step = int(m.get("step") or 0)
        if self.t_train is None:  # the first step seen: the ETA counts steps and seconds from here
            self.t_train, self.start_step = time.perf_counter(), step
        since = self.extract.t_last if final and self.extract is not None else (self.t0 if final else self.t_train)
        out.append(train_line(m, self.total, time.perf_counter() - since, self.start_step or 0, final=final))
        return out


# ----------------------------------------------------------------------------- the writer


def plain_every_s() -> float:
    """``PIPELINE_PROGRESS_S`` when it is a number of seconds > 0, else the default (and a warning on stderr
    naming it, once per console): a typo in it must not stop a run, nor 0 flood the console."""
    raw = os.environ.get(PROGRESS_ENV, "").strip()
    if not raw:
        return PLAIN_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value > 0:
        return value
    print(f"! {PROGRESS_ENV}={raw[:40]!r} is not a number of seconds > 0: progress every {PLAIN_EVERY_S:g} s",
          file=sys.stderr, flush=True)
    return PLAIN_EVERY_S


class Console:
    """Writes the run's own lines; progress lines are redrawn in place on a terminal, printed every so often
    otherwise. Thread-safe: a phase's ticker thread and the main thread share it."""

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, every_s: float | None = None,
                 verbose: bool = False, capture: bool = False, title: str = "") -> None:
        self.stream = stream if stream is not None else sys.stdout
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self.tty = (isatty if tty is None else tty) and not verbose  # log lines would tear a redrawn line
        self.every_s = every_s if every_s is not None else (TTY_EVERY_S if self.tty else plain_every_s())
        self.verbose, self.capture, self.title = verbose, capture, title
        self._lock = threading.RLock()
        self._live = ""  # the line being redrawn (terminal only)

    @classmethod
    def for_cli(cls, *, verbose: bool, title: str) -> Console:
        """The terminal as it is now: a copy of stdout's descriptor, so pointing the process's own stdout and
        stderr at a log file (pipeline.base.logs) leaves the console alone."""
        sys.stdout.flush()
        stream = open(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
        return cls(stream, verbose=verbose, capture=True, title=title)

    def width(self) -> int:
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        return columns if columns > 0 else 120  # a pseudo-terminal may report no size at all

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe must not take the run down
            pass

    def _clear_live(self) -> None:
        if self._live:
            self._write("\r\x1b[K")
            self._live = ""

    def line(self, text: str) -> None:
        """A permanent line (or several)."""
        with self._lock:
            self._clear_live()
            self._write(text + "\n")
        for part in text.splitlines():
            if part.strip():
                log.info("%s", part)

    def attention(self, text: str) -> None:
        """A line that needs the user's action."""
        self.line(f"! {text}")

    def live(self, text: str) -> None:
        """A progress line: redrawn in place on a terminal, a plain line otherwise."""
        with self._lock:
            if not self.tty:
                self._write(text + "\n")
                log.info("%s", text)
                return
            width = self.width()
            # shorter than the terminal, however narrow: a wrapped line leaves a row behind at each redraw
            shown = text if len(text) < width else text[: max(width - 2, 0)] + "…"
            if shown == self._live:
                return
            self._write("\r\x1b[K" + shown)
            self._live = shown

    @contextmanager
    def phase(self, render: Callable[[bool], Sequence[str] | str | None], *, announce: bool = False) -> Iterator[None]:
        """Show ``render(final)`` while the block runs, then once more with ``final=True`` as a permanent line.

        ``render`` is polled twice a second; a terminal redraws its line each time, a plain console prints it
        every ``every_s`` seconds when it changed. It may return several lines: all but the last are permanent
        at once (a finished sub-phase), the last is the live one. ``announce`` prints the first one at once on a plain
        console too (it otherwise waits ``every_s`` seconds). A live line unchanged for ``STALE_S`` seconds (an
        engine or Ray Train starting, a vLLM measure) gets the phase's time added, ``(1m30s)``: a plain console
        still prints every ``every_s`` seconds and a terminal's line still moves, so a long wait does not look hung.
        """
        stop = threading.Event()
        started = time.monotonic()
        last_print, last_text, last_shown, changed_at = [started], [""], [""], [started]

        def show(final: bool, force: bool = False) -> None:
            try:
                out = render(final)
            except Exception:  # a progress display must never fail the run
                log.debug("progress render failed", exc_info=True)
                return
            lines = [out] if isinstance(out, str) else [x for x in (out or []) if x]
            if not lines:
                return
            for text in lines[:-1]:
                self.line(text)
            if final:
                self.line(lines[-1])
                return
            now = time.monotonic()
            if lines[-1] != last_text[0]:
                last_text[0], changed_at[0] = lines[-1], now
            shown = lines[-1] if now - changed_at[0] < STALE_S else f"{lines[-1]} ({duration(now - started)})"
            if self.tty or ((force or now - last_print[0] >= self.every_s) and shown != last_shown[0]):
                last_print[0], last_shown[0] = now, shown
                self.live(shown)

        def tick() -> None:
            while not stop.wait(TTY_EVERY_S):
                show(False)

        show(False, force=announce)
        thread = threading.Thread(target=tick, name="pipeline-progress", daemon=True)
        thread.start()
        try:
            yield
        except BaseException:
            stop.set()
            thread.join(timeout=5)
            with self._lock:
                self._clear_live()
            raise
        stop.set()
        thread.join(timeout=5)
        show(True)
