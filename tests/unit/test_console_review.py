"""The console and the run's logs as a person at a terminal, or reading ``ray job submit``'s log, meets them: a
narrow terminal, a phase whose line does not change for minutes, a Ctrl-C, an ``output.log`` that outlives many
attempts."""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path

import pytest
import yaml

import pipeline.base.console as console_mod
import pipeline.base.logs as logs_mod
from pipeline.base.console import Console
from pipeline.run.cli import main


class _Terminal(io.StringIO):
    """A terminal of a given width, as ``Console`` sees it."""

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return 99


def test_a_narrow_terminal_gets_lines_that_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A redrawn line longer than the terminal wraps, and ``\\r\\x1b[K`` clears only its last row: every redraw
    left a row of debris. Terminals under 40 columns were taken for 120 wide."""
    monkeypatch.setattr(console_mod.os, "get_terminal_size", lambda fd: os.terminal_size((30, 24)))
    buf = _Terminal()
    console = Console(buf, tty=True)
    console.live("[generate] 80/192 done (80 passed, 0 quarantined, 0 not generated), 2.7k tokens, 44 tok/s")
    drawn = buf.getvalue().split("\r\x1b[K")[-1]
    assert 0 < len(drawn) < 30 and drawn.endswith("…")


def test_a_terminal_that_reports_no_size_gets_a_default_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console_mod.os, "get_terminal_size", lambda fd: os.terminal_size((0, 0)))
    assert Console(_Terminal(), tty=True).width() == 120


def test_a_phase_whose_line_does_not_change_still_shows_it_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """``[served] measuring the export in vLLM`` (or ``[train] starting the training workers``) stays the same for
    as long as an engine or Ray Train starts: a plain console (``ray job submit``) printed it once and then nothing
    for minutes, although it promises a line every ``every_s``; it now says how long the phase has run."""
    monkeypatch.setattr(console_mod, "TTY_EVERY_S", 0.05)
    monkeypatch.setattr(console_mod, "STALE_S", 0.1)
    buf = io.StringIO()
    console = Console(buf, tty=False, every_s=0.05)
    with console.phase(lambda final: "[served] done" if final else "[served] measuring the export in vLLM"):
        time.sleep(1.4)
    lines = buf.getvalue().splitlines()
    assert lines[-1] == "[served] done"
    progress = lines[:-1]
    assert len(progress) >= 2 and len(set(progress)) == len(progress)  # alive, and no line printed twice
    assert "[served] measuring the export in vLLM (1s)" in progress


def test_a_changing_line_is_shown_as_it_is() -> None:
    buf = io.StringIO()
    console = Console(buf, tty=False, every_s=1000)
    with console.phase(lambda final: "[x] done" if final else "[x] 1/2", announce=True):
        pass
    assert buf.getvalue().splitlines() == ["[x] 1/2", "[x] done"]


def _config(tmp_path: Path) -> Path:
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = {"output_dir": str(tmp_path / "out"), "model": {"profile": "deepseek"},
           "datasets": [{"name": "chat", "path": str(tmp_path / "chat.jsonl")}],
           "sources": [{"kind": "openrouter", "name": "api", "model": "m", "budgets": {"chat": 100}}],
           "training": None}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_ctrl_c_ends_a_run_with_one_line_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    """Ctrl-C is the user's, not a bug: one line saying what a re-run does, and exit 130 (the shell's code for
    SIGINT), instead of a Python traceback."""
    import pipeline.run.job as job

    def interrupted(cfg, console):
        raise KeyboardInterrupt

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-test")
    monkeypatch.setattr(job, "run", interrupted)
    monkeypatch.setattr(Console, "for_cli", classmethod(lambda cls, **kw: cls(io.StringIO())))
    path = _config(tmp_path)
    try:
        code = main(["run", str(path)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left the command line as a traceback")
    assert code == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "interrupted" in err and f"python -m pipeline run {path}" in err


def test_output_log_is_rotated_when_a_run_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``output.log`` takes the process's raw descriptors, so it cannot rotate while a run writes it; it grew by
    every attempt's output without bound. A run that finds it past ``MAX_BYTES`` rotates it first (``BACKUPS``
    kept), as the other files are; a smaller one is appended to, so a resume keeps the first attempt's lines."""
    monkeypatch.setattr(logs_mod, "MAX_BYTES", 100)
    monkeypatch.setattr(logs_mod.RunLogs, "install", lambda self: None)
    monkeypatch.setattr(logs_mod.RunLogs, "close", lambda self: _restore(self))
    out = tmp_path / "output.log"
    out.write_text("first attempt\n")
    with logs_mod.capture(tmp_path):
        os.write(2, b"second attempt\n")
    assert out.read_text() == "first attempt\nsecond attempt\n"  # appended: nothing of the first lost
    for n in range(5):
        out.write_text(f"attempt {n}\n" + "x" * 200)
        with logs_mod.capture(tmp_path):
            os.write(2, b"new\n")
        assert out.read_text() == "new\n"
    backups = sorted(p.name for p in tmp_path.glob("output.log.*"))
    assert backups == ["output.log.1", "output.log.2", "output.log.3"]
    assert re.match(r"attempt 4\n", (tmp_path / "output.log.1").read_text())
    assert re.match(r"attempt 2\n", (tmp_path / "output.log.3").read_text())


def _restore(logs: logs_mod.RunLogs) -> None:
    """Only the descriptors back (the test installs no logging)."""
    if logs.saved_fds is not None:
        os.dup2(logs.saved_fds[0], 1)
        os.dup2(logs.saved_fds[1], 2)
        for fd in logs.saved_fds:
            os.close(fd)
        logs.saved_fds = None


def test_a_warning_before_the_run_holds_its_folder_reaches_the_console_as_a_console_line(tmp_path: Path) -> None:
    """A resume after a killed attempt breaks its stale lock before the run's logs exist: that warning came out as
    a timestamped log line (``2026-... WARNING pipeline.base.run_lock: ...``) amid the console's own lines; it is
    the pipeline's own warning, so it reads ``! ...`` as the others do. In a fresh interpreter: pytest's own
    logging handlers would keep the command line's from being installed."""
    import subprocess
    import sys

    path = _config(tmp_path)
    code = (
        "import json, sys\n"
        "import pipeline.run.job as job\n"
        "from pipeline.base import run_lock\n"
        "out = sys.argv[2]\n"
        "import os; os.makedirs(out)\n"
        "json.dump({'host': run_lock.HOST, 'pid': 2**22 + 7, 'started_at': 1, 'heartbeat_at': 1, 'token': 't',\n"
        "           'machine': run_lock.MACHINE}, open(out + '/run.lock', 'w'))  # a killed attempt's\n"
        "job._run = lambda cfg, layout, console: {'not_generated': 0}\n"
        "from pipeline.run.cli import main\n"
        "sys.exit(main(['run', sys.argv[1]]))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OPENROUTER_API_KEY="sk-or-test")
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "out")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.startswith("! breaking stale lock") and len(done.stderr.splitlines()) == 1, done.stderr
