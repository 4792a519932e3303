"""RUN_DIR/run.json: the live-process record of a training run.

The trainer owns it for the whole run::

    rec = RunRecord(run_dir)
    rec.acquire(argv, code_version(), cfg.hash())      # raises RunDirBusy if a live trainer holds it
    rec.update(step=s, tokens_per_s=tps, last_checkpoint=str(path))   # each log interval / commit
    rec.release(last_checkpoint=str(mgr.last_committed_path), step=s) # at exit: live=false, record kept

Fields: pid, create_time (psutil process start time, epoch seconds), hostname,
argv, cwd, run_dir, code_version, config_hash, started_at, live, step,
last_checkpoint (absolute path of the last committed checkpoint dir, or null),
tokens_per_s, updated_at (ISO UTC) and, after release, ended_at (+ any extra
fields passed to update/release). Every write is atomic (temp file + fsync +
rename), so readers never see a torn record.

Liveness (`is_live` / `liveness`): on the recording host, live means the pid
exists, is not a zombie, and its create_time equals the recorded one within
1 s; a pid reused by another process is NOT the trainer. On another host
(shared storage), the pid cannot be checked: the record counts as live when it
says live=true and was updated within FOREIGN_STALE_SECONDS.

Metrics helpers read the tail of RUN_DIR/metrics.jsonl: `last_metrics(run_dir, n)`
and `metrics_summary(run_dir)` -> {step, loss, tokens_per_s, ...}; they accept
the trainer's keys ``tokens_per_s`` (preferred), ``tok_per_s``, ``tok_s`` or
derive tok/s from cumulative ``tokens`` + ``time``/``elapsed`` of the last two lines.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from dflash_train.utils import atomic_write_json

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
START_TIME_TOLERANCE_S = 1.0
FOREIGN_STALE_SECONDS = 600.0


class RunDirBusy(RuntimeError):
    """run.json names a live trainer; the message names its pid and host."""


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _parse_iso(s: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(s)).timestamp()
    except (TypeError, ValueError):
        return None


def is_run_dir(path: Path) -> bool:
    """The one definition of a run dir: a directory holding run.json, config.yaml
    or checkpoints/ (what `dflash-train train` creates). `export` never writes over
    one (see export.check_out_dir)."""
    p = Path(path)
    return p.is_dir() and ((p / RUN_FILE).is_file() or (p / CONFIG_FILE).is_file() or (p / CHECKPOINTS_DIR).is_dir())


def process_create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
        return None


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """The parsed run.json, or None if there is none. A corrupt file reads as
    {"corrupt": "<reason>"} (never raises for content)."""
    p = Path(run_dir) / RUN_FILE
    try:
        text = p.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not an object")
        return data
    except ValueError as e:
        return {"corrupt": f"{p}: {e}", "live": False}


def liveness(record: dict[str, Any] | None) -> tuple[bool, str]:
    """(live, reason). Reasons are human sentences used by status/stop."""
    if not record:
        return False, "no run.json"
    if "corrupt" in record:
        return False, f"run.json is corrupt ({record['corrupt']})"
    pid = record.get("pid")
    host = record.get("hostname")
    if host and host != socket.gethostname():
        upd = _parse_iso(record.get("updated_at"))
        fresh = upd is not None and time.time() - upd < FOREIGN_STALE_SECONDS
        if record.get("live") and fresh:
            return True, f"recorded on host {host} (this is {socket.gethostname()}); pid not checkable here, record updated {time.time() - upd:.0f}s ago"
        return False, f"recorded on host {host} (this is {socket.gethostname()}); record says live={record.get('live')}, last update {record.get('updated_at')}"
    if not isinstance(pid, int) or pid <= 0:
        return False, "run.json has no valid pid"
    try:
        proc = psutil.Process(pid)
        ct = proc.create_time()
        status = proc.status()
    except psutil.NoSuchProcess:
        return False, f"pid {pid} has exited"
    except psutil.AccessDenied:
        return False, f"pid {pid}: access denied (cannot verify)"
    if status == psutil.STATUS_ZOMBIE:
        return False, f"pid {pid} has exited (zombie, not yet reaped)"
    rec_ct = record.get("create_time")
    if not isinstance(rec_ct, (int, float)) or abs(ct - float(rec_ct)) > START_TIME_TOLERANCE_S:
        started = datetime.fromtimestamp(ct, timezone.utc).isoformat(timespec="seconds")
        return False, (
            f"pid {pid} was reused by another process ({_cmdline(proc)}, started {started}; "
            f"the trainer started at create_time {rec_ct})"
        )
    return True, f"pid {pid} verified (start time matches)"


def is_live(record: dict[str, Any] | None) -> bool:
    return liveness(record)[0]


def _cmdline(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except (psutil.Error, OSError):
        return "?"
    return cmd if len(cmd) <= 80 else cmd[:77] + "..."


class RunRecord:
    """Owner side of RUN_DIR/run.json (see module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / RUN_FILE
        self.record: dict[str, Any] = {}
        self._lock = threading.Lock()  # update() may be called from the checkpoint writer thread

    def acquire(self, argv: list[str], code_version: str, config_hash: str | None = None, **extra: Any) -> dict[str, Any]:
        """Claim the run dir for this process (raises RunDirBusy if a live trainer holds it).

        Not a kernel lock: two trainers started within the same few
        milliseconds could both pass; the realistic case (a second start
        while one runs, or a restart after a crash/stop) is handled.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        old = read_record(self.run_dir)
        if old and old.get("pid") != os.getpid():
            live, why = liveness(old)
            if live:
                raise RunDirBusy(
                    f"run dir {self.run_dir} is in use by a live trainer: pid {old.get('pid')} on host "
                    f"{old.get('hostname')} (started {old.get('started_at')}; {why}); "
                    f"stop it first: dflash-train stop {self.run_dir}"
                )
        me = psutil.Process(os.getpid())
        now = _now_iso()
        self.record = {
            "pid": os.getpid(),
            "create_time": me.create_time(),
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
            self.record["updated_at"] = _now_iso()
            atomic_write_json(self.path, self.record)

    def release(self, last_checkpoint: str | Path | None = None, **fields: Any) -> None:
        """Mark the run not live (record kept). Call at every exit path you control."""
        if not self.record:
            return
        if last_checkpoint is not None:
            fields["last_checkpoint"] = str(last_checkpoint)
        self.update(live=False, ended_at=_now_iso(), **fields)


# --------------------------------------------------------------------------- metrics


def last_metrics(run_dir: Path, n: int = 2, max_bytes: int = 1 << 20) -> list[dict[str, Any]]:
    """The last `n` parseable JSON lines of RUN_DIR/metrics.jsonl (oldest first)."""
    p = Path(run_dir) / METRICS_FILE
    try:
        with open(p, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            chunk = f.read()
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for line in reversed(chunk.splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # a partial last line or the cut first line
        if isinstance(obj, dict):
            out.append(obj)
            if len(out) >= n:
                break
    return list(reversed(out))


_TPS_KEYS = ("tokens_per_s", "tok_per_s", "tokens_per_sec", "tok_s")


def metrics_summary(run_dir: Path) -> dict[str, Any]:
    """{step, loss, tokens_per_s, time} from the last logged interval (missing -> None)."""
    lines = last_metrics(run_dir, 2)
    if not lines:
        return {"step": None, "loss": None, "tokens_per_s": None, "time": None}
    last = lines[-1]
    tps = next((last[k] for k in _TPS_KEYS if isinstance(last.get(k), (int, float))), None)
    if tps is None and len(lines) == 2:
        a, b = lines
        for tkey in ("time", "elapsed", "wall_time"):
            if all(isinstance(x.get(k), (int, float)) for x in (a, b) for k in ("tokens", tkey)):
                dt = b[tkey] - a[tkey]
                if dt > 0:
                    tps = (b["tokens"] - a["tokens"]) / dt
                break
    return {"step": last.get("step"), "loss": last.get("loss"), "tokens_per_s": tps, "time": last.get("time")}
