"""Training as a user runs it: real subprocesses, real signals, real files.

The core promise: a run stopped with SIGTERM or SIGINT at any step and resumed logs the
same `loss` values, bit for bit, as a run that was never interrupted, and ends with the same
drafter weights and optimizer state (its last checkpoint's model.safetensors and state.pt),
bit for bit."""
from __future__ import annotations

import json
import math
import signal
import time

import pytest
import yaml

from trainrun import (assert_same_training_state, losses, metrics, run_train, signal_and_wait, start_train,
                      tiny_overrides, wait_for, wait_step)


@pytest.fixture(scope="module")
def reference(train_setup):
    target, jsonl, root = train_setup
    rd = root / "reference"
    res = run_train(rd, tiny_overrides(target, jsonl))
    assert res.returncode == 0, res.stdout + res.stderr
    return rd


def test_run_dir_layout_and_metrics(reference):
    rd = reference
    cfg = yaml.safe_load((rd / "config.yaml").read_text())
    assert cfg["train"]["max_steps"] == 8
    recs = metrics(rd)
    assert [r["step"] for r in recs] == list(range(1, 9))
    for r in recs:
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        for key in ("lr", "grad_norm", "expected_tau", "tokens_per_s", "samples_per_s", "acc_1", "acc_3",
                    "target_busy", "trainer_busy", "trainer_wait", "queue_occupancy", "supervised_per_s"):
            assert key in r, key
        # one step's supervised predictions: batch 2 x 4 anchors x 3 block positions at most (the
        # loss mask removes some), and some every step on this data
        assert 0 < r["supervised"] <= 2 * 4 * 3, r["supervised"]
    # full precision: the JSON float round-trips to the same double
    assert isinstance(recs[0]["loss"], float) and len(repr(recs[0]["loss"])) > 8
    ck = rd / "checkpoints"
    assert (ck / "step-00000004" / "manifest.json").is_file()
    assert (ck / "step-00000008" / "manifest.json").is_file()
    assert (ck / "latest").resolve().name == "step-00000008"
    run = json.loads((rd / "run.json").read_text())
    assert run["live"] is False and run["step"] == 8 and run["last_checkpoint"] == "step-00000008"
    assert (rd / "logs" / "train.log").is_file()


@pytest.mark.parametrize("stop_after, sig", [(1, signal.SIGTERM), (3, signal.SIGINT), (6, signal.SIGTERM)],
                         ids=["1-SIGTERM", "3-SIGINT", "6-SIGTERM"])
def test_signal_then_resume_is_bit_exact(train_setup, reference, stop_after, sig, capsys):
    """SIGTERM (a scheduler's stop) or SIGINT (Ctrl-C; here sent by `dflash-train stop`, its default)
    mid-run: exit 0 with a checkpoint at the stop step; the resume ends where the uninterrupted run
    ends: the same losses, weights and optimizer state, bit for bit."""
    target, jsonl, root = train_setup
    rd = root / f"stop{stop_after}"
    log = root / f"stop{stop_after}.log"
    proc = start_train(rd, tiny_overrides(target, jsonl), log, step_delay=0.3)  # the signal lands mid-run
    wait_step(rd, stop_after, proc)
    if sig == signal.SIGINT:
        # as a user stops a real trainer: `status` sees it live, `stop` (SIGINT by default) waits for
        # the stop checkpoint and names it (tests/test_control_commands.py: the same against a fake)
        from dflash_train.control.commands import status_command, stop_command

        capsys.readouterr()
        assert status_command(rd, True) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["live"] and info["pid"] == proc.pid and info["step"] >= stop_after, info
        assert stop_command(rd, 120.0, "INT", False) == 0, log.read_text()[-3000:]
        out = capsys.readouterr().out
        assert proc.wait(60) == 0, log.read_text()
        stopped = max(losses(rd))
        assert "sent SIGINT" in out and f"stopped at step {stopped}, checkpoint step-{stopped:08d}" in out, out
        assert status_command(rd, True) == 3  # not live any more
        assert json.loads(capsys.readouterr().out)["live"] is False
    else:
        assert signal_and_wait(proc, sig) == 0, log.read_text()
    assert f"({sig.name})" in log.read_text(), log.read_text()[-3000:]  # "stopping at step N (SIGINT)"
    assert json.loads((rd / "run.json").read_text())["stop_reason"] == sig.name
    stopped = max(losses(rd))
    assert stopped < 8, "the run finished before the signal; the test proves nothing"
    latest = (rd / "checkpoints" / "latest").resolve().name
    assert latest == f"step-{stopped:08d}"
    run = json.loads((rd / "run.json").read_text())
    assert run["live"] is False and run["last_checkpoint"] == latest
    res = run_train(rd, tiny_overrides(target, jsonl))
    assert res.returncode == 0, res.stdout + res.stderr
    assert losses(rd) == losses(reference)  # exact float equality, every step
    assert_same_training_state(rd, reference)  # final weights + optimizer, bit for bit


def test_resume_falls_back_when_newest_checkpoint_is_corrupt(train_setup, reference, tmp_path):
    import shutil

    target, jsonl, root = train_setup
    rd = tmp_path / "corrupt"
    res = run_train(rd, tiny_overrides(target, jsonl, **{"train.max_steps": 8}))
    assert res.returncode == 0
    # corrupt the newest checkpoint; resuming to 8 must fall back to step 4 and redo 5..8
    newest = rd / "checkpoints" / "step-00000008" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))
    shutil.copy(rd / "metrics.jsonl", tmp_path / "before.jsonl")
    res = run_train(rd, tiny_overrides(target, jsonl, **{"train.max_steps": 8}))
    assert res.returncode == 0, res.stderr
    assert "step-00000008" in res.stderr and "step-00000004" in res.stderr
    assert losses(rd) == losses(reference)
    assert_same_training_state(rd, reference)


def test_second_signal_abandons_save_and_exits_130(train_setup, tmp_path):
    target, jsonl, _ = train_setup
    rd = tmp_path / "abort"
    log = tmp_path / "abort.log"
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 1000, "checkpoint.every_steps": 1000})
    proc = start_train(rd, over, log, commit_delay=30)
    wait_step(rd, 2, proc)
    proc.send_signal(signal.SIGTERM)
    # the stop checkpoint is being written (the delay holds it before commit)
    wait_for(lambda: any(p.name.startswith(".tmp-") for p in (rd / "checkpoints").iterdir()), 60,
             what="checkpoint write to start")
    assert signal_and_wait(proc, signal.SIGTERM, timeout=60) == 130
    assert not list((rd / "checkpoints").glob("step-*")), "a half-written checkpoint became visible"
    assert not (rd / "checkpoints" / "latest").exists()


def test_third_signal_exits_at_once(train_setup, tmp_path):
    target, jsonl, _ = train_setup
    rd = tmp_path / "third"
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 1000, "checkpoint.every_steps": 1000})
    proc = start_train(rd, over, tmp_path / "third.log", commit_delay=60)
    wait_step(rd, 1, proc)
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
    assert proc.wait(30) == 130


def test_signal_before_first_step(train_setup, reference, tmp_path):
    target, jsonl, _ = train_setup
    rd = tmp_path / "early"
    proc = start_train(rd, tiny_overrides(target, jsonl), tmp_path / "early.log", step_delay=0.3)
    wait_for(lambda: (rd / "run.json").exists(), 60, what="run.json")
    assert signal_and_wait(proc, signal.SIGTERM) == 0, (tmp_path / "early.log").read_text()
    run = json.loads((rd / "run.json").read_text())
    assert run["live"] is False
    # whatever step it reached, a resume completes the run
    res = run_train(rd, tiny_overrides(target, jsonl))
    assert res.returncode == 0, res.stderr
    assert sorted(losses(rd)) == list(range(1, 9))
    assert losses(rd) == losses(reference)
    assert_same_training_state(rd, reference)


def test_second_trainer_on_live_run_dir_is_refused(train_setup, tmp_path):
    target, jsonl, _ = train_setup
    rd = tmp_path / "busy"
    over = tiny_overrides(target, jsonl, **{"train.max_steps": 1000})
    proc = start_train(rd, over, tmp_path / "busy.log")
    try:
        wait_step(rd, 1, proc)
        res = run_train(rd, over, timeout=120)
        assert res.returncode == 2
        assert "in use by a live trainer" in res.stderr and "Traceback" not in res.stderr
    finally:
        signal_and_wait(proc, signal.SIGTERM)


def test_sigkill_during_checkpoint_write_then_resume(train_setup, reference, tmp_path):
    """A crash while a checkpoint is being written: `latest` still names a
    complete checkpoint, and a resume reproduces the reference losses."""
    target, jsonl, _ = train_setup
    rd = tmp_path / "killed"
    over = tiny_overrides(target, jsonl, **{"checkpoint.every_steps": 2})
    proc = start_train(rd, over, tmp_path / "killed.log", commit_delay=20)
    # step 2's checkpoint commits after the delay; wait for step 4's write to be in flight
    wait_for(lambda: (rd / "checkpoints" / "latest").exists(), 120, what="first checkpoint")
    wait_for(lambda: any(p.name.startswith(".tmp-") for p in (rd / "checkpoints").iterdir()), 120,
             what="second checkpoint write")
    proc.kill()
    proc.wait(30)
    latest = (rd / "checkpoints" / "latest").resolve()
    assert (latest / "manifest.json").is_file()
    from dflash_train.checkpoint import verify_checkpoint

    assert verify_checkpoint(latest) == []
    res = run_train(rd, tiny_overrides(target, jsonl, **{"checkpoint.every_steps": 2}))
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(rd) == losses(reference)
    assert_same_training_state(rd, reference)
