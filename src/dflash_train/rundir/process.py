"""Processes of the run-directory protocol: a pid's start time and state (psutil when
present, /proc otherwise), and THE definition of "live" for a run.json record
(`liveness`): on the recording host the pid exists, is not a zombie, and its start time
equals the recorded create_time within START_TIME_TOLERANCE_S; a pid reused by another
process is NOT the trainer. On another host the pid cannot be checked: `status`
(other_host="trust-fresh") counts a record live when it says live=true and was updated
within FOREIGN_STALE_SECONDS; `deploy` (other_host="refuse") never acts on it.
Standard library only (psutil when present)."""
from __future__ import annotations

import os
import socket
import time
from datetime import datetime, timezone
from typing import Any

try:  # the exact start time the trainer recorded; /proc otherwise (a far end without psutil)
    import psutil
except ImportError:  # pragma: no cover - psutil is a dependency of the package
    psutil = None

from .files import parse_iso

START_TIME_TOLERANCE_S = 1.0
FOREIGN_STALE_SECONDS = 600.0


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime"):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def proc_info(pid: int) -> dict[str, Any] | None:
    """{create_time, zombie, cmdline} of a pid, or None if it does not exist.
    Raises PermissionError when neither psutil nor /proc can read it."""
    if psutil is not None:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                info = {"create_time": p.create_time(), "zombie": p.status() == psutil.STATUS_ZOMBIE}
            try:
                info["cmdline"] = " ".join(p.cmdline()) or p.name()
            except (psutil.Error, OSError):
                info["cmdline"] = "?"
            return info
        except psutil.NoSuchProcess:
            return None
        except (psutil.AccessDenied, ValueError):
            pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    state, start_ticks = rest[0], int(rest[19])
    return {"create_time": _boot_time() + start_ticks / os.sysconf("SC_CLK_TCK"), "zombie": state in ("Z", "X"),
            "cmdline": stat[stat.index("(") + 1: stat.rindex(")")]}


def pid_alive(pid: int) -> bool:
    try:
        info = proc_info(pid)
    except OSError:
        return True  # exists but unreadable
    return info is not None and not info["zombie"]


def same_process(info: dict[str, Any] | None, create_time: Any) -> bool:
    """`info` (proc_info) is the process that started at `create_time` (within the tolerance)."""
    return (info is not None and isinstance(create_time, (int, float)) and not isinstance(create_time, bool)
            and abs(info["create_time"] - float(create_time)) <= START_TIME_TOLERANCE_S)


def _short(cmd: str) -> str:
    return cmd if len(cmd) <= 80 else cmd[:77] + "..."


def liveness(record: dict[str, Any] | None, other_host: str = "trust-fresh") -> tuple[bool, str]:
    """(live, reason); reasons are sentences `status`, `stop`, `train` and `deploy` print.
    other_host: "trust-fresh" (a record from another host is live when it says so and is
    fresh) or "refuse" (deploy: never act on another host's record)."""
    if not record:
        return False, "no run.json"
    if "corrupt" in record:
        return False, f"run.json is corrupt ({record['corrupt']})"
    here = socket.gethostname()
    host = record.get("hostname")
    if host and host != here:
        if other_host == "refuse":
            return False, (f"run.json was written on host {host!r} but this is {here!r}: "
                           "reach the job's own host with --via")
        upd = parse_iso(record.get("updated_at"))
        if record.get("live") and upd is not None and time.time() - upd < FOREIGN_STALE_SECONDS:
            return True, f"recorded on host {host} (this is {here}); pid not checkable here, record updated {time.time() - upd:.0f}s ago"
        return False, f"recorded on host {host} (this is {here}); record says live={record.get('live')}, last update {record.get('updated_at')}"
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False, "run.json has no valid pid"
    try:
        info = proc_info(pid)
    except OSError:
        return False, f"pid {pid}: access denied (cannot verify)"
    if info is None:
        return False, f"pid {pid} has exited"
    if info["zombie"]:
        return False, f"pid {pid} has exited (zombie, not yet reaped)"
    rec_ct = record.get("create_time")
    if not same_process(info, rec_ct):
        started = datetime.fromtimestamp(info["create_time"], timezone.utc).isoformat(timespec="seconds")
        return False, (f"pid {pid} was reused by another process ({_short(info['cmdline'])}, started {started}; "
                       f"the trainer started at create_time {rec_ct})")
    return True, f"pid {pid} verified (start time matches)"


def is_live(record: dict[str, Any] | None) -> bool:
    return liveness(record)[0]
