"""The run lock: one writer per output folder, a clear refusal naming the holder, stale locks recovered."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.layout import RunLayout
from pipeline.run_lock import HOST, LockHeld, RunLock, read_lock


def _write_lock(path: Path, *, host: str, pid: int, heartbeat_at: float, token: str | None = None) -> str:
    token = token or uuid.uuid4().hex
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "started_at": heartbeat_at - 5, "heartbeat_at": heartbeat_at,
                                "token": token}))
    # The lock's age is the newer of heartbeat_at and the file's mtime: age the file too.
    os.utime(path, (heartbeat_at, heartbeat_at))
    return token


def _reaped_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_acquire_writes_holder_and_release_removes(tmp_path: Path) -> None:
    lock = RunLock.for_folder(tmp_path, settle_s=0)
    assert lock.path == RunLayout(tmp_path).lock
    with lock:
        data = json.loads(lock.path.read_text())
        assert {"host", "pid", "started_at", "heartbeat_at", "token"} <= data.keys()
        assert data["host"] == HOST and data["pid"] == os.getpid() and data["token"] == lock.token
        info = read_lock(lock.path)
        assert info is not None and not info["stale"] and info["pid_alive"] and info["same_host"]
        assert lock.held
    assert not lock.path.exists()
    assert read_lock(lock.path) is None
    lock.release()  # idempotent
    lock.release()


def test_lock_can_be_taken_again_after_release(tmp_path: Path) -> None:
    with RunLock.for_folder(tmp_path, settle_s=0):
        pass
    with RunLock.for_folder(tmp_path, settle_s=0) as again:
        assert again.held


def test_second_lock_refuses_naming_the_holder(tmp_path: Path) -> None:
    first = RunLock.for_folder(tmp_path, settle_s=0).acquire()
    try:
        second = RunLock.for_folder(tmp_path, settle_s=0)
        with pytest.raises(LockHeld) as err:
            second.acquire()
        msg = str(err.value)
        assert "\n" not in msg
        assert HOST in msg and f"pid {os.getpid()}" in msg and "started" in msg and "last heartbeat" in msg
        assert isinstance(err.value, RuntimeError)
        assert err.value.holder is not None and err.value.holder["token"] == first.token
        second.release()  # releasing a lock never held touches nothing
        assert json.loads(first.path.read_text())["token"] == first.token
    finally:
        first.release()


def test_lock_of_dead_pid_on_this_host_is_recovered(tmp_path: Path) -> None:
    path = RunLayout(tmp_path).lock
    dead = _reaped_pid()
    _write_lock(path, host=HOST, pid=dead, heartbeat_at=time.time())  # fresh heartbeat, dead holder
    info = read_lock(path)
    assert info is not None and info["stale"] and info["pid_alive"] is False
    with RunLock(path, settle_s=0) as lock:
        assert json.loads(path.read_text())["token"] == lock.token
    assert not list(tmp_path.glob(".run.lock.stale.*"))  # the stale file moved aside is gone too


def test_fresh_lock_of_another_host_is_never_broken(tmp_path: Path) -> None:
    path = RunLayout(tmp_path).lock
    token = _write_lock(path, host="other-host.example", pid=1, heartbeat_at=time.time() - 5)
    with pytest.raises(LockHeld, match="other-host.example"):
        RunLock(path, settle_s=0).acquire()
    info = read_lock(path)
    assert info is not None and not info["stale"] and info["pid_alive"] is None and not info["same_host"]
    assert json.loads(path.read_text())["token"] == token


def test_stale_lock_of_another_host_is_broken(tmp_path: Path) -> None:
    path = RunLayout(tmp_path).lock
    _write_lock(path, host="other-host.example", pid=1, heartbeat_at=time.time() - 120)
    info = read_lock(path, stale_after_s=60)
    assert info is not None and info["stale"] and "heartbeat" in info["stale_reason"]
    assert info["heartbeat_age_s"] >= 119
    with RunLock(path, stale_after_s=60, settle_s=0) as lock:
        assert json.loads(path.read_text())["token"] == lock.token


def test_unreadable_fresh_lock_is_held_old_one_is_broken(tmp_path: Path) -> None:
    path = RunLayout(tmp_path).lock
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")  # a contender between O_EXCL create and its write
    with pytest.raises(LockHeld, match="unreadable"):
        RunLock(path, settle_s=0).acquire()
    old = time.time() - 300
    os.utime(path, (old, old))
    with RunLock(path, settle_s=0) as lock:
        assert lock.held


def test_heartbeat_advances(tmp_path: Path) -> None:
    with RunLock.for_folder(tmp_path, heartbeat_s=0.05, settle_s=0) as lock:
        first = json.loads(lock.path.read_text())
        deadline = time.time() + 5
        while time.time() < deadline:
            time.sleep(0.05)
            now = json.loads(lock.path.read_text())
            if now["heartbeat_at"] > first["heartbeat_at"]:
                break
        assert now["heartbeat_at"] > first["heartbeat_at"]
        assert now["started_at"] == first["started_at"] and now["token"] == first["token"]
        assert not lock.lost


def test_release_keeps_a_lock_taken_over_by_someone_else(tmp_path: Path) -> None:
    lock = RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0).acquire()
    theirs = _write_lock(lock.path, host="other-host.example", pid=1, heartbeat_at=time.time())
    lock.release()
    assert json.loads(lock.path.read_text())["token"] == theirs


def test_heartbeat_detects_takeover_and_stops_writing(tmp_path: Path) -> None:
    lost: list[str] = []
    lock = RunLock.for_folder(tmp_path, heartbeat_s=0.05, settle_s=0, on_lost=lost.append).acquire()
    try:
        theirs = _write_lock(lock.path, host="other-host.example", pid=1, heartbeat_at=time.time())
        deadline = time.time() + 5
        while not lock.lost and time.time() < deadline:
            time.sleep(0.02)
        assert lock.lost and lost and "took the lock over" in lost[0]
        with pytest.raises(RuntimeError, match="lost"):
            lock.ensure_held()
        time.sleep(0.2)
        assert json.loads(lock.path.read_text())["token"] == theirs  # never overwritten by the old holder
    finally:
        lock.release()
    assert json.loads(lock.path.read_text())["token"] == theirs


def _contend(path: str, barrier: Any, done: Any, results: Any) -> None:
    lock = RunLock(path, heartbeat_s=0.5, stale_after_s=30)
    barrier.wait(timeout=30)
    try:
        lock.acquire()
    except LockHeld as e:
        results.put(("held", os.getpid(), str(e)))
        return
    results.put(("won", os.getpid(), ""))
    done.wait(timeout=30)  # hold the lock until every contender has tried
    lock.release()


def _race(path: Path, n: int = 8) -> list[tuple[str, int, str]]:
    ctx = mp.get_context("fork")
    barrier, done, results = ctx.Barrier(n), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_contend, args=(str(path), barrier, done, results)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        out = [results.get(timeout=60) for _ in range(n)]
    finally:
        done.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return out


@pytest.mark.parametrize("round_", range(3))
def test_eight_racing_processes_exactly_one_wins(tmp_path: Path, round_: int) -> None:
    path = RunLayout(tmp_path).lock
    out = _race(path)
    winners = [pid for kind, pid, _ in out if kind == "won"]
    assert len(winners) == 1
    for kind, _, msg in out:
        if kind == "held":  # the refusal names the winner
            assert f"pid {winners[0]}" in msg
    assert not path.exists()  # the winner released


def test_eight_processes_racing_to_break_a_stale_lock_exactly_one_wins(tmp_path: Path) -> None:
    path = RunLayout(tmp_path).lock
    _write_lock(path, host=HOST, pid=_reaped_pid(), heartbeat_at=time.time())
    out = _race(path)
    assert sum(kind == "won" for kind, _, _ in out) == 1
    assert not list(tmp_path.glob(".run.lock.stale.*"))
