"""CheckpointManager: atomic, manifest-verified, optionally asynchronous checkpoints.

Usage from the train loop::

    mgr = CheckpointManager(RunDir(run_dir).checkpoints, keep_last=cfg.checkpoint.keep_last,
                            async_save=cfg.checkpoint.async_save, log=log)
    ...
    mgr.save(step, drafter.state_dict(),
             {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
              "rng": capture_rng_state({"anchors": g}), "data_order": order_state},
             {"config_hash": cfg.hash(), "code_version": code_version(), "tokens_seen": n})
    ...
    mgr.wait()        # before exiting: the last save is committed (or raises CheckpointError)
    # on a second signal instead: mgr.abandon()

`save` returns once the tensors and objects are snapshotted to host memory
(tensors cloned to CPU, `objects` copied recursively with their tensors cloned
to CPU), so training may mutate the live model right after. The write runs in a
daemon background thread (or inline when async_save=False); only one write is
in flight: `save` first waits for the previous one. A write that failed is
re-raised as CheckpointError by the next `save`, `wait` or `raise_failure` (the one that
does not wait: a training loop calls it every step); a write the file system refused
(full, read-only, vanished) as CheckpointWriteError, also a UserError whose one line names
the file and the cause. Either way the temp dir is removed and ``latest`` is unchanged.

`objects` must be "plain" (checkpoint/snapshot.py): anything else raises TypeError
at `save` time naming the key path, because state.pt is loaded with
torch.load(weights_only=True).
Optimizer/scheduler ``state_dict()``s and `capture_rng_state()` are plain.

Commit protocol: write into ``.tmp-step-NNNNNNNN-<rand>/`` -> fsync each file ->
manifest.json last -> fsync dir -> `_commit`: rename to ``step-NNNNNNNN/`` ->
fsync parent -> ``latest`` symlink replaced atomically; then retention. A crash at any point leaves either the old state or
the new complete checkpoint visible; leftovers are ``.tmp-*`` (ignored, removed
when the next CheckpointManager is created on the directory).

Retention (after each commit): keep the newest `keep_last` complete
checkpoints with step <= the one just saved, plus the one ``best`` points at
(if its step is <= the one just saved), plus the one just committed. Only
complete checkpoints past `keep_last` are deleted (renamed to ``.tmp-delete-*``
first, so a half-deleted directory is never visible): that is what the config
asked for. Nothing else is ever deleted: a checkpoint with a HIGHER step than
the one just saved (an abandoned timeline: the run was resumed from an older
checkpoint), one that does not verify, and an older copy of a step that is
saved again are moved to ``<ckpt_dir>.set-aside-<UTC time>/`` (checkpoint/aside.py;
one per manager, created on first use), so they can no longer win the next
`find_resumable`, and the move is logged; a ``best`` link left dangling by a
move is re-pointed at the remaining checkpoint with the highest tau recorded in
``<ckpt_dir>/../metrics.jsonl``, or removed (aside.repair_links). The only valid
checkpoint is never removed because the just-committed one is always kept.

`on_commit(step, path)` (optional) is called after each commit + retention,
from the writer thread when async (e.g. ``lambda s, p:
record.update(last_checkpoint=str(p))``; RunRecord.update is thread-safe).

Timing: every save logs ``snapshot X s`` (blocking the caller) and ``write Y s``
(background); the last figures are in `last_stats` (SaveStats) for
`control.signals.grace_warning`.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_train.checkpoint.aside import aside_path, move_into, repair_links
from dflash_train.checkpoint.snapshot import snapshot_obj, snapshot_tensors
from dflash_train.rundir import (
    BEST,
    FORMAT_VERSION,
    LATEST,
    MANIFEST_FILE,
    METRICS_FILE,
    MODEL_FILE,
    STATE_FILE,
    TMP_PREFIX,
    CheckpointError,
    fsync_dir,
    fsync_path,
    list_checkpoints,
    now_iso,
    parse_step,
    read_link,
    set_link,
    sha256_file,
    step_dir_name,
    verify_checkpoint,
)
from dflash_train.storage import StorageError, writing
from dflash_train.utils import code_version, save_safetensors

Log = Callable[[str], None]


@dataclass
class SaveStats:
    step: int
    snapshot_seconds: float  # blocking part (in the caller's thread)
    write_seconds: float  # background part: files, hashes, fsync, rename, retention
    nbytes: int  # bytes written (model.safetensors + state.pt + manifest)
    path: Path

    @property
    def total_seconds(self) -> float:
        return self.snapshot_seconds + self.write_seconds


class _Abandoned(Exception):
    pass


class CheckpointWriteError(StorageError, CheckpointError):
    """The file system refused a checkpoint write (full, read-only, vanished): a CheckpointError
    for the code that waits on saves, and a UserError (one line, exit 2) for the CLI."""


def _stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class CheckpointManager:
    """Writes checkpoints under `ckpt_dir` (see the module docstring).

    Attributes: `last_committed_step` (int | None; initialised from an existing
    ``latest`` link), `last_committed_path`, `last_stats` (SaveStats | None),
    `last_requested_step` (last step given to save(), committed or still in
    flight: a final save can be skipped when it equals the current step).
    """

    def __init__(
        self,
        ckpt_dir: Path,
        keep_last: int,
        async_save: bool = True,
        log: Log | None = None,
        code_version: str | None = None,
        clean_tmp: bool = True,
        on_commit: Callable[[int, Path], None] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.ckpt_dir = Path(ckpt_dir)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = int(keep_last)
        self.async_save = bool(async_save)
        self.log: Log = log or _stderr_log
        self._code_version = code_version
        self.on_commit = on_commit
        self._thread: threading.Thread | None = None
        self._pending_step: int | None = None
        self._error: BaseException | None = None
        self._abandon = threading.Event()
        self._aside_dir: Path | None = None  # <ckpt_dir>.set-aside-<time>/, created on first use
        self._commit_lock = threading.RLock()  # re-entrant: abandon() may run in a signal handler on the thread holding it (sync mode)
        self.last_stats: SaveStats | None = None
        self.last_requested_step: int | None = None  # last step passed to save() (committed or in flight)
        latest = read_link(self.ckpt_dir, LATEST)
        self.last_committed_path: Path | None = latest
        self.last_committed_step: int | None = parse_step(latest.name) if latest else None
        if clean_tmp:
            self.clean_tmp()

    # ------------------------------------------------------------------ public

    def clean_tmp(self) -> list[Path]:
        """Remove ``.tmp-*`` leftovers of crashed/abandoned saves. Call only when
        no other process writes this directory (run.json guarantees that)."""
        removed = []
        for p in self.ckpt_dir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    try:
                        p.unlink()
                    except FileNotFoundError:
                        pass
                removed.append(p)
        if removed:
            self.log(f"checkpoint: removed {len(removed)} leftover temp entr{'y' if len(removed) == 1 else 'ies'}: "
                     + ", ".join(p.name for p in removed))
        return removed

    @property
    def busy(self) -> bool:
        """True while a background write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        objects: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Snapshot now, write + commit ``step-NNNNNNNN`` (in the background if async_save)."""
        if self._abandon.is_set():
            raise CheckpointError("checkpoint manager was abandoned; no further saves")
        self.wait()
        t0 = time.perf_counter()
        snap_t = snapshot_tensors(tensors)
        snap_o = snapshot_obj(dict(objects or {}), "objects")
        meta = json.loads(json.dumps(meta or {}))  # deep copy + proves it is JSON-serialisable
        if any(t.is_cuda for t in tensors.values()) and torch.cuda.is_available():
            torch.cuda.synchronize()
        snapshot_s = time.perf_counter() - t0
        args = (int(step), snap_t, snap_o, meta, snapshot_s)
        self.last_requested_step = int(step)
        if self.async_save:
            self._pending_step = int(step)
            self._thread = threading.Thread(target=self._write_guarded, args=args, name="checkpoint-writer", daemon=True)
            self._thread.start()
        else:
            self._write_guarded(*args)
            self._raise_error()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the in-flight write finishes; re-raise its failure as
        CheckpointError. Returns False only if `timeout` expired first."""
        t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                return False
            self._thread = None
            self._pending_step = None
        self._raise_error()
        return True

    def raise_failure(self) -> None:
        """Re-raise (once) the failure of a write that has finished, without waiting for one in flight."""
        t = self._thread
        if t is None or not t.is_alive():
            self._raise_error()

    def abandon(self, timeout: float = 5.0) -> None:
        """Stop the save in progress without committing it (second signal).

        After this returns no new ``step-*`` directory or ``latest`` change
        will appear from this manager: a commit already under way finishes
        (it is complete), anything else is discarded at the writer's next
        check (between files) and its ``.tmp-*`` directory removed; if the
        writer is still inside a file write after `timeout` seconds the
        ``.tmp-*`` directory is left for the next start to clean.
        """
        self._abandon.set()
        got = self._commit_lock.acquire(timeout=max(timeout, 0.1))
        if got:
            self._commit_lock.release()
        t = self._thread
        if t is not None and t.is_alive():
            t.join(timeout)
            state = "still writing (its .tmp dir is ignored and cleaned on next start)" if t.is_alive() else "discarded"
            self.log(f"checkpoint: abandoned the save of step {self._pending_step}: {state}")

    def mark_best(self, step: int) -> Path:
        """Point ``best`` at ``step-NNNNNNNN`` (waits if that save is in flight)."""
        if self._pending_step == step:
            self.wait()
        target = self.ckpt_dir / step_dir_name(step)
        if not (target / MANIFEST_FILE).is_file():
            raise CheckpointError(f"cannot mark step {step} best: {target} is not a committed checkpoint")
        set_link(self.ckpt_dir, BEST, target)
        return target

    def close(self) -> None:
        self.wait()

    # ------------------------------------------------------------------ internals

    def _raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"checkpoint save failed: {type(err).__name__}: {err}") from err

    def _check(self) -> None:
        if self._abandon.is_set():
            raise _Abandoned()

    def _write_guarded(self, step: int, tensors, objects, meta, snapshot_s: float) -> None:
        tmp = self.ckpt_dir / f"{TMP_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
        try:
            self._write(tmp, step, tensors, objects, meta, snapshot_s)
        except _Abandoned:
            shutil.rmtree(tmp, ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - reported by wait()/save()
            shutil.rmtree(tmp, ignore_errors=True)
            self._error = e
            what = str(e) if isinstance(e, CheckpointWriteError) else f"{type(e).__name__}: {e}"
            self.log(f"error: checkpoint step {step} failed: {what}")

    def _write(self, tmp: Path, step: int, tensors, objects, meta, snapshot_s: float) -> None:
        t0 = time.perf_counter()
        # a refused write names the file by its final name (the temp dir is removed on failure)
        final = self.ckpt_dir / step_dir_name(step)
        with writing(final, "creating", CheckpointWriteError):
            tmp.mkdir()
        self._check()
        model_path = tmp / MODEL_FILE
        with writing(final / MODEL_FILE, error=CheckpointWriteError):
            save_safetensors(tensors, model_path, metadata={"format": "pt", "step": str(step)})
            fsync_path(model_path)
        self._check()
        state_path = tmp / STATE_FILE
        with writing(final / STATE_FILE, error=CheckpointWriteError):
            with open(state_path, "wb") as f:
                torch.save(objects, f)
                f.flush()
                os.fsync(f.fileno())
        self._check()
        files = {}
        for p in (model_path, state_path):
            with writing(final / p.name, "reading back", CheckpointWriteError):
                files[p.name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
            self._check()
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "code_version": meta.get("code_version") or self._get_code_version(),
            "config_hash": meta.get("config_hash"),
            "created_at": now_iso(),
            "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for k, t in tensors.items()},
            "files": files,
            "meta": meta,
        }
        with writing(final / MANIFEST_FILE, error=CheckpointWriteError):
            with open(tmp / MANIFEST_FILE, "w") as f:
                f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
        with writing(final, "committing", CheckpointWriteError):
            final, replaced = self._commit(tmp, step)
        if replaced is not None:
            self.log(f"checkpoint: moved the earlier {final.name} aside to {replaced} (step saved again)")
        self._retention(step, final)
        write_s = time.perf_counter() - t0
        nbytes = sum(f["size"] for f in files.values()) + (final / MANIFEST_FILE).stat().st_size
        self.last_stats = SaveStats(step, snapshot_s, write_s, nbytes, final)
        self.log(
            f"checkpoint step {step}: snapshot {snapshot_s:.3f}s, write {write_s:.3f}s "
            f"({nbytes / 1e6:.1f} MB{', async' if self.async_save else ''}) -> {final}"
        )
        if self.on_commit is not None:
            try:
                self.on_commit(step, final)
            except Exception as e:  # noqa: BLE001 - the checkpoint itself is committed
                self.log(f"warning: checkpoint on_commit callback failed: {type(e).__name__}: {e}")

    def _commit(self, tmp: Path, step: int) -> tuple[Path, Path | None]:
        """Make the fully written `tmp` the checkpoint of `step` (the one atomic rename) and
        point ``latest`` at it. Returns (its path, where an earlier copy of the same step was
        set aside, or None)."""
        final = self.ckpt_dir / step_dir_name(step)
        with self._commit_lock:
            self._check()
            replaced = None
            if final.exists():  # same step saved again (e.g. after a resume): the old copy is set aside
                replaced = self._set_aside(final)
            os.rename(tmp, final)
            fsync_dir(self.ckpt_dir)
            set_link(self.ckpt_dir, LATEST, final)
            self.last_committed_step = step
            self.last_committed_path = final
        return final, replaced

    def _get_code_version(self) -> str:
        if self._code_version is None:
            self._code_version = code_version()
        return self._code_version

    def _set_aside(self, p: Path) -> Path:
        """Move checkpoint dir `p` into this manager's set-aside dir (never deleted)."""
        if self._aside_dir is None:
            self._aside_dir = aside_path(self.ckpt_dir, "set-aside")
        dest = move_into(p, self._aside_dir)
        fsync_dir(self.ckpt_dir)
        return dest

    def _retention(self, new_step: int, new_path: Path) -> None:
        entries = list_checkpoints(self.ckpt_dir)
        protected = {new_path.resolve()}
        best = read_link(self.ckpt_dir, BEST)
        # a best that does not verify is no use as best: it is set aside like any broken one
        if best is not None and (parse_step(best.name) or 0) <= new_step and not verify_checkpoint(best, check_hashes=False):
            protected.add(best.resolve())
        complete_older = [p for s, p in reversed(entries) if s <= new_step and not verify_checkpoint(p, check_hashes=False)]
        keep = protected | {p.resolve() for p in complete_older[: self.keep_last]}
        moved = False
        for s, p in entries:
            if p.resolve() in keep:
                continue
            if s > new_step or p not in complete_older:
                why = (f"newer than step {new_step} just saved: abandoned timeline after a resume" if s > new_step
                       else "does not verify")
                try:
                    dest = self._set_aside(p)
                except OSError as e:
                    self.log(f"warning: checkpoint retention could not move {p} aside: {e}")
                    continue
                self.log(f"checkpoint: moved {p.name} aside to {dest} ({why}; nothing deleted)")
                moved = True
                continue
            why = f"keep_last={self.keep_last}"
            gone = self.ckpt_dir / f"{TMP_PREFIX}delete-{p.name}-{secrets.token_hex(4)}"
            try:
                os.rename(p, gone)
            except OSError as e:
                self.log(f"warning: checkpoint retention could not remove {p}: {e}")
                continue
            shutil.rmtree(gone, ignore_errors=True)
            self.log(f"checkpoint: removed {p.name} ({why})")
        if moved:  # `best` may have pointed at one of them: re-point it by recorded tau, or remove it
            try:
                repair_links(self.ckpt_dir, self.log, self.ckpt_dir.parent / METRICS_FILE)
            except OSError as e:
                self.log(f"warning: checkpoint retention could not repair the best/latest links: {e}")
