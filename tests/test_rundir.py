"""run.json: acquire/update/release, busy refusal, reused-pid and dead-pid detection, metrics tail."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from dflash_train.rundir import (
    RunDirBusy,
    RunRecord,
    is_live,
    last_metrics,
    liveness,
    metrics_summary,
    read_record,
)

PY = sys.executable

HOLDER = textwrap.dedent(
    """
    import sys, time
    from dflash_train.rundir import RunRecord
    RunRecord(sys.argv[1]).acquire(["holder"], "cv-holder", "h")
    print("HELD", flush=True)
    sys.stdin.read()   # hold until the test closes stdin
    """
)


def test_acquire_update_release(tmp_path):
    rec = RunRecord(tmp_path)
    r = rec.acquire(["dflash-train", "train"], "cv1", "cfg1")
    on_disk = read_record(tmp_path)
    assert on_disk == json.loads((tmp_path / "run.json").read_text())
    assert on_disk["pid"] == os.getpid() and on_disk["live"] is True and on_disk["code_version"] == "cv1"
    assert abs(on_disk["create_time"] - psutil.Process().create_time()) < 1e-6
    for k in ("hostname", "argv", "cwd", "run_dir", "started_at", "step", "last_checkpoint", "tokens_per_s", "updated_at"):
        assert k in on_disk, k
    assert r["config_hash"] == "cfg1"
    assert is_live(on_disk)
    rec.update(step=7, tokens_per_s=123.5)
    assert read_record(tmp_path)["step"] == 7
    rec.release(last_checkpoint=tmp_path / "checkpoints" / "step-00000007", step=7)
    after = read_record(tmp_path)
    assert after["live"] is False and after["last_checkpoint"].endswith("step-00000007") and "ended_at" in after
    # the record of a released run that is still this (live) process: same pid may re-acquire
    RunRecord(tmp_path).acquire(["again"], "cv2")
    assert not list(tmp_path.glob(".run.json.*"))  # no temp files left behind


def test_busy_refusal_names_pid(tmp_path):
    p = subprocess.Popen([PY, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "HELD"
        rec = read_record(tmp_path)
        assert rec["pid"] == p.pid and is_live(rec)
        with pytest.raises(RunDirBusy, match=rf"pid {p.pid}"):
            RunRecord(tmp_path).acquire(["second"], "cv")
        assert read_record(tmp_path)["pid"] == p.pid  # untouched
        # run.json not (yet) naming the holder, as in two starts at the same moment: the flock refuses
        saved = (tmp_path / "run.json").read_text()
        (tmp_path / "run.json").write_text(json.dumps({"pid": 999999999, "create_time": 1.0, "live": True}))
        with pytest.raises(RunDirBusy, match="locked by another process"):
            RunRecord(tmp_path).acquire(["racer"], "cv")
        (tmp_path / "run.json").write_text(saved)
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    # the holder exited without release (like a crash): the record is stale, not live
    rec = read_record(tmp_path)
    live, why = liveness(rec)
    assert rec["live"] is True and not live and "exited" in why
    RunRecord(tmp_path).acquire(["after-crash"], "cv")
    assert read_record(tmp_path)["previous"]["pid"] == p.pid


def test_reused_pid_is_not_live(tmp_path):
    # a record naming a live pid (ours) with a different start time: the pid was reused
    fake = {"pid": os.getpid(), "create_time": psutil.Process().create_time() - 3600, "hostname": os.uname().nodename,
            "live": True, "started_at": "2026-01-01T00:00:00+00:00"}
    (tmp_path / "run.json").write_text(json.dumps(fake))
    live, why = liveness(read_record(tmp_path))
    assert not live and "reused" in why
    # within the 1 s tolerance it is the same process
    fake["create_time"] = psutil.Process().create_time() + 0.5
    assert is_live(fake)
    # a dead pid
    p = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = dict(fake, pid=int(p.stdout))
    assert not is_live(dead)
    # corrupt / missing
    (tmp_path / "run.json").write_text("{")
    assert read_record(tmp_path)["corrupt"] and not is_live(read_record(tmp_path))
    assert read_record(tmp_path / "nope") is None and not is_live(None)


def test_acquire_over_reused_pid_record(tmp_path):
    other = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        fake = {"pid": other.pid, "create_time": 12345.0, "hostname": os.uname().nodename, "live": True}
        (tmp_path / "run.json").write_text(json.dumps(fake))
        RunRecord(tmp_path).acquire(["new"], "cv")  # another process holds the pid: not the trainer
        assert read_record(tmp_path)["pid"] == os.getpid()
    finally:
        other.stdin.close()
        other.wait(timeout=30)


def test_foreign_host_record(tmp_path):
    from datetime import datetime, timezone

    now = datetime.now(timezone.utc).isoformat()
    rec = {"pid": 1, "create_time": 0.0, "hostname": "some-other-host", "live": True, "updated_at": now}
    live, why = liveness(rec)
    assert live and "some-other-host" in why
    assert not is_live(dict(rec, updated_at="2020-01-01T00:00:00+00:00"))
    assert not is_live(dict(rec, live=False))


def test_metrics_tail(tmp_path):
    assert last_metrics(tmp_path) == [] and metrics_summary(tmp_path)["tokens_per_s"] is None
    lines = [{"step": i, "loss": 1.0 / (i + 1), "tokens": 100 * i, "time": 2.0 * i} for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"step\": 6, \"lo")
    assert [x["step"] for x in last_metrics(tmp_path, 3)] == [3, 4, 5]
    s = metrics_summary(tmp_path)
    assert s["step"] == 5 and s["tokens_per_s"] == pytest.approx(50.0) and s["loss"] == pytest.approx(1 / 6)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("\n" + json.dumps({"step": 6, "loss": 0.1, "tokens_per_s": 77.0}) + "\n")
    assert metrics_summary(tmp_path)["tokens_per_s"] == 77.0
