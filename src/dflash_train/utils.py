"""Small shared helpers: safetensors with the usual permissions, code version, device choice.
(Atomic writes and the hashing of files live in rundir/, the run-directory protocol.)"""
from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from dflash_train.rundir import apply_default_mode, sha256_tree
from dflash_train.storage import os_error_in

PACKAGE_DIR = Path(__file__).resolve().parent


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file (which creates the file 0600) + the usual permissions. A write
    the file system refuses raises the OSError (safetensors hides it in a SafetensorError), so
    callers handle a full disk like any other (storage.py)."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as e:  # noqa: BLE001 - only the storage failure is translated
        err = os_error_in(e)
        if err is None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from None
    apply_default_mode(Path(path))


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
    return "pkg-" + sha256_tree(PACKAGE_DIR, sorted(PACKAGE_DIR.rglob("*.py")))[:12]


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    return torch.device(choice)
