"""Session artefacts built once for the whole run, also under pytest-xdist (`make test` runs two
workers): a session fixture is per worker there, so an expensive build (a tiny target, the
engine tests' trained export) happens in a directory every worker sees, under a file lock; the
first worker builds it, the others wait and reuse it. Without xdist it is a plain build."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock

BUILT = ".built"  # written last: a directory without it is a build that died half way


def shared_root(tmp_path_factory) -> Path:
    """The base temp directory all workers of this run share (xdist gives each worker a
    subdirectory of it), or the run's own base temp directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(directory)` once per test run for `name`; returns the built directory."""
    directory = shared_root(tmp_path_factory) / "shared" / name
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory) + ".lock"):
        if not (directory / BUILT).is_file():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            (directory / BUILT).write_text("ok\n")
    return directory
