"""CheckpointManager / store: round trip, verification, fallback, crash safety, retention, abandon."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from dflash_test_hooks import delay_commits

from dflash_train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    find_resumable,
    list_checkpoints,
    load_checkpoint,
    read_link,
    restore_rng_state,
    verify_checkpoint,
)
from dflash_train.errors import UserError

PY = sys.executable


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(3, 8)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _save(mgr, step, m=None, opt=None, **meta):
    if m is None:
        m, opt = _model_and_opt(step)
    mgr.save(step, m.state_dict(), {"optimizer": opt.state_dict(), "step": step}, {"config_hash": "h1", **meta})
    return m, opt


def _steps(d):
    return [s for s, _ in list_checkpoints(d)]


def test_round_trip_verified_and_snapshot_semantics(tmp_path):
    logs, commits = [], []
    mgr = CheckpointManager(tmp_path / "ck", keep_last=3, async_save=True, log=logs.append, code_version="cv-test",
                            on_commit=lambda s, p: commits.append((s, p)))
    m, opt = _model_and_opt()
    g = torch.Generator().manual_seed(7)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    mgr.save(12, m.state_dict(), {"optimizer": opt.state_dict(), "rng": capture_rng_state({"anchors": g}),
                                  "data_order": {"epoch": 1, "pos": 37}}, {"config_hash": "abc", "tokens": 999})
    assert mgr.last_requested_step == 12
    with torch.no_grad():  # mutating right after save() returns must not leak into the checkpoint
        for p in m.parameters():
            p.add_(100.0)
    mgr.wait()
    path = tmp_path / "ck" / "step-00000012"
    assert verify_checkpoint(path) == []
    assert read_link(tmp_path / "ck", "latest") == path
    assert mgr.last_committed_step == 12 and mgr.last_stats.step == 12 and mgr.last_stats.nbytes > 0
    assert commits == [(12, path)]
    tensors, objects, manifest = load_checkpoint(path)
    for k, v in expected.items():
        assert torch.equal(tensors[k], v), k
    assert manifest["step"] == 12 and manifest["config_hash"] == "abc" and manifest["code_version"] == "cv-test"
    assert manifest["meta"]["tokens"] == 999 and manifest["format_version"] == 1
    assert manifest["tensors"]["0.weight"] == {"shape": [16, 8], "dtype": "float32"}
    assert set(manifest["files"]) == {"model.safetensors", "state.pt"}
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert objects["data_order"] == {"epoch": 1, "pos": 37}
    # the optimizer state restores into a fresh optimizer and matches
    m2, _ = _model_and_opt(seed=1)
    m2.load_state_dict(tensors)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(objects["optimizer"])
    st = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], st)
    # the rng state survives state.pt (weights_only load) and restores
    restore_rng_state(objects["rng"], {"anchors": g})
    # load via the run dir / checkpoints dir latest link too
    assert load_checkpoint(tmp_path / "ck")[2]["step"] == 12
    assert any("snapshot" in line and "write" in line for line in logs)


def test_rng_round_trip_exact():
    import random

    import numpy as np

    g = torch.Generator().manual_seed(3)
    state = capture_rng_state({"anchors": g})
    draw = lambda: (random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.rand(3, generator=g).tolist())  # noqa: E731
    first = draw()
    restore_rng_state(state, {"anchors": g})
    assert draw() == first
    with pytest.raises(KeyError):
        restore_rng_state(state, {})


def test_sync_save_and_plain_objects_only(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2, async_save=False, log=lambda s: None, code_version="x")
    m, opt = _model_and_opt()
    with pytest.raises(TypeError, match=r"objects\['bad'\]"):
        mgr.save(1, m.state_dict(), {"bad": object()}, {})
    sd = dict(m.state_dict(), half=torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t())  # non-contiguous bf16
    mgr.save(1, sd, {"optimizer": opt.state_dict()}, {})
    assert _steps(tmp_path) == [1]  # synchronous: committed when save returns
    tensors, _, manifest = load_checkpoint(tmp_path / "step-00000001")
    assert tensors["half"].dtype == torch.bfloat16 and torch.equal(tensors["half"], sd["half"])
    assert manifest["tensors"]["half"] == {"shape": [3, 2], "dtype": "bfloat16"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_corrupted_newest_falls_back_with_warning(tmp_path):
    d = tmp_path / "ck"
    mgr = CheckpointManager(d, keep_last=5, log=lambda s: None, code_version="x")
    for s in (10, 20, 30):
        _save(mgr, s)
    mgr.wait()
    # step 30: flip one byte in the middle of the tensor file (same size)
    f = d / "step-00000030" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    # step 20: truncated state.pt
    s20 = d / "step-00000020" / "state.pt"
    s20.write_bytes(s20.read_bytes()[:10])
    warnings = []
    assert find_resumable(d, warnings.append) == d / "step-00000010"
    assert len(warnings) == 2
    assert "step-00000030" in warnings[0] and "model.safetensors" in warnings[0] and "sha256" in warnings[0]
    assert "step-00000020" in warnings[1] and "state.pt" in warnings[1]
    with pytest.raises(CheckpointError, match=r"step-00000030/model.safetensors"):
        load_checkpoint(d / "step-00000030")
    # missing / garbage manifest
    (d / "step-00000010" / "manifest.json").write_text("{not json")
    assert "manifest.json" in verify_checkpoint(d / "step-00000010")[0]
    assert find_resumable(d, warnings.append) is None
    # .tmp-* dirs are never candidates
    (d / ".tmp-step-00000099-abcd").mkdir()
    assert find_resumable(d, lambda s: None) is None


CRASH_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from dflash_train.checkpoint import CheckpointManager
    d = Path(sys.argv[1])
    mgr = CheckpointManager(d, keep_last=1, async_save=True, log=lambda s: None, code_version="x")
    t = {"w": torch.arange(1000, dtype=torch.float32)}
    mgr.save(1, t, {"k": 1}, {})
    mgr.wait()
    from dflash_test_hooks import delay_commits
    delay_commits(mgr, 60.0)           # widen the window between "files written" and "commit"
    mgr.save(2, {"w": t["w"] * 2}, {"k": 2}, {})
    print("SAVING", flush=True)
    mgr.wait()
    print("COMMITTED", flush=True)
    """
)


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    d = tmp_path / "ck"
    p = subprocess.Popen([PY, "-c", CRASH_SCRIPT, str(d)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "SAVING"
        deadline = time.monotonic() + 60
        # the manifest is the last file written before the (delayed) rename
        while not list(d.glob(".tmp-step-00000002-*/manifest.json")):
            assert time.monotonic() < deadline, "writer never reached the commit window"
            assert p.poll() is None
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL
    assert read_link(d, "latest") == d / "step-00000001"
    assert _steps(d) == [1]
    assert find_resumable(d, lambda s: None) == d / "step-00000001"
    tensors, objects, _ = load_checkpoint(d / "latest")
    assert torch.equal(tensors["w"], torch.arange(1000, dtype=torch.float32)) and objects == {"k": 1}
    # the leftover temp dir is cleaned by the next manager on this directory
    assert list(d.glob(".tmp-*"))
    CheckpointManager(d, keep_last=1, log=lambda s: None)
    assert not list(d.glob(".tmp-*"))


def test_retention_keep_last_best_and_abandoned_timeline(tmp_path):
    d = tmp_path / "ck"
    logs = []
    mgr = CheckpointManager(d, keep_last=2, log=logs.append, code_version="x")
    _save(mgr, 1)
    mgr.wait()
    assert _steps(d) == [1]
    _save(mgr, 2)
    mgr.mark_best(2)  # waits for step 2 to commit
    for s in (3, 4, 5):
        _save(mgr, s)
    mgr.wait()
    assert _steps(d) == [2, 4, 5]  # last 2 + best
    assert read_link(d, "best") == d / "step-00000002"
    assert read_link(d, "latest") == d / "step-00000005"
    assert any("removed step-00000003" in line and "keep_last=2" in line for line in logs)
    # a resume from step 4 followed by a save at 5 again, then 6: the old step-5 is replaced (and set aside)
    _save(mgr, 5, note="second timeline")
    mgr.wait()
    assert json.loads((d / "step-00000005" / "manifest.json").read_text())["meta"]["note"] == "second timeline"
    aside1 = [p for p in tmp_path.iterdir() if p.name.startswith("ck.set-aside-")]
    assert len(aside1) == 1 and _steps(aside1[0]) == [5]
    assert "note" not in json.loads((aside1[0] / "step-00000005" / "manifest.json").read_text())["meta"]
    # resumed from an older checkpoint: higher steps are an abandoned timeline: set aside, not deleted
    mgr2 = CheckpointManager(d, keep_last=1, log=logs.append, code_version="x")
    _save(mgr2, 3)
    mgr2.wait()
    assert _steps(d) == [2, 3]  # 4, 5 moved aside; best kept; keep_last=1
    assert find_resumable(d, lambda s: None) == d / "step-00000003"
    aside2 = [p for p in tmp_path.iterdir() if p.name.startswith("ck.set-aside-") and p not in aside1]
    assert len(aside2) == 1 and _steps(aside2[0]) == [4, 5]
    assert all(verify_checkpoint(p) == [] for _, p in list_checkpoints(aside2[0]))
    assert any("moved step-00000004 aside" in line and "abandoned timeline" in line for line in logs)
    with pytest.raises(CheckpointError):
        mgr2.mark_best(99)


def test_retention_never_deletes_only_valid(tmp_path):
    d = tmp_path / "ck"
    mgr = CheckpointManager(d, keep_last=1, log=lambda s: None, code_version="x")
    _save(mgr, 1)
    mgr.wait()
    # a broken (incomplete) checkpoint dir with a lower step, e.g. copied by hand
    broken = d / "step-00000000"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"xx")
    _save(mgr, 2)
    mgr.wait()
    assert _steps(d) == [2]
    assert verify_checkpoint(d / "step-00000002") == []
    assert find_resumable(d, lambda s: None) == d / "step-00000002"
    # the broken one is set aside, not deleted
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ck.set-aside-")]
    assert len(aside) == 1 and (aside[0] / "step-00000000" / "model.safetensors").read_bytes() == b"xx"


def test_checkpoint_and_atomic_files_respect_umask(tmp_path):
    from dflash_train.rundir import atomic_write_json

    old = os.umask(0o022)
    try:
        mgr = CheckpointManager(tmp_path / "ck", keep_last=1, async_save=False, log=lambda s: None, code_version="x")
        _save(mgr, 1)
        atomic_write_json(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    ck = tmp_path / "ck" / "step-00000001"
    for f in ("model.safetensors", "state.pt", "manifest.json"):
        assert (ck / f).stat().st_mode & 0o777 == 0o644, f
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


def test_abandon_discards_in_flight_save(tmp_path):
    d = tmp_path / "ck"
    logs = []
    mgr = CheckpointManager(d, keep_last=2, log=logs.append, code_version="x")
    _save(mgr, 1)
    mgr.wait()
    delay_commits(mgr, 30.0)
    _save(mgr, 2)
    deadline = time.monotonic() + 30
    while not list(d.glob(".tmp-step-00000002-*/manifest.json")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    mgr.abandon(timeout=10)
    assert time.monotonic() - t0 < 10  # returned well before the 30 s delay (hang guard, not speed)
    assert not mgr.busy
    assert _steps(d) == [1] and read_link(d, "latest") == d / "step-00000001"
    assert not list(d.glob(".tmp-step-*"))
    assert any("abandoned" in line for line in logs)
    with pytest.raises(CheckpointError, match="abandoned"):
        _save(mgr, 3)


def test_background_failure_is_reported(tmp_path, monkeypatch):
    import dflash_train.checkpoint.manager as manager

    d = tmp_path / "ck"
    logs = []
    mgr = CheckpointManager(d, keep_last=2, log=logs.append, code_version="x")

    def boom(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manager, "sha256_file", boom)
    _save(mgr, 1)
    # a refused write is a CheckpointError and a UserError (the CLI's one line) naming the file
    want = f"no space left on device while reading back {d / 'step-00000001' / 'model.safetensors'}"
    with pytest.raises(CheckpointError, match=f"^{re.escape(want)}$") as got:
        mgr.wait()
    assert isinstance(got.value, UserError)
    assert _steps(d) == [] and not list(d.glob(".tmp-*")) and read_link(d, "latest") is None
    assert any(line.startswith("error: checkpoint step 1 failed: no space left on device") for line in logs)
    mgr.wait()  # reported once
    mgr.raise_failure()


def test_best_link_never_dangles_after_a_move_aside(tmp_path):
    """best -> a checkpoint that is moved aside: re-pointed at the remaining one with the highest
    tau in ../metrics.jsonl (earliest of equal ones), else removed; both logged."""
    import json as _json

    from dflash_train.checkpoint.aside import set_aside_newer

    run = tmp_path / "run"
    d = run / "checkpoints"
    logs = []
    mgr = CheckpointManager(d, keep_last=10, log=logs.append, code_version="x")
    for s in (1, 2, 3, 4):
        _save(mgr, s)
    mgr.mark_best(4)
    taus = {1: 1.5, 2: 1.7, 3: 1.7, 4: 2.0}
    (run / "metrics.jsonl").write_text("".join(_json.dumps({"step": s, "tau": t, "eval": True}) + "\n"
                                               for s, t in taus.items()) + '{"step": 4, "loss": 1.0}\n{"trunc')
    # a resume from step 3: 4 (best) is set aside at once; best -> 2 (tau 1.7, earlier than 3)
    dest = set_aside_newer(d, d / "step-00000003", 3, logs.append, run / "metrics.jsonl")
    assert _steps(dest) == [4] and _steps(d) == [1, 2, 3]
    assert (dest / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert read_link(d, "latest") == d / "step-00000003" and read_link(d, "best") == d / "step-00000002"
    assert any("best pointed at step-00000004, which was moved aside; best -> step-00000002 (recorded tau 1.700"
               in line for line in logs), logs
    # no remaining checkpoint has a recorded tau: the link is removed (logged), never left dangling
    (run / "metrics.jsonl").write_text("")
    set_aside_newer(d, d / "step-00000001", 1, logs.append, run / "metrics.jsonl")
    assert not (d / "best").is_symlink() and read_link(d, "latest") == d / "step-00000001"
    assert any("removed the best link: it pointed at step-00000002" in line for line in logs), logs
    # retention: a best that does not verify is set aside like any broken checkpoint, and best follows
    mgr = CheckpointManager(d, keep_last=10, log=logs.append, code_version="x")
    for s in (2, 3):
        _save(mgr, s)
    mgr.mark_best(2)
    (run / "metrics.jsonl").write_text("".join(_json.dumps({"step": s, "tau": 1.1 * s, "eval": True}) + "\n"
                                               for s in (1, 2, 3)))
    (d / "step-00000002" / "state.pt").write_bytes(b"x")
    _save(mgr, 4)
    mgr.wait()
    assert _steps(d) == [1, 3, 4] and read_link(d, "best") == d / "step-00000003"
