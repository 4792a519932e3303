"""Files of the run-directory protocol: atomic writes (temp file + fsync + rename +
directory fsync, so readers never see a torn file), the permissions of files created
0600, JSON reading, and THE one place a file's content is hashed (`sha256_file`,
`sha256_tree`). Standard library only."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable


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


def append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` (created if missing) all or nothing: when the write fails part
    way (a disk that fills), the file is cut back to its old length, so a line-per-record file
    never holds a torn line that the next append would run into."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # minus the umask, as open()
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.ftruncate(fd, size)  # giving space back works on a full disk
            raise
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    """Parsed JSON of `path`; None when it does not exist; {"corrupt": reason} when it does not parse."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        return {"corrupt": f"{path}: {e}"}


def sha256_file(path: Path, bufsize: int = 8 << 20) -> str:
    """sha256 hex digest of one file's content."""
    return _hash_into(hashlib.sha256(), path, bufsize).hexdigest()


def sha256_tree(root: Path, files: Iterable[Path]) -> str:
    """sha256 hex digest over `files` (under `root`, in the order given): each file's path
    relative to `root`, a NUL byte, then its content."""
    h = hashlib.sha256()
    root = Path(root)
    for p in files:
        h.update(Path(p).relative_to(root).as_posix().encode() + b"\0")
        _hash_into(h, p)
    return h.hexdigest()


def _hash_into(h, path: Path, bufsize: int = 8 << 20):
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(bufsize)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h
