"""The run lock: one writer per output folder, a clear refusal naming the holder, stale locks recovered; a lost
lock is never clobbered and stops its writers (the heartbeat's compare-and-swap, ``ensure_held``, WriteShards)."""

from __future__ import annotations

import errno
import fcntl
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.base import run_lock
from pipeline.base.flight import rows_to_table
from pipeline.base.layout import RunLayout, shard_name
from pipeline.base.records import empty_sample
from pipeline.base.run_lock import HOST, LockHeld, LockLost, RunLock, current_lock, guard_path, on_lock_lost, read_lock
from pipeline.generate.stages import WriteShards


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


# -- a lost lock is never clobbered, and stops its holder ---------------------------------------------------------
def _age(lock: RunLock, seconds: float) -> None:
    """Make a held lock look stale (same token): as if its holder had been frozen for ``seconds``."""
    _write_lock(lock.path, host=HOST, pid=os.getpid(), heartbeat_at=time.time() - seconds, token=lock.token)


def test_takeover_attempt_during_a_heartbeat_never_clobbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder is paused between its ownership check and its rename while a contender breaks its (stale-looking)
    lock: the old read-then-rewrite heartbeat clobbered the new lock and left two runs each believing it held the
    folder. Now the contender waits for the guard, and afterwards exactly one run believes, and it is the file's."""
    a = RunLock.for_folder(tmp_path, heartbeat_s=30, stale_after_s=60, settle_s=0).acquire()
    b = RunLock(a.path, heartbeat_s=30, stale_after_s=60, settle_s=0)
    _age(a, 120)
    holder_paused = threading.Event()  # a checked its token and is about to rename its new record over the lock
    contender_waiting = threading.Event()  # b reached the guard, or b finished
    real_replace, real_guard = os.replace, getattr(run_lock, "_guard", None)

    def replace(src: Any, dst: Any) -> None:
        if threading.current_thread().name == "holder" and Path(dst) == a.path:
            holder_paused.set()
            assert contender_waiting.wait(10)
        real_replace(src, dst)

    def guard(path: Any, wait_s: float) -> Any:
        if threading.current_thread().name == "contender":
            contender_waiting.set()
        return real_guard(path, wait_s)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(run_lock, "_guard", guard, raising=False)
    beats: list[bool] = []
    refused: list[LockHeld] = []

    def contend() -> None:
        try:
            b.acquire()
        except LockHeld as e:
            refused.append(e)
        finally:
            contender_waiting.set()

    holder = threading.Thread(target=lambda: beats.append(a.beat()), name="holder")
    contender = threading.Thread(target=contend, name="contender")
    holder.start()
    assert holder_paused.wait(10)
    contender.start()
    holder.join(30)
    contender.join(30)
    try:
        owner = json.loads(a.path.read_text())["token"]
        believers = [lock for lock in (a, b) if lock.held]
        assert [lock.token for lock in believers] == [owner]
        assert beats == [True] and refused  # the heartbeat landed first and made the lock fresh again
    finally:
        a.release()
        b.release()


def test_heartbeat_rechecks_before_its_rename_where_the_filesystem_has_no_locks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without flock (ENOLCK: NFS without lockd) a takeover between the heartbeat's first read and its rename is
    caught by the re-read before the rename: the new lock stays, the old holder learns it lost."""
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lost: list[str] = []
    a = RunLock.for_folder(tmp_path, heartbeat_s=30, stale_after_s=60, settle_s=0, on_lost=lost.append).acquire()
    b = RunLock(a.path, heartbeat_s=30, stale_after_s=60, settle_s=0)
    _age(a, 120)
    real_temp = run_lock.temp_path

    def takeover_then_temp(path: Any) -> Path:  # the heartbeat has read its token and now writes its temp file
        b.acquire()
        return real_temp(path)

    monkeypatch.setattr(run_lock, "temp_path", takeover_then_temp)
    try:
        assert a.beat() is False
        assert json.loads(a.path.read_text())["token"] == b.token and b.held
        assert a.lost and lost == [run_lock.TAKEN_OVER] and not a.held
    finally:
        monkeypatch.setattr(run_lock, "temp_path", real_temp)
        a.release()
        b.release()


def test_heartbeat_skips_rather_than_writes_while_another_process_holds_the_guard(tmp_path: Path) -> None:
    lock = RunLock.for_folder(tmp_path, heartbeat_s=0.2, stale_after_s=60, settle_s=0).acquire()
    child = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()", str(guard_path(lock.path))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        before = lock.path.read_bytes()
        assert lock.beat() is True  # waited heartbeat_s, then skipped: no write without the guard
        assert lock.path.read_bytes() == before and lock.held
    finally:
        child.stdin.close()
        child.wait(30)
    assert lock.beat() is True
    assert json.loads(lock.path.read_bytes())["heartbeat_at"] > json.loads(before)["heartbeat_at"]
    lock.release()


def test_ensure_held_reads_the_file_names_the_new_holder_and_tells_everyone_once(tmp_path: Path) -> None:
    lost: list[str] = []
    heard: list[str] = []
    unsubscribe = on_lock_lost(heard.append)
    try:
        lock = RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0, on_lost=lost.append).acquire()
        assert current_lock() is lock
        lock.ensure_held()  # ours: no error
        _write_lock(lock.path, host="other-host.example", pid=4242, heartbeat_at=time.time())
        for _ in range(2):  # long before the next heartbeat (30 s)
            with pytest.raises(LockLost) as err:
                lock.ensure_held()
            msg = str(err.value)
            assert "other-host.example" in msg and "pid 4242" in msg and "\n" not in msg
            assert err.value.holder is not None and err.value.holder["pid"] == 4242
        assert lost == heard == [run_lock.TAKEN_OVER]  # once each, however often the loss is seen
        assert not lock.held and lock.beat() is False
        lock.release()
        assert current_lock() is None
        assert json.loads(lock.path.read_text())["pid"] == 4242
    finally:
        unsubscribe()


def test_subscriber_after_the_loss_is_called_at_once_and_unsubscribe_stops_calls(tmp_path: Path) -> None:
    lock = RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0).acquire()
    try:
        early: list[str] = []
        stop = on_lock_lost(early.append)
        stop()
        lock.path.unlink()
        with pytest.raises(LockLost, match="removed.*no run holds it now"):
            lock.ensure_held()
        assert early == []
        late: list[str] = []
        on_lock_lost(late.append)()
        assert late == [run_lock.REMOVED]
    finally:
        lock.release()


def test_the_heartbeat_thread_finds_a_loss_and_calls_on_lost(tmp_path: Path) -> None:
    lost = threading.Event()
    reasons: list[str] = []
    lock = RunLock.for_folder(tmp_path, heartbeat_s=0.05, settle_s=0,
                              on_lost=lambda r: (reasons.append(r), lost.set())).acquire()
    try:
        lock.path.unlink()
        assert lost.wait(10)
        assert reasons == [run_lock.REMOVED] and lock.lost
        assert not lock.path.exists()  # the old holder never recreates a lock it lost
    finally:
        lock.release()


def test_leaving_the_with_block_of_a_lost_lock_raises_lock_lost(tmp_path: Path) -> None:
    """Whatever the body failed with (a Ray job ended by a writer refusing), or if it finished: LockLost, exit 2."""
    with pytest.raises(LockLost, match="other-host.example") as err:
        with RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0) as lock:
            _write_lock(lock.path, host="other-host.example", pid=1, heartbeat_at=time.time())
            raise RuntimeError("Ray Data job failed")
    assert isinstance(err.value.__cause__, RuntimeError)
    (tmp_path / "run.lock").unlink()
    with pytest.raises(LockLost, match="other-host.example"):
        with RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0) as lock:
            _write_lock(lock.path, host="other-host.example", pid=1, heartbeat_at=time.time())
    (tmp_path / "run.lock").unlink()
    with pytest.raises(ValueError, match="unrelated"):  # a failure of a run that kept its lock stays itself
        with RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0):
            raise ValueError("unrelated")
    assert not (tmp_path / "run.lock").exists()


def test_fence_runs_the_commit_only_while_the_lock_is_ours(tmp_path: Path) -> None:
    lock = RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0).acquire()
    try:
        with lock.fence():
            (tmp_path / "first").write_text("ours")
        with run_lock.fence(lock.path, lock.token):
            (tmp_path / "second").write_text("ours")
        _write_lock(lock.path, host="other-host.example", pid=1, heartbeat_at=time.time())
        with pytest.raises(LockLost), run_lock.fence(lock.path, lock.token):
            (tmp_path / "late").write_text("not ours")
        with pytest.raises(LockLost), lock.fence():
            (tmp_path / "late").write_text("not ours")
        assert not (tmp_path / "late").exists() and lock.lost
    finally:
        lock.release()


# -- WriteShards: writes only while the lock is ours, never a sample twice ---------------------------------------------
def _flight(sample_id: str, status: str = "ok") -> dict[str, Any]:
    row = empty_sample({"sample_id": sample_id, "dataset": "d", "row_index": 0, "messages": "[]", "thinking": False,
                        "prompt_ids": [1, 2], "prompt_assistant_mask": [0, 0]})
    row.update(output_ids=[3, 4], status=status, stage="validate" if status == "quarantine" else "",
               reason="too long" if status == "quarantine" else "")
    return row


def _batch(*rows: dict[str, Any]) -> pa.Table:
    return rows_to_table(list(rows))


def _ids(folder: Path) -> list[str]:
    return sorted(i for f in folder.glob("*.parquet") for i in pq.read_table(f, columns=["sample_id"])["sample_id"]
                  .to_pylist())


def test_write_shards_keeps_its_positional_form(tmp_path: Path) -> None:
    out = WriteShards(RunLayout(tmp_path))(_batch(_flight("a"), _flight("b", "quarantine")))
    assert out["status"].to_pylist() == ["ok", "quarantine"]
    assert _ids(RunLayout(tmp_path).samples) == ["a"] and _ids(RunLayout(tmp_path).quarantine) == ["b"]


def test_write_shards_never_writes_a_sample_twice(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    writer = WriteShards(RunLayout(tmp_path), done_ids=iter(["done"]))
    out = writer(_batch(_flight("done"), _flight("b"), _flight("c", "quarantine"), _flight("b"),
                        _flight("r", "reroute")))
    assert out["status"].to_pylist() == ["duplicate", "ok", "quarantine", "duplicate", "reroute"]
    assert [f.name for f in layout.samples.glob("*.parquet")] == [shard_name(["b"])]  # named by what it holds
    assert [f.name for f in layout.quarantine.glob("*.parquet")] == [shard_name(["c"])]
    out = writer(_batch(_flight("b"), _flight("c"), _flight("d")))  # a retried or re-fed batch
    assert out["status"].to_pylist() == ["duplicate", "duplicate", "ok"]
    assert _ids(layout.samples) == ["b", "d"] and _ids(layout.quarantine) == ["c"]
    out = writer(_batch(_flight("b")))  # nothing new: no shard at all
    assert out["status"].to_pylist() == ["duplicate"] and len(list(layout.samples.glob("*.parquet"))) == 2


def test_write_shards_refuses_after_a_takeover(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    lock = RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0).acquire()
    try:
        writer = WriteShards(RunLayout(tmp_path), token=lock.token, done_ids=[])
        writer(_batch(_flight("a")))
        assert _ids(layout.samples) == ["a"]
        _write_lock(lock.path, host="other-host.example", pid=4242, heartbeat_at=time.time())
        with pytest.raises(LockLost, match="other-host.example pid 4242"):
            writer(_batch(_flight("b"), _flight("c", "quarantine")))
        assert _ids(layout.samples) == ["a"] and _ids(layout.quarantine) == []
        assert sorted(p.name for p in layout.samples.iterdir()) == [shard_name(["a"])]  # no temp file either
    finally:
        lock.release()


def test_cli_run_whose_lock_was_taken_over_exits_2_naming_the_new_holder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run ended by a writer's refusal (the Ray job fails with its own error) is one line and exit 2."""
    from pipeline.base.console import Console
    from pipeline.run import cli
    from pipeline.run import job as run_module

    def taken_over_run(cfg: Any, console: Any) -> dict[str, Any]:
        with RunLock.for_folder(tmp_path, heartbeat_s=30, settle_s=0) as lock:
            _write_lock(lock.path, host="other-host.example", pid=4242, heartbeat_at=time.time())
            raise RuntimeError("Ray Data job failed: WriteShards raised LockLost")

    monkeypatch.setattr(cli, "_load", lambda args, check_paths=True: object())
    monkeypatch.setattr(Console, "for_cli", classmethod(lambda cls, **kw: Console()))
    monkeypatch.setattr(run_module, "run", taken_over_run)
    assert cli.main(["run", "job.yaml"]) == cli.EXIT_REFUSED == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stopped: ") and "other-host.example pid 4242" in err[0]


def _stale_lock_judged_by_a_late_breaker(path: Path) -> tuple[RunLock, dict[str, Any], bytes]:
    """A stale lock of another host, read by a contender that is then descheduled before it breaks it."""
    _write_lock(path, host="gone-host", pid=1, heartbeat_at=time.time() - 3600)
    info, raw = run_lock._inspect(path, 60.0)
    return RunLock(path, heartbeat_s=30, settle_s=0), info, raw


def _slow_restore(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """The late breaker, finding it moved a live lock by mistake, takes ``delay_s`` to put it back."""
    real = os.link

    def link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        time.sleep(delay_s)
        real(src, dst, *args, **kwargs)

    monkeypatch.setattr(run_lock.os, "link", link)


def test_a_contender_never_creates_a_lock_while_a_breaker_puts_a_live_one_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.lock"
    late, info, raw = _stale_lock_judged_by_a_late_breaker(path)
    winner = RunLock(path, heartbeat_s=30, settle_s=0).acquire()  # breaks the stale lock, holds the folder
    _slow_restore(monkeypatch, 0.3)
    breaker = threading.Thread(target=late._break, args=(info, raw))
    breaker.start()
    time.sleep(0.1)  # the winner's lock is moved aside, the path empty
    third = RunLock(path, heartbeat_s=30, settle_s=0)
    try:
        with pytest.raises(LockHeld, match="in use"):
            third.acquire()  # it would win a held lock, the winner's file deleted, both believing they hold it
        breaker.join()
        winner.ensure_held()
        assert read_lock(path)["token"] == winner.token
    finally:
        breaker.join()
        third.release()
        winner.release()


def test_a_new_holder_never_refuses_its_lock_for_a_breakers_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    path = tmp_path / "run.lock"
    late, info, raw = _stale_lock_judged_by_a_late_breaker(path)
    path.unlink()  # its holder's file went away: the next run creates one afresh
    _slow_restore(monkeypatch, 0.4)

    def break_once_created() -> None:
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        late._break(info, raw)

    breaker = threading.Thread(target=break_once_created)
    breaker.start()
    lock = RunLock(path, heartbeat_s=30, settle_s=0.2)  # its settling re-read falls in the breaker's gap
    try:
        lock.acquire()  # refused, it would leave its own lock behind with no run holding the folder
        assert lock.held and read_lock(path)["token"] == lock.token
    finally:
        breaker.join()
        lock.release()
    assert not path.exists()
