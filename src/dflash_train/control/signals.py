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

Every delivery counts, also while the main thread sits in one long C call
(a tokenizer's batch encode, a safetensors load): CPython runs a Python
handler only between bytecodes, once per signal NUMBER that arrived, so two
SIGINTs during one call used to reach the handler as one and the second was
lost. `install` therefore points `signal.set_wakeup_fd` at a pipe (the C-level
handler writes one byte per delivery) and a daemon "signal-watcher" thread
counts those bytes as they come: the 1st sets the flags; the 2nd writes the
line and sends the signal again to the main thread (`pthread_kill`, which
also interrupts a blocking wait there), whose handler calls `on_abandon()`
and raises `AbortRun` as soon as it runs Python again (a C call keeps it
until the call returns); the 3rd exits at once from the watcher, even while
the main thread is still in C or in `on_abandon()`. Where the wakeup fd is taken (an
asyncio loop installed one) the handler counts its own calls as before.

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


_FORK_HOOK = False


def _forget_wakeup_fd_in_child() -> None:
    # a forked child (e.g. a DataLoader worker before it ignores the signals) must not write
    # its deliveries into the parent's pipe: the parent's watcher would count them as its own
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass


class StopController:
    def __init__(self, on_abandon: Callable[[], None] | None = None) -> None:
        self.on_abandon = on_abandon
        self.stop_requested = False
        self.signal_name: str | None = None  # of the first signal, or "request_stop:<reason>"
        self.requested_at: float | None = None  # time.monotonic() of the first request
        self.count = 0  # signals received (deliveries)
        self.abort_requested = False
        self._previous: dict[int, object] = {}
        self._lock = threading.Lock()
        self._wakeup: tuple[int, int] | None = None  # (read fd, write fd) of the wakeup pipe
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None
        self._injected: dict[int, int] = {}  # bytes of the re-sends to the main thread, not deliveries
        self._abort_name: str | None = None  # set by the watcher: the main thread must raise AbortRun
        self._abort_raised = False

    # ------------------------------------------------------------------ install

    def install(self) -> "StopController":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopController.install must be called from the main thread")
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        self._start_watcher()
        return self

    def uninstall(self) -> None:
        self._stop_watcher()
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

    def _start_watcher(self) -> None:
        """Count deliveries from the wakeup fd (see the module docstring)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = None
        if old is None or old != -1:  # not possible, or someone else's (asyncio): leave theirs in place
            if old not in (None, -1):
                signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        global _FORK_HOOK
        if not _FORK_HOOK:
            os.register_at_fork(after_in_child=_forget_wakeup_fd_in_child)
            _FORK_HOOK = True
        self._wakeup = (r, w)
        self._previous_wakeup = old
        self._watcher = threading.Thread(target=self._watch, args=(r,), name="signal-watcher", daemon=True)
        self._watcher.start()

    def _stop_watcher(self) -> None:
        if self._wakeup is None:
            return
        r, w = self._wakeup
        self._wakeup = None
        try:
            signal.set_wakeup_fd(self._previous_wakeup)
        except (ValueError, OSError):  # not the main thread: leave it; writes to a closed fd are ignored
            pass
        os.close(w)  # the watcher reads EOF and ends
        if self._watcher is not None:
            self._watcher.join(2.0)
            self._watcher = None
        os.close(r)

    def _watch(self, r: int) -> None:
        stop_nums = {int(s) for s in STOP_SIGNALS}
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            for b in data:
                if b not in stop_nums:
                    continue
                with self._lock:
                    if self._injected.get(b):
                        self._injected[b] -= 1
                        continue
                self._delivered(b, in_main=False)

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
        if self._wakeup is None:  # no watcher: each call of this handler is one delivery
            self._delivered(signum, in_main=True)
            return
        # the watcher counts deliveries; here (the main thread) the abort it decided is carried out
        name = self._abort_name
        if name is not None and not self._abort_raised:
            self._abort_raised = True
            self._abandon_and_raise(name)

    def _abandon_and_raise(self, name: str) -> None:
        cb = self.on_abandon
        if cb is not None:
            try:
                cb()
            except Exception as e:  # noqa: BLE001 - must still abort
                _write_stderr(f"abandon callback failed: {type(e).__name__}: {e}")
        raise AbortRun(name)

    def _send_abort_to_main(self, signum: int) -> None:
        """Signal the main thread until its handler has taken the abort. One send can be lost:
        when it lands after the handler ran for the real delivery (too early to see the abort)
        but before the main thread's blocking wait (a thread join) resumes, that wait does not
        wake (seen: a second SIGTERM during a checkpoint write that then committed). The
        watcher keeps reading meanwhile, so a third signal still exits at once."""
        while not self._abort_raised:
            with self._lock:
                self._injected[signum] = self._injected.get(signum, 0) + 1
            try:
                signal.pthread_kill(threading.main_thread().ident, signum)
            except (OSError, ValueError, TypeError):  # no main thread left to clean up
                os._exit(ABORT_EXIT_CODE)
            time.sleep(0.2)

    def _delivered(self, signum: int, in_main: bool) -> None:
        with self._lock:
            self.count += 1
            n = self.count
        name = signal.Signals(signum).name
        if n == 1:
            self.stop_requested = True
            self.signal_name = name
            self.requested_at = time.monotonic()
            return
        if n == 2:
            self.abort_requested = True
            _write_stderr(f"{name} again: abandoning the checkpoint in progress and exiting {ABORT_EXIT_CODE} "
                          "(a third signal exits at once)")
            if in_main:
                self._abort_raised = True
                self._abandon_and_raise(name)
            # from the watcher: the main thread abandons and raises AbortRun (in its handler, so it
            # cannot carry on meanwhile); a real signal, not _thread.interrupt_main, so that it also
            # wakes from a blocking wait. Its wakeup byte is not a delivery.
            self._abort_name = name
            threading.Thread(target=self._send_abort_to_main, args=(signum,), name="signal-abort", daemon=True).start()
            return
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
