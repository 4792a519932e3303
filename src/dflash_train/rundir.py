"""The run-directory protocol: the ONE definition of what is on disk in a run dir and
what "live" and "valid" mean. Standard library only (psutil when present), because
`deploy` ships this file's source to the job's host next to its agent
(deploy/agent.py), which runs whatever dflash_train version is installed there:
`status`, `stop`, `deploy` and resume agree by construction.

Layout::

    RUN_DIR/run.json          live record of the trainer (RunRecord below)
    RUN_DIR/.run.lock         flock held by the trainer for its lifetime (RunRecord.acquire)
    RUN_DIR/config.yaml       resolved config
    RUN_DIR/metrics.jsonl     one JSON object per logged step (read_metrics, last_metrics)
    RUN_DIR/checkpoints/step-NNNNNNNN/{model.safetensors, state.pt, manifest.json}
    RUN_DIR/checkpoints/latest, best   relative symlinks, replaced atomically

run.json fields: pid, create_time (the process start time, epoch seconds), hostname,
argv, cwd, run_dir, code_version, config_hash, started_at, live, step,
last_checkpoint, tokens_per_s, updated_at (ISO UTC) and, after release, ended_at.
Every write is atomic (temp file + fsync + rename + directory fsync), so readers
never see a torn record.

Liveness (`liveness`): on the recording host, live means the pid exists, is not a
zombie, and its start time equals the recorded create_time within 1 s; a pid reused
by another process is NOT the trainer. On another host the pid cannot be checked:
`status` (other_host="trust-fresh") counts a record live when it says live=true and
was updated within FOREIGN_STALE_SECONDS; `deploy` (other_host="refuse") never acts
on another host's record.

A checkpoint directory only ever appears under its ``step-*`` name by an atomic
rename of a fully written ``.tmp-step-*`` directory; `verify_checkpoint` checks it
anyway (manifest parses, known format, step matches the name, every listed file
present with the recorded size and sha256). Resume selection (`find_resumable`)
does not trust ``latest``: it takes the highest step that verifies.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import socket
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

try:  # the exact start time the trainer recorded; /proc otherwise (a far end without psutil)
    import psutil
except ImportError:  # pragma: no cover - psutil is a dependency of the package
    psutil = None

RUN_FILE = "run.json"
LOCK_FILE = ".run.lock"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (MODEL_FILE, STATE_FILE)
LATEST = "latest"
BEST = "best"
TMP_PREFIX = ".tmp-"
START_TIME_TOLERANCE_S = 1.0
FOREIGN_STALE_SECONDS = 600.0

_STEP_RE = re.compile(r"^step-(\d+)$")

Log = Callable[[str], None]


class RunDirBusy(RuntimeError):
    """A live trainer holds the run dir; the message names its pid and host."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def parse_iso(s: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(s)).timestamp()
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- atomic writes


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path


def umask() -> int:
    """The process umask (read from /proc where possible: os.umask must set it to read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    m = os.umask(0o022)
    os.umask(m)
    return m


def default_file_mode() -> int:
    """What open() gives a new file: 0666 minus the umask (0644 under umask 022)."""
    return 0o666 & ~umask()


def apply_default_mode(path_or_fd: Path | int) -> None:
    """Give a file created 0600 (tempfile.mkstemp, safetensors' save_file) the
    permissions a plain open() would have, so a serving process of another user
    can read exported weights and checkpoints. The one place this is decided."""
    if isinstance(path_or_fd, int):
        os.fchmod(path_or_fd, default_file_mode())
    else:
        os.chmod(path_or_fd, default_file_mode())


def _discard(tmp: str | Path) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def _replace(tmp: str | Path, dest: Path) -> None:
    """os.replace(tmp, dest) made durable (directory fsync); tmp is removed when it fails."""
    try:
        os.replace(tmp, dest)
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(Path(dest).parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            apply_default_mode(f.fileno())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _discard(tmp)
        raise
    _replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    """Parsed JSON of `path`; None when it does not exist; {"corrupt": reason} when it does not parse."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        return {"corrupt": f"{path}: {e}"}


def sha256_file(path: Path, bufsize: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(bufsize)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


# --------------------------------------------------------------------------- processes


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
    if not isinstance(rec_ct, (int, float)) or abs(info["create_time"] - float(rec_ct)) > START_TIME_TOLERANCE_S:
        started = datetime.fromtimestamp(info["create_time"], timezone.utc).isoformat(timespec="seconds")
        return False, (f"pid {pid} was reused by another process ({_short(info['cmdline'])}, started {started}; "
                       f"the trainer started at create_time {rec_ct})")
    return True, f"pid {pid} verified (start time matches)"


def is_live(record: dict[str, Any] | None) -> bool:
    return liveness(record)[0]


# --------------------------------------------------------------------------- run.json


def is_run_dir(path: Path) -> bool:
    """A directory holding run.json, config.yaml or checkpoints/ (what `dflash-train train`
    creates). `export` never writes over one."""
    p = Path(path)
    return p.is_dir() and ((p / RUN_FILE).is_file() or (p / CONFIG_FILE).is_file() or (p / CHECKPOINTS_DIR).is_dir())


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


# --------------------------------------------------------------------------- metrics.jsonl


def read_metrics(path: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The JSON-object lines of a metrics.jsonl (a run dir's, or the file itself), oldest
    first; lines that do not parse (one being written, the cut first line of a tail) are
    skipped. tail_bytes: read only the file's last bytes (status on a long run)."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    try:
        with open(p, "rb") as f:
            if tail_bytes is not None:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail_bytes))
            chunk = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for line in chunk.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def last_metrics(run_dir: Path, n: int = 2, max_bytes: int = 1 << 20, evals: bool = True) -> list[dict[str, Any]]:
    """The last `n` lines of RUN_DIR/metrics.jsonl (oldest first); evals=False skips eval lines."""
    lines = read_metrics(run_dir, tail_bytes=max_bytes)
    if not evals:
        lines = [m for m in lines if not m.get("eval")]
    return lines[-n:] if n > 0 else []


_TPS_KEYS = ("tokens_per_s", "tok_per_s", "tokens_per_sec", "tok_s")


def metrics_summary(run_dir: Path) -> dict[str, Any]:
    """{step, loss, tokens_per_s, time} from the last logged interval (missing -> None); tok/s
    from ``tokens_per_s`` (or an older key), else from cumulative tokens/time of the last two lines."""
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


def recorded_taus(metrics_path: Path | None) -> dict[int, float]:
    """step -> tau of the eval lines of metrics.jsonl (the last one per step)."""
    out: dict[int, float] = {}
    if metrics_path is None:
        return out
    for rec in read_metrics(metrics_path):
        if rec.get("eval") and isinstance(rec.get("tau"), (int, float)):
            out[int(rec.get("step", 0))] = float(rec["tau"])
    return out


# --------------------------------------------------------------------------- checkpoints


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def parse_step(name: str) -> int | None:
    """Step number of a ``step-NNNNNNNN`` directory name, else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step-*`` directory, ascending step. Not verified."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        s = parse_step(p.name)
        if s is not None and p.is_dir() and not p.is_symlink():
            out.append((s, p))
    return sorted(out)


def is_checkpoint_dir(path: Path) -> bool:
    """A checkpoint, complete or not: a directory with manifest.json, or a
    ``step-NNNNNNNN`` directory holding model.safetensors or state.pt."""
    p = Path(path)
    try:
        if not p.is_dir():
            return False
        if (p / MANIFEST_FILE).exists():
            return True
        return parse_step(p.name) is not None and any((p / f).exists() for f in REQUIRED_FILES)
    except OSError:  # unreadable: not known to be one
        return False


def holds_checkpoints(path: Path) -> bool:
    """A directory checkpoints live in: a run dir's ``checkpoints/``, or any directory
    with a checkpoint directly in it (a set-aside ``checkpoints.*``, a deploy's copies)."""
    p = Path(path)
    if not p.is_dir():
        return False
    if p.name == CHECKPOINTS_DIR and is_run_dir(p.parent):
        return True
    try:
        return any(is_checkpoint_dir(c) for _, c in list_checkpoints(p))
    except OSError:  # an unreadable directory: nothing known to live there
        return False


def read_link(directory: Path, name: str) -> Path | None:
    """Target of the ``latest`` / ``best`` (or releases ``current``) symlink, or None if absent/dangling."""
    link = Path(directory) / name
    try:
        target = os.readlink(link)
    except OSError:
        return None
    p = (link.parent / target) if not os.path.isabs(target) else Path(target)
    return p if p.is_dir() else None


def set_link(directory: Path, name: str, target: str | Path) -> None:
    """Atomically point ``directory/name`` at `target`, an entry of `directory` (a relative
    symlink: temp link + os.replace + directory fsync)."""
    directory = Path(directory)
    tmp = directory / f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}"
    os.symlink(Path(target).name, tmp)
    _replace(tmp, directory / name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """RUN_DIR's newest checkpoint as `latest` names it, else the highest ``step-*``
    directory (not verified; None when there is none)."""
    ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
    found = read_link(ckpt_dir, LATEST)
    if found is None:
        cks = list_checkpoints(ckpt_dir)
        found = cks[-1][1] if cks else None
    return found


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse ``path/manifest.json``; raise CheckpointError naming the file."""
    mf = Path(path) / MANIFEST_FILE
    try:
        data = json.loads(mf.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{mf}: missing (checkpoint incomplete)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mf}: unreadable or not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise CheckpointError(f"{mf}: not a checkpoint manifest (no 'files' table)")
    return data


def verify_checkpoint(path: Path, check_hashes: bool = True) -> list[str]:
    """Problems with the checkpoint at `path` (empty list = valid); each names the file.

    Checks: manifest parses and has a known format_version and an int step
    matching the directory name; model.safetensors and state.pt are listed;
    every listed file exists with the recorded size and (if check_hashes) sha256.
    """
    path = Path(path)
    try:
        man = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems: list[str] = []
    if man.get("format_version") != FORMAT_VERSION:
        problems.append(f"{path / MANIFEST_FILE}: format_version {man.get('format_version')!r}, expected {FORMAT_VERSION}")
    step = man.get("step")
    dir_step = parse_step(path.name)
    if not isinstance(step, int):
        problems.append(f"{path / MANIFEST_FILE}: step {step!r} is not an integer")
    elif dir_step is not None and dir_step != step:
        problems.append(f"{path / MANIFEST_FILE}: step {step} does not match directory name {path.name}")
    files = man["files"]
    for req in REQUIRED_FILES:
        if req not in files:
            problems.append(f"{path / MANIFEST_FILE}: does not list {req}")
    for name, info in files.items():
        fp = path / name
        if not fp.is_file():
            problems.append(f"{fp}: missing")
            continue
        size = fp.stat().st_size
        if size != (info or {}).get("size"):
            problems.append(f"{fp}: size {size} != manifest {(info or {}).get('size')}")
            continue
        if check_hashes and sha256_file(fp) != info.get("sha256"):
            problems.append(f"{fp}: sha256 does not match the manifest (file corrupted)")
    return problems


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_resumable(ckpt_dir: Path, log: Log | None = None, check_hashes: bool = True) -> Path | None:
    """Newest (highest step) checkpoint under `ckpt_dir` that verifies, or None.
    Broken newer ones are skipped with a warning through `log` naming the directory."""
    log = log or _stderr_log
    for _, p in reversed(list_checkpoints(ckpt_dir)):
        problems = verify_checkpoint(p, check_hashes=check_hashes)
        if not problems:
            return p
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        log(f"warning: skipping broken checkpoint {p}: {'; '.join(problems[:3])}{more}; falling back to an older one")
    return None


def resolve_checkpoint_path(path: Path) -> Path:
    """A checkpoint dir as given, or the ``latest`` of a checkpoints/run dir (else its
    newest verified one)."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists() or parse_step(path.name) is not None:
        return path
    for base in (path, path / CHECKPOINTS_DIR):
        target = read_link(base, LATEST)
        if target is not None:
            return target
    base = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    found = find_resumable(base)
    if found is None:
        raise CheckpointError(f"{path}: no checkpoint found (no manifest.json, no latest link, no step-* dirs)")
    return found
