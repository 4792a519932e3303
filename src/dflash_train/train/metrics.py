"""Where metrics go: RUN_DIR/metrics.jsonl (full-precision floats), TensorBoard,
and a rich progress bar on a terminal (plain lines otherwise). A write the file system
refuses is handled by the rule of train/faults.py: metrics.jsonl lines are held until they
can be written (`MetricsLogger.ensure_written` before a checkpoint); train.log and
TensorBoard warn once and the run goes on."""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from dflash_train.rundir import RunDir, append_whole, atomic_write_text
from dflash_train.storage import cause_of, storage_error

log = logging.getLogger("dflash_train")


def setup_logging(run_dir: Path, rank: int = 0, leader: bool = True) -> None:
    """Console + RUN_DIR/logs/train.log for the leading trainer; other ranks
    under torchrun log to RUN_DIR/logs/train.rankN.log only."""
    path = RunDir(run_dir).train_log(rank, leader)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("dflash_train")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    fh = _LogFile(path)
    fh.setFormatter(fmt)
    root.addHandler(fh)
    if leader:
        sh = logging.StreamHandler(sys.stderr)
        sh.setFormatter(fmt)
        root.addHandler(sh)
    root.propagate = False



class _LogFile(logging.FileHandler):
    """train.log: a line the file system refuses (a full disk, a vanished directory) warns once
    on stderr instead of logging's traceback per record; the run goes on (train/faults.py)."""

    _warned = False

    def handleError(self, record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if not isinstance(e, OSError):
            return super().handleError(record)
        if not self._warned:
            self._warned = True
            print(f"warning: cannot write {self.baseFilename} ({cause_of(e)}); the log goes on on stderr only",
                  file=sys.stderr, flush=True)


def log_to_files(level: int, msg: str, exc_info: bool = False) -> None:
    """Write one record to the run's log FILE handlers only (stderr already gets the
    CLI's one line, or Python's traceback)."""
    root = logging.getLogger("dflash_train")
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return
    rec = root.makeRecord(root.name, level, __file__, 0, msg, (), sys.exc_info() if exc_info else None)
    for h in files:
        try:
            h.handle(rec)
        except Exception:  # noqa: BLE001 - logging must not mask the real error
            pass

def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # "nan"/"inf" stay visible without breaking JSON
    return v


def truncate_metrics(path: Path, last_step: int) -> int:
    """On resume: drop lines logged after the checkpoint's step (they will be produced again)."""
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if rec.get("step", 0) <= last_step:
            keep.append(line)
        else:
            dropped += 1

    atomic_write_text(path, "".join(l + "\n" for l in keep))
    return dropped


class MetricsLogger:
    def __init__(self, run_dir: Path, max_steps: int, start_step: int, tensorboard: bool, progress: str,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = RunDir(run_dir).metrics
        self._held: list[str] = []  # lines the file system refused so far, oldest first
        self._refused: OSError | None = None
        self._tb = None
        self._tb_dir = RunDir(run_dir).tensorboard
        self._thread_hook = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional at run time: tensorboard installed

                self._thread_hook = _QuietWriterThread.install()  # its writer thread starts in the constructor
                self._tb = SummaryWriter(str(self._tb_dir), purge_step=start_step + 1)
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional at run time
                self._tb_disabled(e)
        mode = progress
        if mode == "auto":
            mode = "rich" if sys.stderr.isatty() and os.environ.get("TERM") != "dumb" else "plain"
        self.mode = mode if enabled else "none"
        self._progress = None
        self._task = None
        self.max_steps = max_steps
        if self.mode == "rich":
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=max_steps, completed=start_step, info="")
        self._t0 = time.time()

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._held.append(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._write_held()
        step = record["step"]
        if self._tb is not None:
            try:
                self._tensorboard(record, step)
            except Exception as e:  # noqa: BLE001 - a view: metrics.jsonl has the same numbers
                self._tb_disabled(e)
        line = self.summary_line(record)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=line)
        elif self.mode == "plain":
            print(f"step {step}/{self.max_steps} {line}", file=sys.stderr, flush=True)

    def _tb_disabled(self, e: BaseException) -> None:
        """The one warning when TensorBoard cannot go on (a view: metrics.jsonl has the same numbers)."""
        log.warning("TensorBoard disabled: cannot write %s (%s)", self._tb_dir,
                    cause_of(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}")
        self._tb = None

    def _tensorboard(self, record: dict[str, Any], step: int) -> None:
        fault = self._thread_hook.fault if self._thread_hook is not None else None
        if fault is not None:  # its writer thread died (a full disk): say so here, once
            raise fault
        for k, v in record.items():
            if isinstance(v, (int, float)) and k != "step":
                self._tb.add_scalar(k.replace(".", "/"), v, step)
            elif isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
                for i, x in enumerate(v):
                    self._tb.add_scalar(f"{k}/{i + 1}", x, step)
        self._tb.flush()

    def _write_held(self) -> bool:
        """Append the held lines (all or none); False while the file system refuses them."""
        if not self._held:
            return True
        try:
            append_whole(self.path, "".join(self._held).encode())
        except OSError as e:
            if self._refused is None:
                log.warning("cannot write %s (%s): its lines are held in memory and written once that works; "
                            "no checkpoint is written before they are", self.path, cause_of(e))
            self._refused = e
            return False
        if self._refused is not None:
            log.info("%s: wrote the %d line(s) held since the write failed", self.path, len(self._held))
            self._refused = None
        self._held.clear()
        return True

    def ensure_written(self) -> None:
        """Before a checkpoint: every line logged so far is in metrics.jsonl, or StorageError."""
        if not self._write_held():
            raise storage_error(self._refused, self.path)

    @staticmethod
    def summary_line(r: dict[str, Any]) -> str:
        parts = []
        for key, fmt in [("loss", "loss {:.4f}"), ("acc_1", "acc1 {:.3f}"), ("expected_tau", "E[tau] {:.2f}"),
                         ("tau", "tau {:.2f}"),
                         ("tau_ngram", "prompt-lookup tau {:.2f}"), ("tokens_per_s", "{:.0f} tok/s"),
                         ("lr", "lr {:.2e}"), ("queue_occupancy", "q {:.2f}")]:
            if key in r and isinstance(r[key], (int, float)):
                parts.append(fmt.format(r[key]))
        return " | ".join(parts)

    def advance(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception as e:  # noqa: BLE001 - a view (train/faults.py)
                self._tb_disabled(e)
        if self._thread_hook is not None:
            self._thread_hook.uninstall()
        if self.enabled:
            self._write_held()  # lines still held stay for ensure_written


class _QuietWriterThread:
    """TensorBoard writes its event files from a thread of its own: an OSError there (a full disk)
    would print that thread's traceback. This `threading.excepthook` keeps it for the logger to report
    as its one warning; every other thread's exception goes to the previous hook."""

    def __init__(self, previous) -> None:
        self.previous, self.fault = previous, None

    @classmethod
    def install(cls) -> "_QuietWriterThread":
        hook = cls(threading.excepthook)
        threading.excepthook = hook
        return hook

    def uninstall(self) -> None:
        if threading.excepthook is self:
            threading.excepthook = self.previous

    def __call__(self, args) -> None:
        frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback is not None else []
        if isinstance(args.exc_value, OSError) and any("tensorboard" in f.filename for f in frames):
            self.fault = args.exc_value
            return
        self.previous(args)
