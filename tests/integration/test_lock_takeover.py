"""A frozen holder loses its lock and writes nothing after the takeover, as separate processes do it.

The holder is a child process that holds the run lock (heartbeat 0.2 s, stale after 1 s) and writes marker
files in a loop, each one committed under ``RunLock.fence()`` (``ensure_held`` under the lock's guard), as the
shard writer commits shards. It is frozen with SIGSTOP, this process takes the lock over once it is stale,
and the child is let go with SIGCONT: it must write not one marker more and exit through its lost-lock path
(code 2), and the new lock must still be the one in the file.

No Ray and no ``python -m pipeline run``: a full run on each side would start two Ray instances on a small
machine; the writer's refusal inside a run (WriteShards) is covered by tests/unit/test_run_lock.py. Only
properties are asserted, never how long a step took.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.base.run_lock import HOST, LockHeld, RunLock, guard_path

HOLDER = r"""
import sys, time
from pathlib import Path
from pipeline.base.run_lock import LockLost, RunLock

out = Path(sys.argv[1])
markers = out / "markers"
markers.mkdir()
lock = RunLock.for_folder(out, heartbeat_s=0.2, stale_after_s=1.0, settle_s=0).acquire()
print("held", lock.token, flush=True)
deadline = time.monotonic() + 300
i = 0
try:
    while time.monotonic() < deadline:
        with lock.fence():  # ensure_held under the guard, then the write: the commit of a writer
            (markers / f"{i:06d}").write_text(str(i))
        i += 1
        time.sleep(0.01)
except LockLost as e:
    print(f"lost: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
sys.exit(0)
"""


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (the heartbeat thread too, not just the main one)."""
    states = [stat.read_text().rsplit(")", 1)[1].split()[0] for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
    return bool(states) and all(s in ("T", "t") for s in states)


def _freeze_outside_a_commit(proc: subprocess.Popen, guard: Path) -> None:
    """SIGSTOP the holder at a moment it does not hold the guard (not inside a commit or a heartbeat's swap).

    A holder frozen inside one is the documented window (its one pending commit may land); this test is
    about the holder frozen anywhere else, which must write nothing more. Retried until such a moment.
    """
    for _ in range(1000):
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while not _stopped(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.005)
        fd = os.open(guard, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # free, and the holder cannot take it while frozen (closing our fd drops ours)
            except BlockingIOError:
                pass
        finally:
            os.close(fd)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("the holder always held the guard when frozen")


def _markers(out: Path) -> set[str]:
    return set(os.listdir(out / "markers"))


def test_frozen_holder_writes_nothing_after_a_takeover_and_exits_2(tmp_path: Path, repo_root: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=repo_root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    taker = RunLock.for_folder(tmp_path, heartbeat_s=0.2, stale_after_s=1.0, settle_s=0)
    try:
        first = proc.stdout.readline().split()
        assert first[:1] == ["held"], proc.stderr.read()
        old_token = first[1]
        deadline = time.monotonic() + 120
        while len(_markers(tmp_path)) < 3:  # it is writing
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.02)

        _freeze_outside_a_commit(proc, guard_path(taker.path))
        refused = 0
        while True:  # its heartbeat goes stale while it is frozen; then the lock is ours
            try:
                taker.acquire()
                break
            except LockHeld:
                refused += 1
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert refused > 0  # it really was held until the heartbeat went stale
        at_takeover = _markers(tmp_path)
        assert json.loads(taker.path.read_text())["token"] == taker.token != old_token

        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert _markers(tmp_path) == at_takeover  # not one write after the takeover
        lost = [line for line in err.splitlines() if line.startswith("lost: ")]
        assert len(lost) == 1 and f"host {HOST} pid {os.getpid()}" in lost[0]  # names the new holder
        assert json.loads(taker.path.read_text())["token"] == taker.token  # never clobbered
        taker.ensure_held()
        assert taker.held
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(30)
        taker.release()
    assert not taker.path.exists()
