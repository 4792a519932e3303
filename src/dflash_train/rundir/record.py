"""RUN_DIR/run.json, the live record of the trainer: reading it (never raises for
content), the busy check, and the owner side `RunRecord` (acquire with an exclusive
flock on RUN_DIR/.run.lock, thread-safe atomic updates, release). Standard library only.

Fields: pid, create_time (the process start time, epoch seconds), hostname, argv, cwd,
run_dir, code_version, config_hash, started_at, live, step, last_checkpoint,
resumed_step (the step this process resumed at; 0 for a fresh start), tokens_per_s,
updated_at (ISO UTC) and, after release, ended_at."""
from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path
from typing import Any

from .files import atomic_write_json, now_iso, read_json
from .layout import LOCK_FILE, RUN_FILE
from .process import liveness, proc_info


class RunDirBusy(RuntimeError):
    """A live trainer holds the run dir; the message names its pid and host."""


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The parsed run.json, or None if there is none. A corrupt file reads as
    {"corrupt": "<reason>", "live": False} (never raises for content)."""
    data = read_json(Path(run_dir) / RUN_FILE)
    if data is None:
        return None
    if not isinstance(data, dict):
        return {"corrupt": f"{Path(run_dir) / RUN_FILE}: not an object", "live": False}
    if "corrupt" in data:
        data["live"] = False
    return data


def busy_message(run_dir: Path, record: dict[str, Any], why: str) -> str:
    return (f"run dir {run_dir} is in use by a live trainer: pid {record.get('pid')} on host "
            f"{record.get('hostname')} (started {record.get('started_at')}; {why}); "
            f"stop it first: dflash-train stop {run_dir}")


def check_not_busy(run_dir: Path) -> None:
    """Read-only: raise RunDirBusy when run.json names a live trainer other than this process."""
    old = read_record(run_dir)
    if old and old.get("pid") != os.getpid():
        live, why = liveness(old)
        if live:
            raise RunDirBusy(busy_message(run_dir, old, why))


_HELD: dict[str, int] = {}  # lock file -> descriptor, the flocks this process holds


class RunRecord:
    """Owner side of RUN_DIR/run.json::

        rec = RunRecord(run_dir)
        rec.acquire(argv, code_version, config_hash)   # RunDirBusy if a live trainer holds it
        rec.update(step=s, tokens_per_s=tps)           # thread-safe, atomic
        rec.release(last_checkpoint=name, step=s)      # at exit: live=false, record kept

    `acquire` also takes an exclusive flock on RUN_DIR/.run.lock, held until
    `release` or the process ends (the kernel drops it on any exit, SIGKILL
    included), so two trainers started at the same moment cannot both pass.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RUN_FILE
        self.record: dict[str, Any] = {}
        self._lock = threading.Lock()  # update() may be called from the checkpoint writer thread
        self._lock_fd: int | None = None

    def _take_flock(self) -> None:
        import fcntl

        key = str((self.run_dir / LOCK_FILE).resolve())
        if key in _HELD:  # this process holds it already (a second run in one process)
            return
        fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            old = read_record(self.run_dir) or {}
            raise RunDirBusy(busy_message(self.run_dir, old, f"{key} is locked by another process")) from None
        self._lock_fd = fd
        _HELD[key] = fd

    def acquire(self, argv: list[str], code_version: str, config_hash: str | None = None, **extra: Any) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_not_busy(self.run_dir)
        self._take_flock()
        old = read_record(self.run_dir)
        now = now_iso()
        self.record = {
            "pid": os.getpid(),
            "create_time": (proc_info(os.getpid()) or {}).get("create_time"),
            "hostname": socket.gethostname(),
            "argv": list(argv),
            "cwd": os.getcwd(),
            "run_dir": str(self.run_dir.resolve()),
            "code_version": code_version,
            "config_hash": config_hash,
            "started_at": now,
            "live": True,
            "step": 0,
            "last_checkpoint": (old or {}).get("last_checkpoint"),
            "tokens_per_s": None,
            "updated_at": now,
        }
        if old and "corrupt" not in old:
            self.record["previous"] = {k: old.get(k) for k in ("pid", "started_at", "ended_at", "step", "code_version")}
        self.record.update(extra)
        atomic_write_json(self.path, self.record)
        return dict(self.record)

    def update(self, **fields: Any) -> None:
        """Merge `fields` into the record and rewrite it atomically (sets updated_at). Thread-safe."""
        with self._lock:
            if not self.record:
                raise RuntimeError("RunRecord.update before acquire")
            self.record.update(fields)
            self.record["updated_at"] = now_iso()
            atomic_write_json(self.path, self.record)

    def release(self, last_checkpoint: str | Path | None = None, **fields: Any) -> None:
        """Mark the run not live (record kept) and drop the lock. Call at every exit path you control."""
        if not self.record:
            return
        if last_checkpoint is not None:
            fields["last_checkpoint"] = str(last_checkpoint)
        try:
            self.update(live=False, ended_at=now_iso(), **fields)
        finally:
            if self._lock_fd is not None:
                _HELD.pop(next((k for k, v in _HELD.items() if v == self._lock_fd), ""), None)
                os.close(self._lock_fd)  # closing the descriptor releases the flock
                self._lock_fd = None
