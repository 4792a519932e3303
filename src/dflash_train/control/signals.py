"""Signal handling for a graceful stop at a step boundary.

    stop = StopController(on_abandon=mgr.abandon)
    stop.install()                      # main thread; SIGINT + SIGTERM
    try:
        while step < max_steps:
            ... one optimizer step ...
            if stop.stop_requested:     # first signal: finish the step, then
                mgr.save(step, ...); mgr.wait(); break   # checkpoint and exit 0
    except AbortRun as e:               # second signal (on_abandon already called)
        record.release(...); return e.code     # 130
    finally:
        stop.uninstall()

Signal semantics:
  1st SIGINT/SIGTERM: sets `stop_requested`, `signal_name` ("SIGINT"/"SIGTERM")
      and `requested_at`; nothing else runs in the handler (no I/O, no locks).
  2nd: calls `on_abandon()` (e.g. CheckpointManager.abandon: the save in
      flight is discarded, no half-written checkpoint can appear), writes one
      line to stderr with os.write, then raises `AbortRun` in the main thread
      wherever it happens to be. AbortRun subclasses SystemExit(130): if the
      loop does not catch it, the interpreter still exits 130 with no
      traceback (make sure non-daemon threads stop, or they block exit).
  3rd: os._exit(130) immediately (no cleanup at all).
`request_stop(reason)` sets the same flag from code (e.g. train.max_seconds).

Worker threads never receive Python signal handlers (CPython runs them in the
main thread only), so target/post-process threads need nothing. Worker
PROCESSES (e.g. DataLoader workers; a terminal Ctrl-C goes to the whole process
group) should call `ignore_stop_signals()` first thing (worker_init_fn).

`grace_warning(step_seconds, save_seconds, grace_seconds)` returns a warning
when a stop cannot finish within checkpoint.grace_seconds (the time a
scheduler or `dflash-train stop` is expected to wait): finishing the current
step plus a synchronous final checkpoint must fit.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ABORT_EXIT_CODE = 130


class AbortRun(SystemExit):
    """Raised in the main thread on the second stop signal; exit code 130."""

    def __init__(self, signal_name: str = "") -> None:
        super().__init__(ABORT_EXIT_CODE)
        self.signal_name = signal_name

    def __str__(self) -> str:
        return f"run aborted by a second {self.signal_name or 'signal'} (exit {ABORT_EXIT_CODE})"


def _write_stderr(msg: str) -> None:
    try:
        os.write(2, (msg.rstrip("\n") + "\n").encode())
    except OSError:
        pass


class StopController:
    def __init__(self, on_abandon: Callable[[], None] | None = None) -> None:
        self.on_abandon = on_abandon
        self.stop_requested = False
        self.signal_name: str | None = None  # of the first signal, or "request_stop:<reason>"
        self.requested_at: float | None = None  # time.monotonic() of the first request
        self.count = 0  # signals received
        self.abort_requested = False
        self._previous: dict[int, object] = {}

    # ------------------------------------------------------------------ install

    def install(self) -> "StopController":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopController.install must be called from the main thread")
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            try:
                signal.signal(s, prev)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                signal.signal(s, signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "StopController":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ state

    def request_stop(self, reason: str) -> None:
        """Same as a first signal, from code (e.g. a wall-clock budget)."""
        if not self.stop_requested:
            self.stop_requested = True
            self.signal_name = f"request_stop:{reason}"
            self.requested_at = time.monotonic()

    def set_on_abandon(self, cb: Callable[[], None] | None) -> None:
        self.on_abandon = cb

    # ------------------------------------------------------------------ handler

    def _handle(self, signum: int, frame) -> None:  # noqa: ARG002
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self.stop_requested = True
            self.signal_name = name
            self.requested_at = time.monotonic()
            return
        if self.count == 2:
            self.abort_requested = True
            _write_stderr(f"{name} again: abandoning the checkpoint in progress and exiting {ABORT_EXIT_CODE} "
                          "(a third signal exits at once)")
            cb = self.on_abandon
            if cb is not None:
                try:
                    cb()
                except Exception as e:  # noqa: BLE001 - must still abort
                    _write_stderr(f"abandon callback failed: {type(e).__name__}: {e}")
            raise AbortRun(name)
        _write_stderr(f"{name} a third time: exiting {ABORT_EXIT_CODE} now")
        os._exit(ABORT_EXIT_CODE)


def ignore_stop_signals() -> None:
    """For worker processes: ignore SIGINT/SIGTERM so only the trainer decides."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def worker_init_ignore_signals(_worker_id: int = 0) -> None:
    """DataLoader(worker_init_fn=...) form of ignore_stop_signals."""
    ignore_stop_signals()


def grace_warning(step_seconds: float, save_seconds: float, grace_seconds: float) -> str | None:
    """A warning when finishing a step plus a final checkpoint exceeds the grace time.

    step_seconds: wall time of one optimizer step (incl. accumulation);
    save_seconds: snapshot + write of one checkpoint (SaveStats.total_seconds);
    grace_seconds: checkpoint.grace_seconds. Returns None when it fits.
    """
    need = float(step_seconds) + float(save_seconds)
    if need <= grace_seconds:
        return None
    return (
        f"a graceful stop needs about {need:.1f}s (finish a step {step_seconds:.1f}s + final checkpoint "
        f"{save_seconds:.1f}s) but checkpoint.grace_seconds={grace_seconds:g}; a scheduler or "
        f"`dflash-train stop --timeout` that waits only that long may kill the run before the "
        f"checkpoint commits (the previous checkpoint stays valid). Raise checkpoint.grace_seconds "
        f"(and the stop timeout / terminationGracePeriodSeconds) to at least {need * 1.5:.0f}s."
    )
