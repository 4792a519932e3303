"""On-disk checkpoint format: naming, manifest, verification, resume selection, loading.

Layout of one committed checkpoint (``CKPT_DIR/step-NNNNNNNN/``)::

    model.safetensors   the tensors handed to CheckpointManager.save (safetensors)
    state.pt            torch.save of the plain `objects` dict (optimizer, scheduler,
                        rng, data order...); loadable with torch.load(weights_only=True)
    manifest.json       written LAST: format_version, step, code_version, config_hash,
                        created_at, tensors {name: {shape, dtype}}, files {name: {size,
                        sha256}}, meta

A directory only ever appears under its ``step-*`` name by an atomic rename of a
fully written and fsynced ``.tmp-step-*`` directory, so a ``step-*`` directory
is complete unless the disk lied or someone edited it; `verify_checkpoint`
checks that anyway (manifest parses, every listed file present with the
recorded size and sha256). ``.tmp-*`` directories are never read and are
removed by the next CheckpointManager on the same directory.

``CKPT_DIR/latest`` and ``CKPT_DIR/best`` are relative symlinks
(``latest -> step-00000100``) replaced atomically (temp symlink + os.replace).
Resume selection (`find_resumable`) does not trust ``latest``: it takes the
highest step that verifies, and warns naming every newer broken one it skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
REQUIRED_FILES = (MODEL_FILE, STATE_FILE)
LATEST = "latest"
BEST = "best"
TMP_PREFIX = ".tmp-"

_STEP_RE = re.compile(r"^step-(\d+)$")

Log = Callable[[str], None]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match its manifest."""


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
    """A directory checkpoints live in: a run dir's ``checkpoints/``, or any
    directory with a checkpoint directly in it (a set-aside ``checkpoints.*``,
    a deploy's preserved copies)."""
    from dflash_train.control.run_record import CHECKPOINTS_DIR, is_run_dir

    p = Path(path)
    if not p.is_dir():
        return False
    if p.name == CHECKPOINTS_DIR and is_run_dir(p.parent):
        return True
    try:
        return any(is_checkpoint_dir(c) for _, c in list_checkpoints(p))
    except OSError:  # an unreadable directory: nothing known to live there
        return False


def read_link(ckpt_dir: Path, name: str) -> Path | None:
    """Target of the ``latest`` / ``best`` symlink (absolute), or None if absent/dangling."""
    link = Path(ckpt_dir) / name
    try:
        target = os.readlink(link)
    except OSError:
        return None
    p = (link.parent / target) if not os.path.isabs(target) else Path(target)
    return p if p.is_dir() else None


def set_link(ckpt_dir: Path, name: str, target: Path) -> None:
    """Atomically point ``ckpt_dir/name`` at ``target`` (a relative symlink)."""
    ckpt_dir = Path(ckpt_dir)
    rel = os.path.relpath(Path(target), ckpt_dir)
    tmp = ckpt_dir / f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}"
    os.symlink(rel, tmp)
    try:
        os.replace(tmp, ckpt_dir / name)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    from dflash_train.utils import fsync_dir

    fsync_dir(ckpt_dir)


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
    """Problems with the checkpoint at `path` (empty list = valid).

    Checks: manifest parses and has a known format_version and an int step
    matching the directory name; model.safetensors and state.pt are listed;
    every listed file exists with the recorded size and (if check_hashes)
    sha256. Each problem string names the file.
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
        if size != info.get("size"):
            problems.append(f"{fp}: size {size} != manifest {info.get('size')}")
            continue
        if check_hashes and sha256_file(fp) != info.get("sha256"):
            problems.append(f"{fp}: sha256 does not match the manifest (file corrupted)")
    return problems


def find_resumable(ckpt_dir: Path, log: Log | None = None, check_hashes: bool = True) -> Path | None:
    """Newest (highest step) checkpoint under `ckpt_dir` that verifies, or None.

    Broken newer ones are skipped with a warning (through `log`) naming the
    directory and the first problems; ``.tmp-*`` directories are ignored.
    """
    log = log or _default_log
    for step, p in reversed(list_checkpoints(ckpt_dir)):
        problems = verify_checkpoint(p, check_hashes=check_hashes)
        if not problems:
            return p
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        log(f"warning: skipping broken checkpoint {p}: {'; '.join(problems[:3])}{more}; falling back to an older one")
    return None


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", weights_only: bool = True, verify: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors, objects, manifest) of the checkpoint at `path`, verified first.

    Raises CheckpointError naming the offending file when verification fails.
    `path` may also be a checkpoints dir containing a ``latest`` link, or a
    run dir containing ``checkpoints/latest``.
    """
    from safetensors.torch import load_file

    path = resolve_checkpoint_path(Path(path))
    if verify:
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} failed verification: " + "; ".join(problems))
    manifest = read_manifest(path)
    device = str(map_location) if isinstance(map_location, torch.device) else map_location
    try:
        tensors = load_file(str(path / MODEL_FILE), device=device)
    except Exception as e:  # noqa: BLE001 - re-raise with the file name
        raise CheckpointError(f"{path / MODEL_FILE}: cannot load: {e}") from e
    try:
        objects = torch.load(path / STATE_FILE, map_location=map_location, weights_only=weights_only)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path / STATE_FILE}: cannot load: {e}") from e
    return tensors, objects, manifest


def resolve_checkpoint_path(path: Path) -> Path:
    """A checkpoint dir as given, or the ``latest`` of a checkpoints/run dir."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists() or parse_step(path.name) is not None:
        return path
    for base in (path, path / "checkpoints"):
        target = read_link(base, LATEST)
        if target is not None:
            return target
    found = find_resumable(path / "checkpoints") if (path / "checkpoints").is_dir() else find_resumable(path)
    if found is None:
        raise CheckpointError(f"{path}: no checkpoint found (no manifest.json, no latest link, no step-* dirs)")
    return found


def _default_log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)
