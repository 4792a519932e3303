"""StopController with real signals in a subprocess: 1st -> graceful save + exit 0,
2nd -> abandon callback + exit 130 (no half-written checkpoint), 3rd -> immediate exit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dflash_train.checkpoint import list_checkpoints, read_link, verify_checkpoint
from dflash_train.control.signals import grace_warning

PY = sys.executable

SCRIPT = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from dflash_train.checkpoint import CheckpointManager
    from dflash_train.control.signals import AbortRun, StopController

    d = Path(sys.argv[1]); mode = sys.argv[2]; delay = float(sys.argv[3])
    mgr = CheckpointManager(d / "ck", keep_last=3, log=lambda s: None, code_version="x")
    def on_abandon():
        (d / "abandoned").write_text("1")
        if mode == "hang":
            time.sleep(120)       # a stuck abandon: the third signal must still exit at once
        mgr.abandon(timeout=10)
    stop = StopController(on_abandon=on_abandon).install()
    t = {"w": torch.zeros(64)}
    mgr.save(1, t, {}, {}); mgr.wait()
    step = 1
    print("READY", flush=True)
    try:
        while not stop.stop_requested:
            time.sleep(0.01)
        step += 1
        print(f"STOPPING {stop.signal_name}", flush=True)
        from dflash_test_hooks import delay_commits
        delay_commits(mgr, delay)
        mgr.save(step, t, {}, {})
        mgr.wait()
        print("SAVED", flush=True)
    except AbortRun as e:
        print(f"ABORT {e.signal_name} {e.code}", flush=True)
        if mode == "uncaught":
            raise
        sys.exit(e.code)
    finally:
        stop.uninstall()
    """
)


def _start(tmp_path, mode="caught", delay=0.0):
    p = subprocess.Popen([PY, "-c", SCRIPT, str(tmp_path), mode, str(delay)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    assert line == "READY", (line, p.stderr.read() if p.poll() is not None else "")
    return p


def _wait_for(cond, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _finish(p, timeout=60):
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return out, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_graceful(tmp_path, sig):
    p = _start(tmp_path)
    os.kill(p.pid, sig)
    out, err = _finish(p)
    assert p.returncode == 0, err
    assert f"STOPPING {sig.name}" in out and "SAVED" in out
    ck = tmp_path / "ck"
    assert [s for s, _ in list_checkpoints(ck)] == [1, 2]
    assert read_link(ck, "latest") == ck / "step-00000002" and verify_checkpoint(ck / "step-00000002") == []
    assert not (tmp_path / "abandoned").exists()


@pytest.mark.parametrize("mode", ["caught", "uncaught"])
def test_second_signal_abandons_and_exits_130(tmp_path, mode):
    p = _start(tmp_path, mode, delay=60.0)
    ck = tmp_path / "ck"
    os.kill(p.pid, signal.SIGTERM)
    assert p.stdout.readline().startswith("STOPPING SIGTERM")
    # the final save is in its (widened) commit window
    _wait_for(lambda: list(ck.glob(".tmp-step-00000002-*/manifest.json")), "save in progress")
    os.kill(p.pid, signal.SIGTERM)
    out, err = _finish(p, timeout=60)
    assert p.returncode == 130, err
    assert "ABORT SIGTERM 130" in out and "SAVED" not in out
    assert "Traceback" not in err
    assert (tmp_path / "abandoned").exists()
    assert [s for s, _ in list_checkpoints(ck)] == [1]  # no half-written step 2 became visible
    assert read_link(ck, "latest") == ck / "step-00000001"


def test_third_signal_exits_immediately(tmp_path):
    p = _start(tmp_path, "hang", delay=60.0)
    os.kill(p.pid, signal.SIGINT)
    assert p.stdout.readline().startswith("STOPPING SIGINT")
    os.kill(p.pid, signal.SIGINT)
    _wait_for(lambda: (tmp_path / "abandoned").exists(), "abandon callback")
    os.kill(p.pid, signal.SIGINT)
    out, err = _finish(p, timeout=30)
    assert p.returncode == 130
    assert "ABORT" not in out  # os._exit: no Python cleanup ran
    assert "third time" in err
    ck = tmp_path / "ck"
    assert [s for s, _ in list_checkpoints(ck)] == [1] and read_link(ck, "latest") == ck / "step-00000001"


def test_request_stop_and_install_rules():
    from dflash_train.control.signals import StopController

    c = StopController()
    c.request_stop("max_seconds")
    assert c.stop_requested and c.signal_name == "request_stop:max_seconds"
    prev = signal.getsignal(signal.SIGTERM)
    with StopController() as s:
        assert signal.getsignal(signal.SIGTERM) == s._handle
    assert signal.getsignal(signal.SIGTERM) == prev


def test_worker_ignore_signals(tmp_path):
    code = textwrap.dedent(
        """
        import os, signal, time
        from dflash_train.control.signals import ignore_stop_signals
        ignore_stop_signals()
        os.kill(os.getpid(), signal.SIGINT); os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print("ALIVE")
        """
    )
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ALIVE" in r.stdout


def test_grace_warning():
    assert grace_warning(2.0, 5.0, 30.0) is None
    w = grace_warning(10.0, 25.0, 30.0)
    assert w and "35.0s" in w and "grace_seconds=30" in w
