"""What a training run does when the file system refuses a write (README "Storage faults").

The rule: a run's durable state is its checkpoints plus metrics.jsonl up to the latest one; a
resume starts there and recomputes everything after it, bit for bit. So

* a checkpoint write that fails stops the run at the next step boundary (all ranks agree on
  it) with one line naming the file and the cause, exit 2. The half-written checkpoint's temp
  dir is removed and ``latest`` still names the previous checkpoint: that is what the same
  command resumes from once the cause is cleared. No final checkpoint is attempted;
* a metrics.jsonl line that cannot be written is held in memory (one warning) and written
  first with the next line. A checkpoint is written only once metrics.jsonl holds every line up
  to its step; lines still held then stop the run the same way, because a checkpoint ahead of
  its metrics would leave a hole no resume fills;
* train.log, TensorBoard and the run.json updates are views of that state: a failure warns
  once and the run goes on (stderr still gets every log line; run.json keeps its last complete
  version, and `status` judges liveness by the pid);
* start-up writes (the run dir, config.yaml, run.json) end the start with one line before
  anything is trained; the data cache (data.cache_dir) that cannot be written is a warning,
  the rows stay in memory (data/prepare.py).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from dflash_train.storage import StorageError, cause_of

log = logging.getLogger("dflash_train")


class RunFaults:
    """The storage faults of one training run: the first one that stops it (`fatal`) and the
    views that warned already."""

    def __init__(self) -> None:
        self.fatal: StorageError | None = None
        self._warned: set[str] = set()

    def stop_with(self, e: StorageError) -> None:
        """Stop the run at the next step boundary; the first fault is the one reported."""
        if self.fatal is None:
            self.fatal = e

    def final_error(self, step: int, last_checkpoint: str | None) -> StorageError:
        """The one line the run ends with: the fault, and what the same command resumes from."""
        e = self.fatal
        kept = (f"{last_checkpoint} is intact and is what the same command resumes from once that is fixed"
                if last_checkpoint else "no checkpoint was saved; the same command starts again once that is fixed")
        return StorageError(f"{e}; the run stopped at step {step}, {kept}", e.path, e.errno)

    def view(self, path: Path, write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """`write(*args, **kwargs)` of a view of the run (the file `path`, e.g. run.json): a
        refused write warns once and is otherwise ignored."""
        try:
            write(*args, **kwargs)
        except OSError as e:
            if str(path) not in self._warned:
                self._warned.add(str(path))
                log.warning("cannot write %s (%s); the run goes on without it", path, cause_of(e))
