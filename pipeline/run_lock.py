"""One writer per output folder, on a local or shared (NFS-like) filesystem.

Two drivers writing the same folder would both spend money on the same prompts
and interleave their shards, so a run takes ``RunLayout(out).lock`` before it
starts anything (Ray, a single request) and a second driver refuses at once,
naming the holder. The lock file is created with ``O_CREAT | O_EXCL`` (atomic on
local filesystems and NFSv3+) and holds ``{host, pid, started_at, heartbeat_at,
token}``; a daemon thread rewrites ``heartbeat_at`` every ``heartbeat_s``.

A holder that died leaves its lock behind; the next run takes it over when the
holder is on this host and its pid is gone (at once), or when its heartbeat is
older than ``stale_after_s`` (any host). Breaking renames the stale file to a
unique name first, so of several contenders only one moves it, and the new lock
is again created with ``O_EXCL``, so only one wins.

Limits, by design of plain files: hosts' clocks must agree to well within
``stale_after_s``; a holder frozen for longer than ``stale_after_s`` (SIGSTOP,
suspended VM) loses its lock and learns so at its next heartbeat (``lost``,
``on_lost``), which is when it must stop writing.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.layout import RunLayout, atomic_write

log = logging.getLogger(__name__)

HOST = socket.gethostname()


class LockHeld(RuntimeError):
    """Another run holds the folder's lock; ``holder`` is :func:`read_lock`'s view of it (None when unknown)."""

    def __init__(self, message: str, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class LockLost(RuntimeError):
    """The lock this run held was taken over (its heartbeat had gone stale) or removed."""


def _machine_id() -> str:
    """Kernel boot id plus pid namespace: "same host" means same kernel and same pid space.

    Containers on different machines may share a hostname; a pid seen from
    another pid namespace says nothing about liveness here.
    """
    parts = []
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        pass
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    return "/".join(parts)


MACHINE = _machine_id()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (a pid owned by another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError and the like: it exists, we may not signal it
        return True
    return True


def _iso(t: float | None) -> str:
    if t is None:
        return "?"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _inspect(path: Path, stale_after_s: float, now: float | None = None) -> tuple[dict[str, Any], bytes] | None:
    """The lock's status and its raw bytes (what a breaker compares before and after moving it); None if absent."""
    try:
        raw = path.read_bytes()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    now = time.time() if now is None else now
    try:
        data = json.loads(raw)
        if not isinstance(data, dict) or not data.get("token"):
            raise ValueError("not a lock record")
        host, pid = str(data.get("host", "")), int(data.get("pid", 0))
        beat = float(data.get("heartbeat_at") or data.get("started_at") or 0.0)
    except (ValueError, TypeError) as e:
        # Empty or torn: most likely being created this very moment, so only its age can make it stale.
        age = now - mtime
        stale = age > stale_after_s
        info: dict[str, Any] = {
            "path": str(path), "corrupt": True, "error": f"{type(e).__name__}: {e}", "host": None, "pid": None,
            "started_at": None, "heartbeat_at": None, "token": None, "heartbeat_age_s": age, "same_host": None,
            "pid_alive": None, "stale": stale,
            "stale_reason": f"unreadable lock file untouched for {age:.0f}s > {stale_after_s:g}s" if stale else None,
        }
        return info, raw
    # The newer of the recorded heartbeat and the file's mtime: one slow clock alone cannot make a live lock stale.
    age = now - max(beat, mtime)
    machine = str(data.get("machine") or "")
    same_host = host == HOST and (not machine or not MACHINE or machine == MACHINE)
    alive = pid_alive(pid) if same_host else None
    reason = None
    if same_host and not alive:
        reason = f"holder pid {pid} on this host ({host}) no longer exists"
    elif age > stale_after_s:
        reason = f"heartbeat {age:.0f}s old > {stale_after_s:g}s"
    info = {
        "path": str(path), "corrupt": False, "host": host, "pid": pid,
        "started_at": data.get("started_at"), "heartbeat_at": data.get("heartbeat_at"), "token": data["token"],
        "heartbeat_age_s": age, "same_host": same_host, "pid_alive": alive, "stale": reason is not None,
        "stale_reason": reason,
    }
    return info, raw


def read_lock(path: str | Path, *, stale_after_s: float = 60.0) -> dict[str, Any] | None:
    """Who holds a lock, for a status command; None when no lock file exists.

    Keys: path, host, pid, started_at, heartbeat_at (epoch seconds), token,
    heartbeat_age_s, same_host, pid_alive (None unless same host), stale,
    stale_reason, corrupt (True for an empty or torn file; then only its age is known).
    """
    found = _inspect(Path(path), stale_after_s)
    return None if found is None else found[0]


def describe(info: dict[str, Any]) -> str:
    """One line naming a lock's holder."""
    if info.get("corrupt"):
        return (f"unreadable lock {info['path']} ({info.get('error')}), "
                f"last written {info['heartbeat_age_s']:.0f}s ago")
    return (f"host {info['host']} pid {info['pid']}, started {_iso(info.get('started_at'))}, "
            f"last heartbeat {info['heartbeat_age_s']:.0f}s ago")


def _token_of(raw: bytes | None) -> str | None:
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data.get("token") if isinstance(data, dict) else None


class RunLock:
    """The single-writer lock of one output folder; take it before anything spends.

    ``with RunLock.for_folder(out): run(...)``. ``acquire`` raises :class:`LockHeld`
    when a live run holds the folder; ``release`` is idempotent and removes the
    file only while it is still ours. Watch ``lost`` (or pass ``on_lost``, called
    from the heartbeat thread) to learn that another run took the lock over.
    """

    def __init__(self, path: str | Path, *, heartbeat_s: float = 10.0, stale_after_s: float = 60.0,
                 settle_s: float = 0.05, on_lost: Callable[[str], None] | None = None) -> None:
        if heartbeat_s <= 0 or stale_after_s <= heartbeat_s:
            raise ValueError("need 0 < heartbeat_s < stale_after_s (a live holder must beat before it looks stale)")
        self.path = Path(path)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.settle_s = settle_s
        self.on_lost = on_lost
        self.token = uuid.uuid4().hex
        self.lost_reason: str | None = None
        self._record: dict[str, Any] = {}
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_folder(cls, out: str | Path, **kwargs: Any) -> RunLock:
        """The lock of the run folder ``out`` (``RunLayout(out).lock``)."""
        return cls(RunLayout(out).lock, **kwargs)

    # -- state ----------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._held and self.lost_reason is None

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` if another run took the lock over; call before committing work."""
        if self.lost_reason is not None:
            raise LockLost(f"lock {self.path} lost: {self.lost_reason}")

    # -- acquire / release ------------------------------------------------------
    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`LockHeld` naming the holder; breaks a stale lock first."""
        if self._held:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        self.token = uuid.uuid4().hex  # fresh per acquisition: a lock from an earlier one is never taken for ours
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for tries in range(50):  # only contention loops; each turn is a few syscalls
            if self._create():
                self._settle()
                self._start()
                return self
            found = _inspect(self.path, self.stale_after_s)
            if found is None:
                continue  # released between our create and our read
            info, raw = found
            if info["corrupt"] and not info["stale"] and info["heartbeat_age_s"] < 2.0 and tries < 40:
                time.sleep(0.02)  # most likely a contender between its O_EXCL create and its write: read again
                continue
            if not info["stale"]:
                raise LockHeld(f"{self.path.parent} is in use by another run: {describe(info)} (lock {self.path}); "
                               f"stop that run, or wait: a lock whose heartbeat is older than "
                               f"{self.stale_after_s:g}s is taken over", info)
            self._break(info, raw)
        raise LockHeld(f"{self.path.parent}: gave up taking its stale lock {self.path} (many contenders)")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still ours; safe to call twice."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.heartbeat_s + 30.0)
        if not self._held:
            return
        self._held = False
        atexit.unregister(self.release)
        if self.lost_reason is not None:
            return
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            log.warning("lock %s vanished before release", self.path)
            return
        if _token_of(raw) != self.token:
            log.warning("lock %s was taken over by another run; leaving it in place", self.path)
            return
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- internals ---------------------------------------------------------------
    def _create(self) -> bool:
        """Create the lock file with O_EXCL (the one atomic step); False when it exists."""
        now = time.time()
        record = {"host": HOST, "pid": os.getpid(), "started_at": now, "heartbeat_at": now, "token": self.token,
                  "machine": MACHINE}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            data = json.dumps(record).encode()
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)  # ours: nobody may break a lock this fresh
            raise
        os.close(fd)
        self._record = record
        return True

    def _settle(self) -> None:
        """Re-read after a short wait: catches a contender that moved our new lock while restoring another one."""
        if self.settle_s > 0:
            time.sleep(self.settle_s)
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        if _token_of(raw) != self.token:
            found = _inspect(self.path, self.stale_after_s)
            info = found[0] if found else None
            holder = describe(info) if info else "nobody (the file is gone)"
            raise LockHeld(f"{self.path.parent}: lock {self.path} taken over while acquiring; now held by {holder}",
                           info)

    def _break(self, info: dict[str, Any], raw: bytes) -> None:
        """Move the stale lock aside under a unique name; if what moved is not what was judged stale, put it back."""
        aside = self.path.with_name(f".{self.path.name}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it first
        try:
            moved = aside.read_bytes()
        except FileNotFoundError:
            moved = b""
        if moved != raw:
            # A contender broke it and took a new lock (or the holder beat) between our read and our rename.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                log.warning("lock %s: could not restore a lock moved by mistake (another appeared)", self.path)
            aside.unlink(missing_ok=True)
            return
        log.warning("breaking stale lock %s: %s (%s)", self.path, info["stale_reason"], describe(info))
        aside.unlink(missing_ok=True)

    def _start(self) -> None:
        self._held = True
        self.lost_reason = None
        self._stop.clear()
        atexit.register(self.release)
        self._thread = threading.Thread(target=self._beat_loop, name=f"run-lock-heartbeat:{self.path}", daemon=True)
        self._thread.start()

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self.beat():
                    return
            except OSError as e:  # a filesystem hiccup; a lasting one ends in a takeover we detect later
                log.warning("lock %s: heartbeat failed: %s", self.path, e)

    def beat(self) -> bool:
        """Rewrite ``heartbeat_at`` if the lock is still ours; returns False (and marks it lost) otherwise."""
        if not self._held or self.lost_reason is not None:
            return False
        raw = None
        for _ in range(3):  # a contender restoring a lock it moved by mistake leaves the path empty for a moment
            try:
                raw = self.path.read_bytes()
                break
            except FileNotFoundError:
                time.sleep(0.05)
        if _token_of(raw) != self.token:
            self._lose("the lock file is gone" if raw is None else "another run took the lock over")
            return False
        if self._stop.is_set():
            return False
        record = dict(self._record, heartbeat_at=time.time())
        atomic_write(self.path, json.dumps(record))
        self._record = record
        return True

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        log.error("lock %s lost: %s; this run must stop writing", self.path, reason)
        if self.on_lost is not None:
            try:
                self.on_lost(reason)
            except Exception:  # noqa: BLE001 - a failing callback must not hide the loss
                log.exception("on_lost callback failed")
