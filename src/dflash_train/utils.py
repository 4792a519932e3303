"""Small shared helpers: atomic file writes, code version, device choice."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

PACKAGE_DIR = Path(__file__).resolve().parent


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


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file (which creates the file 0600) + the usual permissions."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    apply_default_mode(Path(path))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, rename over `path`.
    The file gets umask-respecting permissions (mkstemp alone would leave 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            apply_default_mode(f.fileno())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def code_version() -> str:
    """git commit of the checkout the package runs from, else a hash of its sources."""
    try:
        out = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=5,
        )
        if out.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(PACKAGE_DIR), "status", "--porcelain", "--", str(PACKAGE_DIR)],
                capture_output=True, text=True, timeout=5,
            ).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    h = hashlib.sha256()
    for p in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(p.relative_to(PACKAGE_DIR).as_posix().encode())
        h.update(p.read_bytes())
    return "pkg-" + h.hexdigest()[:12]


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    return torch.device(choice)
