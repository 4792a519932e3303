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

Without these variables nothing is patched. The patches are applied when the product module
is first imported (a meta-path finder that wraps the module's loader)."""
from __future__ import annotations

import importlib.abc
import os
import subprocess
import sys
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


def install() -> None:
    """Called by sitecustomize at interpreter start-up."""
    if _PATCHES and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
