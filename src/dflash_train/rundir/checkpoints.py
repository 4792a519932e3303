"""Checkpoints of a run dir: listing, the ``latest`` / ``best`` links, manifests and
verification, resume selection. A checkpoint directory only ever appears under its
``step-*`` name by an atomic rename of a fully written ``.tmp-step-*`` directory;
`verify_checkpoint` checks it anyway (manifest parses, known format, step matches the
name, every listed file present with the recorded size and sha256). Resume selection
(`find_resumable`) does not trust ``latest``: it takes the highest step that verifies.
Standard library only."""
from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any, Callable

from .files import _replace, sha256_file
from .layout import (CHECKPOINTS_DIR, FORMAT_VERSION, LATEST, MANIFEST_FILE, REQUIRED_FILES, TMP_PREFIX,
                     is_run_dir, parse_step)

Log = Callable[[str], None]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


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
