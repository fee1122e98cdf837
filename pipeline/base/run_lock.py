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

A holder frozen for longer than ``stale_after_s`` (SIGSTOP, a suspended VM, a
long GC pause) loses its lock, and must not write a byte after that. Every step
that could act on a lock that is no longer ours is a compare-and-swap under the
*guard*, an ``flock`` on the sidecar file ``.run.lock.guard`` (emulated with
fcntl byte-range locks on NFS, so it holds across hosts there too):

- the heartbeat writes its new record to a temp file, then under the guard
  re-reads the lock, compares the token and only then renames over it;
- breaking a stale lock (move aside, compare, maybe restore) happens under it, and so do creating a lock
  where none is and a new holder's settling re-read, so neither lands in a breaker's move-and-restore;
- ``release`` compares and unlinks under it;
- a writer commits under :func:`fence` (guard, token check, write, rename):
  ``WriteShards`` does so for every shard, with the path and token passed to it.

So on a filesystem with locks a takeover can never land between a holder's check
and its write. The holder checks ownership on every beat and in every
``ensure_held``; on loss it calls ``on_lost`` and every :func:`on_lock_lost`
subscriber once, and ``ensure_held``/``fence``/leaving the ``with`` block raise
:class:`LockLost` naming the new holder.

The windows that remain, by design of plain files: hosts' clocks must agree to
well within ``stale_after_s``. The guard is waited for, not waited on forever:
a process frozen *inside* a guarded step (microseconds for a heartbeat, one
shard write for a writer) for longer than ``stale_after_s`` lets a breaker in
unguarded, and its one pending rename may land after the takeover; the new
holder sees that at its next beat or check and stops (``LockLost``), so the
file still names one owner and writers check it before each shard. Where the
filesystem has no locks (ENOLCK, e.g. NFS without lockd) the same steps run
unguarded: check, write temp, re-check, rename, which leaves only the
microseconds between the last re-check and the rename.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pipeline.base.layout import RunLayout, temp_path

log = logging.getLogger(__name__)

HOST = socket.gethostname()


class LockHeld(RuntimeError):
    """Another run holds the folder's lock; ``holder`` is :func:`read_lock`'s view of it (None when unknown)."""

    def __init__(self, message: str, holder: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class LockLost(RuntimeError):
    """The lock this run held was taken over (its heartbeat had gone stale) or removed; the run must stop.

    ``holder`` is :func:`read_lock`'s view of the lock file when the loss was raised (None when unknown or
    gone). Picklable with its message alone: a Ray actor raises it too.
    """

    def __init__(self, message: str, holder: dict[str, Any] | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder
        self.path = path


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


# -- the guard: one check-and-write step at a time ------------------------------------
GuardState = Literal["held", "busy", "unsupported"]
_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_lock = threading.Lock()
_unsupported_noted: set[str] = set()


def guard_path(lock_path: str | Path) -> Path:
    """The sidecar file whose flock serializes check-and-write steps on ``lock_path`` (kept, never removed:
    removing a lock file lets two processes lock two different files)."""
    p = Path(lock_path)
    return p.with_name(f".{p.name}.guard")


def _thread_lock(gpath: Path) -> threading.Lock:
    with _thread_locks_lock:
        return _thread_locks.setdefault(str(gpath), threading.Lock())


@contextmanager
def _guard(lock_path: str | Path, wait_s: float) -> Iterator[GuardState]:
    """Hold the lock's guard for one step: yields "held"; "busy" when another process or thread kept it past
    ``wait_s``; "unsupported" when the filesystem has no locks. What busy means is the caller's to decide.

    One thread of a process at a time (a threading lock first): on NFS an flock is a POSIX lock, which the
    threads of one process share and any close of the file by that process drops.
    """
    gpath = guard_path(lock_path)
    deadline = time.monotonic() + wait_s
    mutex = _thread_lock(gpath)
    if not mutex.acquire(timeout=max(wait_s, 0.0)):
        yield "busy"
        return
    try:
        try:
            fd = os.open(gpath, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # e.g. a read-only folder: nothing can be written there either
            _note_unsupported(gpath, e)
            yield "unsupported"
            return
        try:
            yield _flock(fd, gpath, deadline)
        finally:
            os.close(fd)  # drops the flock
    finally:
        mutex.release()


def _flock(fd: int, gpath: Path, deadline: float) -> GuardState:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return "held"
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return "busy"
            time.sleep(0.005)
        except OSError as e:  # ENOLCK (NFS without lockd), EOPNOTSUPP, ...: fall back to re-read-and-rename
            _note_unsupported(gpath, e)
            return "unsupported"


def _note_unsupported(gpath: Path, e: OSError) -> None:
    if str(gpath) not in _unsupported_noted:
        _unsupported_noted.add(str(gpath))
        log.warning("lock guard %s unavailable (%s): re-read-and-rename only", gpath, errno.errorcode.get(
            e.errno or 0, e.strerror))


# -- who holds what, for code far from the `with` ------------------------------------------
_registry_lock = threading.Lock()
_subscribers: list[Callable[[str], None]] = []
_current: RunLock | None = None

TAKEN_OVER = "another run took the lock over"
REMOVED = "its file was removed"


def current_lock() -> RunLock | None:
    """The run lock this process holds (the latest acquired, not yet released): code deep in a run calls
    ``current_lock().ensure_held()`` or passes its ``path`` and ``token`` to a writer without plumbing."""
    return _current


def on_lock_lost(callback: Callable[[str], None]) -> Callable[[], None]:
    """Call ``callback(reason)`` exactly once when this process's run lock is lost, at once if it already is.

    It runs on the thread that found the loss (the heartbeat thread, or one calling ``ensure_held``), so it
    must be quick and must not wait on that thread: halting a ledger is the use. Returns the unsubscribe.
    """
    with _registry_lock:
        _subscribers.append(callback)
        reason = _current.lost_reason if _current is not None else None
    if reason is not None:
        _call(callback, reason)

    def unsubscribe() -> None:
        with _registry_lock:
            if callback in _subscribers:
                _subscribers.remove(callback)

    return unsubscribe


def _call(callback: Callable[[str], None], reason: str) -> None:
    try:
        callback(reason)
    except Exception:  # noqa: BLE001 - a failing callback must not hide the loss
        log.exception("lock-lost callback failed")


def _read(path: Path) -> bytes | None:
    """The lock file's bytes; None once it is gone (looked at three times: a contender without the guard
    restoring a lock it moved by mistake leaves the path empty for a moment)."""
    for attempt in range(3):
        try:
            return path.read_bytes()
        except FileNotFoundError:
            if attempt < 2:
                time.sleep(0.05)
    return None


def _why(raw: bytes | None) -> str:
    return REMOVED if raw is None else TAKEN_OVER


def lost_error(lock_path: str | Path, reason: str, stale_after_s: float = 60.0) -> LockLost:
    """The :class:`LockLost` of a run whose lock was lost, naming the holder the lock file names now."""
    path = Path(lock_path)
    try:
        found = _inspect(path, stale_after_s)
    except OSError:
        found = None
    info = found[0] if found else None
    holder = f"now held by {describe(info)}" if info else "no run holds it now"
    return LockLost(f"{path.parent}: this run's lock {path.name} was lost ({reason}); {holder}; "
                    f"this run stopped writing", info, str(path))


def check_token(lock_path: str | Path, token: str) -> None:
    """Raise :class:`LockLost` unless the lock file still holds ``token`` (one small read)."""
    raw = _read(Path(lock_path))
    if _token_of(raw) != token:
        raise lost_error(lock_path, _why(raw))


@contextmanager
def fence(lock_path: str | Path, token: str, wait_s: float = 60.0) -> Iterator[None]:
    """Commit one write only while the lock is ours: under the guard, check ``token``, then run the body.

    Breakers move a lock aside only under the guard, so what the body writes (and renames into place) cannot
    land after a takeover; a lock that is not ours raises :class:`LockLost` before the body writes anything.
    For a writer in another process (a Ray actor) that was handed the lock's path and token.
    """
    with _guard(lock_path, wait_s) as state:
        if state == "busy":
            log.warning("lock %s: guard busy for %gs; committing after a plain token check", lock_path, wait_s)
        check_token(lock_path, token)
        yield


class RunLock:
    """The single-writer lock of one output folder; take it before anything spends.

    ``with RunLock.for_folder(out): run(...)``. ``acquire`` raises :class:`LockHeld`
    when a live run holds the folder; ``release`` is idempotent and removes the
    file only while it is still ours. On a takeover, found by the heartbeat or by
    ``ensure_held``, ``lost`` turns true and ``on_lost`` (and every :func:`on_lock_lost`
    subscriber) is called once; leaving the ``with`` block then raises :class:`LockLost`,
    whatever else the body failed with (a writer refusing ends its job with its own error).
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
        """Raise :class:`LockLost` (naming the new holder) unless the lock file still holds our token.

        One small read, so call it freely: before committing work, at each progress point of a loop. A read
        error other than "gone" is logged and left to the heartbeat (a hiccup must not end the run).
        """
        if self._held and self.lost_reason is None:
            try:
                raw = _read(self.path)
            except OSError as e:
                log.warning("lock %s: cannot read it to check ownership: %s", self.path, e)
                return
            if _token_of(raw) != self.token:
                self._lose(_why(raw))
        if self.lost_reason is not None:
            raise lost_error(self.path, self.lost_reason, self.stale_after_s)

    @contextmanager
    def fence(self) -> Iterator[None]:
        """Run the body (one commit) under the guard after ``ensure_held``: it cannot land after a takeover."""
        with _guard(self.path, self.stale_after_s) as state:
            if state == "busy":
                log.warning("lock %s: guard busy for %gs; committing after a plain check", self.path,
                            self.stale_after_s)
            self.ensure_held()
            yield

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
        """Stop the heartbeat and remove the lock file if it is still ours (compare and unlink under the
        guard); a lock found taken over is marked lost and left in place. Safe to call twice."""
        global _current
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.heartbeat_s + 30.0)
        if not self._held:
            return
        self._held = False
        atexit.unregister(self.release)
        with _registry_lock:
            if _current is self:
                _current = None
        if self.lost_reason is not None:
            return
        lost = None
        with _guard(self.path, self.heartbeat_s):  # busy: compare and unlink anyway (the window is microseconds)
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                raw = None
            if _token_of(raw) == self.token:
                self.path.unlink(missing_ok=True)
            else:
                lost = _why(raw)
        if lost is not None:
            log.warning("lock %s: %s; leaving it in place", self.path, lost)
            self._lose(lost)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, LockLost) and self.held:
            try:
                self.ensure_held()  # did the body fail because the lock was lost (a writer refusing)?
            except LockLost:
                pass
        self.release()
        if self.lost_reason is not None and not isinstance(exc, LockLost):
            raise lost_error(self.path, self.lost_reason, self.stale_after_s) from exc

    # -- internals ---------------------------------------------------------------
    def _create(self) -> bool:
        """Create the lock file with O_EXCL (the one atomic step); False when it exists.

        Under the guard: a breaker that moved a live lock aside by mistake (it judged an older one stale) puts
        it back under the guard, and a create in that gap would win a lock someone holds, the holder's file
        deleted, both runs believing they hold it. An existing file is refused at once, unguarded (a live
        holder's writer may keep the guard for a shard write; a second driver must not wait on it)."""
        if os.path.lexists(self.path):
            return False
        now = time.time()
        record = {"host": HOST, "pid": os.getpid(), "started_at": now, "heartbeat_at": now, "token": self.token,
                  "machine": MACHINE}
        with _guard(self.path, self.stale_after_s):  # busy: create anyway (the window is a breaker's rename)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            try:
                _write_all(fd, json.dumps(record).encode())
            except BaseException:
                os.close(fd)
                self.path.unlink(missing_ok=True)  # ours: nobody may break a lock this fresh
                raise
            os.close(fd)
        self._record = record
        return True

    def _settle(self) -> None:
        """Re-read after a short wait: catches a contender that moved our new lock while restoring another one.

        Read under the guard (and looked at thrice): a breaker moves a lock aside and puts it back under it, and
        reading our lock in that gap would refuse a lock we hold, leaving it behind with nobody running."""
        if self.settle_s > 0:
            time.sleep(self.settle_s)
        with _guard(self.path, self.stale_after_s):  # busy: read anyway
            raw = _read(self.path) or b""
        if _token_of(raw) != self.token:
            found = _inspect(self.path, self.stale_after_s)
            info = found[0] if found else None
            holder = describe(info) if info else "nobody (the file is gone)"
            raise LockHeld(f"{self.path.parent}: lock {self.path} taken over while acquiring; now held by {holder}",
                           info)

    def _break(self, info: dict[str, Any], raw: bytes) -> None:
        """Move the stale lock aside under a unique name; if what moved is not what was judged stale, put it back.

        Under the guard: the holder's heartbeat cannot slip between our move and our compare, and a writer
        cannot be between its token check and its rename while we move the lock.
        """
        with _guard(self.path, self.stale_after_s) as state:
            if state == "busy":
                log.warning("lock %s: its guard stayed busy for %gs (a holder frozen while committing?); "
                            "breaking it unguarded", self.path, self.stale_after_s)
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
        global _current
        self._held = True
        self.lost_reason = None
        self._stop.clear()
        atexit.register(self.release)
        with _registry_lock:
            _current = self
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
        """Rewrite ``heartbeat_at`` while the lock is ours; returns False (and marks it lost) once it is not.

        A compare-and-swap: the new record goes to a temp file first, then under the guard the lock is read
        again and renamed over only if it still holds our token (never clobbering a fresh takeover). A guard
        kept busy by someone else skips this beat rather than write unguarded.
        """
        if not self._held or self.lost_reason is not None:
            return False
        raw = _read(self.path)
        if _token_of(raw) != self.token:
            self._lose(_why(raw))
            return False
        if self._stop.is_set():
            return False
        record = dict(self._record, heartbeat_at=time.time())
        tmp = temp_path(self.path)
        lost = None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, json.dumps(record).encode())
            finally:
                os.close(fd)
            with _guard(self.path, self.heartbeat_s) as state:
                if state == "busy":
                    log.warning("lock %s: guard busy for %gs; skipping a heartbeat", self.path, self.heartbeat_s)
                    return True
                raw = _read(self.path)
                if _token_of(raw) == self.token:
                    os.replace(tmp, self.path)
                else:
                    lost = _why(raw)
        finally:
            tmp.unlink(missing_ok=True)
        if lost is not None:
            self._lose(lost)  # outside the guard: a callback may itself check or commit
            return False
        self._record = record
        return True

    def _lose(self, reason: str) -> None:
        """Mark the lock lost and tell ``on_lost`` and every subscriber, once."""
        with _registry_lock:
            if self.lost_reason is not None:
                return
            self.lost_reason = reason
            subscribers = list(_subscribers)
        log.error("lock %s lost: %s; this run must stop writing", self.path, reason)
        for callback in ([self.on_lost] if self.on_lost is not None else []) + subscribers:
            _call(callback, reason)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]
    os.fsync(fd)
