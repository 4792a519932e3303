"""THE stop-and-confirm of a trainer, used by `dflash-train stop` (control/commands.py)
and by deploy's far-end agent (deploy/agent.py): verify the pid by its start time right
before signalling it, signal, wait, SIGKILL only when forced, then confirm: run.json is
released and the latest checkpoint is at the step the trainer stopped at and verifies.
Each caller words the outcome its own way. Standard library only."""
from __future__ import annotations

import os
import signal as _signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .checkpoints import latest_checkpoint, verify_checkpoint
from .layout import parse_step
from .process import proc_info, same_process
from .record import read_record

KILL_WAIT_S = 30.0  # after a SIGKILL: how long to wait for the pid to go
SIGNALS = {"INT": _signal.SIGINT, "TERM": _signal.SIGTERM}


def parse_signal(name: str) -> _signal.Signals | None:
    """INT / TERM (with or without SIG, any case); None for anything else."""
    return SIGNALS.get(str(name).strip().upper().removeprefix("SIG"))


@dataclass
class StopOutcome:
    """What happened. `refused` / `error`: nothing (more) was done; otherwise the signal was
    sent and `exited` says whether the process ended (`killed`: by SIGKILL, --force)."""

    pid: int | None
    refused: str | None = None       # why the pid was not signalled (reused, gone, no permission)
    exited: bool = False
    already_exited: bool = False     # gone before the signal
    killed: bool = False
    timed_out: bool = False
    waited_s: float = 0.0
    step_before: int | None = None
    step: int | None = None          # run.json's step after the exit
    record_live: bool | None = None  # run.json's live flag after the exit (True: it did not release)
    checkpoint: Path | None = None   # the latest checkpoint after the exit
    problems: list[str] = field(default_factory=list)  # why the stop is not confirmed (empty: confirmed)

    @property
    def checkpoint_step(self) -> int | None:
        return parse_step(self.checkpoint.name) if self.checkpoint is not None else None

    @property
    def confirmed(self) -> bool:
        return self.refused is None and self.exited and not self.problems


def running(pid: int, create_time: Any = None) -> bool:
    """The pid exists, is not a zombie and (when create_time is given) is the process that started then."""
    try:
        info = proc_info(pid)
    except OSError:
        return True  # exists but unreadable
    if info is None or info["zombie"]:
        return False
    return create_time is None or same_process(info, create_time)


def stop_and_confirm(run_dir: Path, pid: int, create_time: Any, sig: _signal.Signals, timeout: float,
                     force: bool = False, poll_s: float = 0.05,
                     on_wait: Callable[[float], None] | None = None, note_every_s: float = 15.0,
                     on_sent: Callable[[], None] | None = None) -> StopOutcome:
    """Signal `pid` (verified against `create_time` right before), wait up to `timeout`
    (SIGKILL after it when `force`), then confirm the stop. `on_sent()` is called once the
    signal is sent, `on_wait(seconds)` every `note_every_s` while waiting."""
    out = StopOutcome(pid, step_before=(read_record(run_dir) or {}).get("step"))
    try:
        info = proc_info(pid)
    except OSError:
        info = None
    if info is None or info["zombie"]:
        out.exited = out.already_exited = True
        out.refused = f"pid {pid} exited just now"
        return out
    if not same_process(info, create_time):
        out.refused = f"pid {pid} was reused by another process"
        return out
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        out.exited = out.already_exited = True
        out.refused = f"pid {pid} exited just now"
        return out
    except PermissionError:
        out.refused = f"no permission to signal pid {pid}"
        return out
    t0 = time.monotonic()
    if on_sent is not None:
        on_sent()
    next_note = t0 + note_every_s
    while running(pid, create_time) and time.monotonic() - t0 < timeout:
        time.sleep(poll_s)
        if on_wait is not None and time.monotonic() >= next_note:
            next_note += note_every_s
            on_wait(time.monotonic() - t0)
    out.waited_s = time.monotonic() - t0
    if running(pid, create_time):
        out.timed_out = True
        out.step = (read_record(run_dir) or {}).get("step")
        if not force:
            return out
        try:
            os.kill(pid, _signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.killed = True
        end = time.monotonic() + KILL_WAIT_S
        while running(pid, create_time) and time.monotonic() < end:  # poll, never reap: it may be someone's child
            time.sleep(poll_s)
    out.exited = not running(pid, create_time)
    return confirm(run_dir, out)


def confirm(run_dir: Path, out: StopOutcome) -> StopOutcome:
    """After the process ended: run.json's final step, its live flag, and the latest
    checkpoint at that step, verified (sha256)."""
    after = read_record(run_dir) or {}
    out.step = after.get("step")
    out.record_live = after.get("live")
    out.checkpoint = latest_checkpoint(run_dir)
    if out.killed:
        out.problems.append(f"pid {out.pid} was killed (SIGKILL): no checkpoint at the stop step")
    if out.record_live:
        out.problems.append("run.json still says live=true after the process ended (it did not exit cleanly)")
    if out.checkpoint is None:
        out.problems.append("no checkpoint after the stop")
    elif not isinstance(out.step, int) or out.checkpoint_step != out.step:
        out.problems.append(f"latest checkpoint is step {out.checkpoint_step} but the run stopped at step {out.step}")
    else:
        out.problems += verify_checkpoint(out.checkpoint)
    return out
