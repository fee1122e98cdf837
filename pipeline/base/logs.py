"""A run's logs: one rotated file per component under ``OUTPUT/logs/``, so the console keeps only the run's own
lines (pipeline.base.console).

``capture(logs_dir, verbose)`` (used by ``python -m pipeline run``) routes, for the length of the run:

- every logger of this process (the pipeline's own at DEBUG, the rest at INFO) to ``pipeline.log``,
  ``ray.log``, ``vllm.log``, ``sglang.log``, ``transformers.log``, ``torch.log``, ``warnings.log`` (Python
  warnings, captured) or ``other.log``; libraries' own console handlers are set aside while it lasts;
- the Ray workers' and actors' stdout and stderr, which Ray forwards to the driver, to
  ``worker-<actor class>.log`` (``worker-VLLMGenerator.log``, ``worker-RayTrainWorker.log``, ...), on a
  local Ray and on a joined cluster alike (Ray also keeps them in its session folder, named in
  ``pipeline.log``);
- whatever else this process writes to its stdout and stderr (Ray's C++ core, progress bars) to
  ``output.log`` (it takes raw file-descriptor output, so it cannot rotate while a run writes it: a run that
  finds it past ``MAX_BYTES`` rotates it before it starts).

A warning seen again is counted instead of written again (``repeated N more times`` when the run ends);
errors are always written. ``verbose`` keeps all of it on the console as well, as it was before.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_BYTES = 20 * 1024 * 1024  # per file, before it rotates
BACKUPS = 3
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# logger name prefix -> the file it goes to (first match wins; anything else: other.log)
COMPONENTS = (
    ("pipeline", "pipeline"), ("training", "pipeline"), ("__main__", "pipeline"),
    ("vllm", "vllm"), ("sglang", "sglang"), ("ray", "ray"),
    ("transformers", "transformers"), ("huggingface_hub", "transformers"), ("tokenizers", "transformers"),
    ("safetensors", "transformers"), ("torch", "torch"), ("py.warnings", "warnings"),
)
OWN = ("pipeline", "training", "__main__")
WORKER_LOGGER = "pipeline.workers"  # the name on forwarded worker lines (they go straight to their file)

_WARNING = re.compile(r"\bWARN(ING)?\b|Warning\b")
_NUMBERS = re.compile(r"(\d+|0x[0-9a-fA-F]+)")


def component_of(logger_name: str) -> str:
    """The log file (without ``.log``) a logger's records go to."""
    for prefix, comp in COMPONENTS:
        if logger_name == prefix or logger_name.startswith(prefix + "."):
            return comp
    return "other"


def worker_component(actor_name: str | None, task_name: str | None = None, pid: Any = None) -> str:
    """The file a Ray worker's forwarded output goes to: ``worker-`` and its innermost actor or task name
    (``MapWorker(MapBatches(VLLMGenerator))`` -> ``worker-VLLMGenerator``); Ray's own daemons by name."""
    if pid in ("raylet", "autoscaler", "gcs_server"):
        return f"ray-{pid}"
    name = (actor_name or task_name or "").strip()
    while (m := re.fullmatch(r"[\w.]+\((.*)\)", name)) and m.group(1):
        name = m.group(1)
    name = re.sub(r"[^\w.-]+", "_", name).strip("_.")[:60]
    return f"worker-{name or 'task'}"


def repeat_key(line: str) -> str | None:
    """A warning's identity whatever its numbers (pids, times, ports), or None for a line that is no warning."""
    if not _WARNING.search(line):
        return None
    return " ".join(w for w in line.split() if not _NUMBERS.search(w))


class Repeats:
    """Counts warnings already written once (per file), so that a repeated one is counted, not repeated."""

    def __init__(self) -> None:
        self.first: dict[tuple[str, str], str] = {}
        self.again: Counter = Counter()
        self._lock = threading.Lock()

    def seen(self, where: str, line: str) -> bool:
        """True when this warning was already written to ``where`` (it is counted instead)."""
        key = repeat_key(line)
        if key is None:
            return False
        with self._lock:
            if (where, key) in self.first:
                self.again[(where, key)] += 1
                return True
            self.first[(where, key)] = line
            return False

    def summary(self) -> list[tuple[str, str]]:
        """(where, line) for every warning seen more than once."""
        with self._lock:
            return [(where, f"(repeated {n} more times) {self.first[(where, key)].strip()}")
                    for (where, key), n in sorted(self.again.items())]


class ComponentFiles(logging.Handler):
    """Sends each record to its component's rotated file, opened on first use; a repeated warning is counted."""

    def __init__(self, logs_dir: Path, repeats: Repeats) -> None:
        super().__init__(logging.DEBUG)
        self.logs_dir, self.repeats = logs_dir, repeats
        self.files: dict[str, logging.Handler] = {}
        self.setFormatter(logging.Formatter(FORMAT))
        self.raw = logging.Formatter("%(asctime)s %(message)s")

    def file(self, component: str) -> logging.Handler:
        with self.lock:
            h = self.files.get(component)
            if h is None:
                h = logging.handlers.RotatingFileHandler(self.logs_dir / f"{component}.log", maxBytes=MAX_BYTES,
                                                         backupCount=BACKUPS, encoding="utf-8", delay=True)
                h.setFormatter(self.raw if component.startswith(("worker-", "ray-")) else self.formatter)
                self.files[component] = h
            return h

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.INFO and not record.name.startswith(OWN):
            return  # a library's debug chatter (Ray Data logs at DEBUG; Ray keeps that in its session folder)
        component = component_of(record.name)
        if record.levelno == logging.WARNING and self.repeats.seen(component,
                                                                   f"WARNING {record.name}: {record.getMessage()}"):
            return
        self.file(component).handle(record)

    def write(self, component: str, line: str) -> None:
        """A line of a worker's output into that worker's file, as is (after a timestamp)."""
        self.file(component).handle(logging.LogRecord(WORKER_LOGGER, logging.INFO, "", 0, line, None, None))

    def close(self) -> None:
        for h in self.files.values():
            h.close()
        super().close()


class OwnWarnings(logging.Handler):
    """The pipeline's own warnings and errors in the driver, on the console as ``! message``."""

    def __init__(self, console: Any) -> None:
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(OWN) and record.name != "pipeline.base.console":
            try:
                self.console.attention(record.getMessage())
            except Exception:
                self.handleError(record)


def rotate_if_full(path: Path) -> None:
    """``path`` -> ``path.1`` -> ... ``path.BACKUPS`` (the oldest dropped) once it holds ``MAX_BYTES``, as a
    ``RotatingFileHandler`` does: a file appended to by every attempt of a run must not grow without bound. A
    smaller one stays, so a resume appends to the first attempt's lines."""
    try:
        if path.stat().st_size < MAX_BYTES:
            return
        for n in range(BACKUPS - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{n + 1}"))
        path.replace(path.with_name(f"{path.name}.1"))
    except OSError:  # absent (a fresh folder), or it cannot rotate: append to it as it is
        return


def _is_console_handler(h: logging.Handler) -> bool:
    """A handler that writes to the process's stdout or stderr (not a file)."""
    if isinstance(h, logging.FileHandler) or not isinstance(h, logging.StreamHandler):
        return False
    return type(h).__name__ in ("PlainRayHandler", "_StderrHandler") or getattr(h, "stream", None) in (
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)


def preload_library_logging() -> None:
    """Let Ray and Ray Data set up their console handlers now (at import), so that ``adopt_loggers`` finds them
    instead of them printing later. Not transformers: its import is ~0.7 s of the driver's start that a run needs
    only once it builds a tiny target, extracts or trains (``adopt_transformers_logging``, called there)."""
    import importlib

    for name in ("ray", "ray.data"):
        try:
            importlib.import_module(name)
        except Exception:  # not installed here: nothing of it to route
            continue


def adopt_transformers_logging() -> None:
    """Where the driver first uses transformers: its own stderr handler (made on first use) is taken over like
    every other library's, so its lines go to ``transformers.log``; a no-op outside a ``capture``."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger("transformers")  # adds transformers' own stderr handler, once
    except Exception:  # not installed here: nothing of it to route
        return
    if _ACTIVE is not None:
        _ACTIVE.adopt_loggers()


class RunLogs:
    """The routing ``capture`` sets up, and what it undoes."""

    def __init__(self, logs_dir: Path, verbose: bool, console: Any = None) -> None:
        self.dir, self.verbose, self.console = Path(logs_dir), verbose, console
        self.repeats = Repeats()
        self.files = ComponentFiles(self.dir, self.repeats)
        self.handlers: list[logging.Handler] = [self.files]
        self.set_aside: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
        self.root_state: tuple[list[logging.Handler], int] | None = None
        self.levels: list[tuple[logging.Logger, int]] = []
        self.saved_fds: tuple[int, int] | None = None
        self.ray_attached = False

    def install(self) -> None:
        root = logging.getLogger()
        self.root_state = (list(root.handlers), root.level)
        for h in list(root.handlers):
            root.removeHandler(h)
        if self.verbose:
            stream = logging.StreamHandler(sys.stderr)
            stream.setLevel(logging.INFO)  # debug stays in the files
            stream.setFormatter(logging.Formatter(FORMAT))
            stream.addFilter(lambda r: r.name != "pipeline.base.console")
            self.handlers.append(stream)
        elif self.console is not None:
            self.handlers.append(OwnWarnings(self.console))
        for h in self.handlers:
            root.addHandler(h)
        root.setLevel(logging.INFO)
        for name in OWN:
            lg = logging.getLogger(name)
            self.levels.append((lg, lg.level))
            lg.setLevel(logging.DEBUG)
        logging.captureWarnings(True)
        preload_library_logging()
        self.adopt_loggers()

    def adopt_loggers(self) -> None:
        """Libraries that print through handlers of their own (Ray, Ray Data, transformers, torch, vLLM) log
        through ours (files; with ``verbose`` the console as well)."""
        for lg in [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
            if not isinstance(lg, logging.Logger):
                continue
            mine = [h for h in lg.handlers if _is_console_handler(h)]
            if mine:
                self.set_aside.append((lg, mine, lg.propagate))
                for h in mine:
                    lg.removeHandler(h)
                lg.propagate = True

    def redirect_output(self) -> None:
        """Point this process's stdout and stderr (file descriptors 1 and 2: C++ logs, progress bars, stray prints)
        at ``output.log``. The console writes to a copy of the terminal's descriptor (``Console.for_cli``)."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        path = self.dir / "output.log"
        rotate_if_full(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.saved_fds = (os.dup(1), os.dup(2))
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def attach_ray(self) -> None:
        """Once Ray is up: its loggers log through ours, and the workers' forwarded output goes to the files."""
        self.adopt_loggers()
        try:
            import ray._private.worker as ray_worker

            node = getattr(ray_worker, "_global_node", None)
            session = node.get_logs_dir_path() if node is not None else None
        except Exception:
            ray_worker, session = None, None
        if session:
            log.info("Ray session logs (every worker's own files): %s", session)
        dispatcher = getattr(ray_worker, "global_worker_stdstream_dispatcher", None)
        if dispatcher is None or not hasattr(dispatcher, "add_handler"):
            log.warning("this Ray cannot hand worker output to the pipeline: it stays in %s", session)
            return
        if not self.verbose:
            dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("pipeline_worker_logs", self.worker_output)
        self.ray_attached = True

    def worker_output(self, data: dict[str, Any]) -> None:
        """One batch of a Ray worker's stdout or stderr lines (called on Ray's log thread)."""
        try:
            component = worker_component(data.get("actor_name"), data.get("task_name"), data.get("pid"))
            ip = data.get("ip")
            where = f"pid={data.get('pid')}" + (f", ip={ip}" if ip and ip != data.get("localhost") else "")
            lines = data.get("lines") or []
            if data.get("pid") == "autoscaler":  # its status dumps every few seconds: only its events, as Ray does
                lines = list(getattr(sys.modules.get("ray._private.worker"), "filter_autoscaler_events", list)(lines))
            for line in lines:
                if "__ray_tqdm_magic_token__" in line:
                    continue  # a progress-bar state update, not text
                text = f"({where}) {line}"
                if not self.repeats.seen(component, text):
                    self.files.write(component, text)
        except Exception:  # Ray's log thread must keep running
            log.debug("could not write worker output", exc_info=True)

    def close(self) -> None:
        for where, line in self.repeats.summary():
            if where.startswith(("worker-", "ray-")):
                self.files.write(where, line)
            else:
                self.files.file(where).handle(logging.LogRecord(__name__, logging.INFO, "", 0, line, None, None))
        if self.ray_attached:
            try:
                import ray._private.worker as ray_worker

                ray_worker.global_worker_stdstream_dispatcher.remove_handler("pipeline_worker_logs")
            except Exception:
                pass
        if self.saved_fds is not None:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os.dup2(self.saved_fds[0], 1)
            os.dup2(self.saved_fds[1], 2)
            for fd in self.saved_fds:
                os.close(fd)
            self.saved_fds = None
        logging.captureWarnings(False)
        root = logging.getLogger()
        for h in self.handlers:
            root.removeHandler(h)
            h.close()
        for lg, handlers, propagate in reversed(self.set_aside):
            for h in handlers:
                lg.addHandler(h)
            lg.propagate = propagate
        for lg, level in self.levels:
            lg.setLevel(level)
        if self.root_state is not None:
            for h in self.root_state[0]:
                root.addHandler(h)
            root.setLevel(self.root_state[1])


_ACTIVE: RunLogs | None = None


@contextmanager
def capture(logs_dir: str | Path, *, verbose: bool = False, console: Any = None) -> Iterator[RunLogs]:
    """Route this process's logging, its stdout/stderr and (once Ray is up, see ``after_ray_init``) the Ray
    workers' output to ``logs_dir``; ``verbose`` keeps them on the console too. On the way out it stops the Ray
    this run used, so that Ray's own shutdown output still lands in the files."""
    global _ACTIVE
    logs = RunLogs(Path(logs_dir), verbose, console)
    logs.dir.mkdir(parents=True, exist_ok=True)
    logs.install()
    if not verbose:
        logs.redirect_output()
    _ACTIVE = logs
    try:
        yield logs
    except BaseException as e:
        log.debug("run stopped by %s", type(e).__name__, exc_info=True)  # the caller reports it
        raise
    finally:
        try:
            if "ray" in sys.modules:
                import ray

                if ray.is_initialized():
                    ray.shutdown()
        finally:
            _ACTIVE = None
            logs.close()


def after_ray_init() -> None:
    """Called once Ray is up (pipeline.run.job.init_ray): no-op unless a ``capture`` is active."""
    if _ACTIVE is not None:
        _ACTIVE.attach_ray()


def active_dir() -> Path | None:
    """The folder logs go to in this run, if any."""
    return _ACTIVE.dir if _ACTIVE is not None else None
