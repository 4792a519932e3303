"""Test-only knobs, installed by the tests (never by the product). For `dflash-train`
subprocesses the tests put this directory on PYTHONPATH (trainrun.env), so Python's start-up
imports sitecustomize.py, which imports this module; they set

    DFLASH_TEST_STEP_DELAY=S     sleep S seconds after every training step (signals land mid-run)
    DFLASH_TEST_COMMIT_DELAY=S   hold every checkpoint S seconds between "files written" and
                                 "commit" (widens the crash / abandon window; an abandon still
                                 ends the wait at once)
    DFLASH_TEST_BEFORE_CHECKPOINT=STEP:CMD
                                 run the shell command CMD (it must succeed) in the checkpoint
                                 writer just before checkpoint STEP is written: a storage fault
                                 (a full disk, a read-only or removed directory) made real at a
                                 known step
    DFLASH_TEST_WRITE_FAULT=ERRNO:BYTES:GLOB[|GLOB...]
                                 a file system that refuses writes, without mounting one: every
                                 write to a path matching a GLOB (fnmatch on the absolute path;
                                 `!GLOB` excludes) fails with OSError(ERRNO) (ENOSPC, EROFS, EIO,
                                 ...) once BYTES bytes have been written to matching paths (a
                                 write that crosses the limit writes what fits first). ENOSPC and
                                 EDQUOT land on the write; any other errno already on creating a
                                 file or directory there. Covers open()/Path.open/write_text,
                                 os.fdopen, os.open + os.write, os.mkdir and safetensors' save_file.
    DFLASH_TEST_WRITE_FAULT_WHILE=FILE
                                 ... only while FILE exists (the BYTES are counted from then): a
                                 test fills the "disk" at a known step by creating FILE (e.g.
                                 DFLASH_TEST_BEFORE_CHECKPOINT=8:touch FILE) and frees it by
                                 removing it

Without these variables nothing is patched. The patches are applied when the product module
is first imported (a meta-path finder that wraps the module's loader)."""
from __future__ import annotations

import builtins
import errno as _errno
import fnmatch
import importlib.abc
import io
import os
import subprocess
import sys
import threading
import time


def _patch_metrics(module) -> None:
    delay = float(os.environ["DFLASH_TEST_STEP_DELAY"])
    advance = module.MetricsLogger.advance

    def advance_then_wait(self, step: int) -> None:  # called once per step on every rank
        advance(self, step)
        time.sleep(delay)

    module.MetricsLogger.advance = advance_then_wait


def delay_commits(manager, seconds: float) -> None:
    """Make a CheckpointManager (the class, or one instance) wait `seconds` between "files
    written" and "commit", checking for an abandon meanwhile (in-process tests call this too)."""
    commit = manager._commit

    def wait(mgr) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            mgr._check()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    if isinstance(manager, type):
        def wait_then_commit(self, *args, **kwargs):
            wait(self)
            return commit(self, *args, **kwargs)
    else:
        def wait_then_commit(*args, **kwargs):
            wait(manager)
            return commit(*args, **kwargs)

    manager._commit = wait_then_commit


def _patch_manager(module) -> None:
    delay_commits(module.CheckpointManager, float(os.environ["DFLASH_TEST_COMMIT_DELAY"]))


def _patch_before_checkpoint(module) -> None:
    at, command = os.environ["DFLASH_TEST_BEFORE_CHECKPOINT"].split(":", 1)
    write = module.CheckpointManager._write

    def run_then_write(self, tmp, step, *args, **kwargs):
        if step == int(at):
            subprocess.run(command, shell=True, check=True)
        return write(self, tmp, step, *args, **kwargs)

    module.CheckpointManager._write = run_then_write


class WriteFault:
    """DFLASH_TEST_WRITE_FAULT's rule (see the module doc)."""

    def __init__(self, spec: str, while_file: str | None = None) -> None:
        name, budget, globs = spec.split(":", 2)
        self.errno = getattr(_errno, name) if not name.isdigit() else int(name)
        self.budget = int(budget)
        self.include = [g for g in globs.split("|") if g and not g.startswith("!")]
        self.exclude = [g[1:] for g in globs.split("|") if g.startswith("!")]
        self.while_file = while_file
        self.on_write_only = self.errno in (_errno.ENOSPC, _errno.EDQUOT)
        self.written = 0
        self.lock = threading.Lock()
        self.was_active = while_file is None

    def matches(self, path) -> bool:
        if isinstance(path, int):
            try:
                path = os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return False
        try:
            p = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return False
        return any(fnmatch.fnmatchcase(p, g) for g in self.include) and \
            not any(fnmatch.fnmatchcase(p, g) for g in self.exclude)

    def active(self) -> bool:
        if self.while_file is None:
            return True
        on = os.path.exists(self.while_file)
        if on and not self.was_active:
            self.written = 0  # the bytes are counted from the moment the disk fills
        self.was_active = on
        return on

    def error(self, path) -> OSError:
        return OSError(self.errno, os.strerror(self.errno), os.fsdecode(path) if not isinstance(path, int) else None)

    def on_create(self, path) -> None:
        """Creating a file (for writing) or a directory at `path`."""
        if not self.on_write_only and self.matches(path) and self.active():
            raise self.error(path)

    def take(self, path, n: int) -> int:
        """How many of `n` bytes a write to the matching `path` may write; raises when none."""
        with self.lock:
            if not self.active():
                return n
            room = max(0, self.budget - self.written)
            if room == 0 or not self.on_write_only:
                raise self.error(path)
            k = min(n, room)
            self.written += k
            return k


class _FaultyFile:
    """A file opened for writing on the faulty "disk": writes beyond the budget fail."""

    def __init__(self, f, path, fault: WriteFault) -> None:
        self._f, self._path, self._fault = f, path, fault

    def write(self, data):
        n = len(data.encode() if isinstance(data, str) else memoryview(data).cast("B"))
        k = self._fault.take(self._path, n)
        if k < n:
            if isinstance(data, str):
                part = data.encode()[:k].decode(errors="ignore")
                self._f.write(part)
            else:
                self._f.write(bytes(memoryview(data).cast("B")[:k]))
            try:
                self._f.flush()
            except OSError:
                pass
            raise self._fault.error(self._path)
        return self._f.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _install_write_fault(fault: WriteFault) -> None:
    real_open, real_fdopen, real_os_open = builtins.open, os.fdopen, os.open
    real_write, real_mkdir = os.write, os.mkdir

    def writes(mode: str) -> bool:
        return any(c in mode for c in "wax+")

    def faulty_open(file, mode="r", *args, **kwargs):
        if isinstance(file, int) or not writes(mode) or not fault.matches(file):
            return real_open(file, mode, *args, **kwargs)
        fault.on_create(file)
        return _FaultyFile(real_open(file, mode, *args, **kwargs), file, fault)

    def faulty_fdopen(fd, mode="r", *args, **kwargs):
        f = real_fdopen(fd, mode, *args, **kwargs)
        if writes(mode) and fault.matches(fd):
            return _FaultyFile(f, os.readlink(f"/proc/self/fd/{fd}"), fault)
        return f

    def faulty_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and fault.matches(path):
            fault.on_create(path)
        return real_os_open(path, flags, *args, **kwargs)

    def faulty_write(fd, data):
        if fault.matches(fd):
            n = len(memoryview(data).cast("B"))
            k = fault.take(fd, n)
            if k < n:
                if k:
                    real_write(fd, bytes(memoryview(data).cast("B")[:k]))
                raise fault.error(os.readlink(f"/proc/self/fd/{fd}"))
        return real_write(fd, data)

    def faulty_mkdir(path, *args, **kwargs):
        fault.on_create(path)
        return real_mkdir(path, *args, **kwargs)

    builtins.open = io.open = faulty_open
    os.fdopen, os.open, os.write, os.mkdir = faulty_fdopen, faulty_os_open, faulty_write, faulty_mkdir

    def patch_safetensors(module) -> None:
        save_file = module.save_file

        def faulty_save_file(tensors, filename, *args, **kwargs):
            if fault.matches(filename):
                fault.on_create(filename)
                n = sum(t.numel() * t.element_size() for t in tensors.values()) + 1024
                with real_open(filename, "wb") as f:  # what fits of the file, then the refusal
                    k = fault.take(filename, n)
                    f.write(b"\0" * min(k, 1 << 16))
                if k < n:
                    raise fault.error(filename)
            return save_file(tensors, filename, *args, **kwargs)

        module.save_file = faulty_save_file

    _PATCHES.setdefault("safetensors.torch", []).append(patch_safetensors)


_PATCHES: dict = {}  # module name -> the patches applied when it is imported, in order
if os.environ.get("DFLASH_TEST_STEP_DELAY"):
    _PATCHES.setdefault("dflash_train.train.metrics", []).append(_patch_metrics)
if os.environ.get("DFLASH_TEST_COMMIT_DELAY"):
    _PATCHES.setdefault("dflash_train.checkpoint.manager", []).append(_patch_manager)
if os.environ.get("DFLASH_TEST_BEFORE_CHECKPOINT"):
    _PATCHES.setdefault("dflash_train.checkpoint.manager", []).append(_patch_before_checkpoint)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patches = _PATCHES.get(name)
        if not patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if os.environ.get("DFLASH_TEST_WRITE_FAULT"):
    _install_write_fault(WriteFault(os.environ["DFLASH_TEST_WRITE_FAULT"],
                                    os.environ.get("DFLASH_TEST_WRITE_FAULT_WHILE")))


def install() -> None:
    """Called by sitecustomize at interpreter start-up."""
    if _PATCHES and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
