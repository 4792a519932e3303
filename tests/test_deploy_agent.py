"""The deploy agent's ops (what runs on the job's host) on synthetic run dirs:
liveness and pid reuse, env capture without secrets, the deploy lock, atomic
release switching, checkpoint preservation and timeline restore, every health
verdict; and one preflight feature probe (CUDA asked for on a CPU torch)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dflash_train.deploy import agent as A


def ag(capsys, *argv) -> dict:
    assert A.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(out)


@pytest.fixture
def child():
    """A live process that is not us: `python -c sleep` with a chosen environment."""
    procs = []

    def start(env: dict | None = None) -> subprocess.Popen:
        e = {"PATH": os.environ["PATH"], **(env or {})}
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=e, stdin=subprocess.DEVNULL)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def write_record(rd: Path, pid: int, create_time: float | None = None, **extra) -> None:
    rd.mkdir(parents=True, exist_ok=True)
    ct = psutil.Process(pid).create_time() if create_time is None else create_time
    rec = {"pid": pid, "create_time": ct, "hostname": socket.gethostname(), "live": True, "step": 0,
           "argv": ["/x/cli.py", "train", "--run-dir", str(rd)], "cwd": str(rd)}
    rec.update(extra)
    (rd / "run.json").write_text(json.dumps(rec))


def make_ckpt(ckpt_dir: Path, step: int) -> Path:
    d = ckpt_dir / f"step-{step:08d}"
    d.mkdir(parents=True)
    files = {}
    for name in ("model.safetensors", "state.pt"):
        data = f"{name} {step}".encode() * 10
        (d / name).write_bytes(data)
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "manifest.json").write_text(json.dumps({"format_version": 1, "step": step, "files": files}))
    return d


def set_latest(ckpt_dir: Path, step: int) -> None:
    tmp = ckpt_dir / ".l"
    os.symlink(f"step-{step:08d}", tmp)
    os.replace(tmp, ckpt_dir / "latest")


def test_info_liveness_env_and_reuse(tmp_path, capsys, child):
    assert ag(capsys, "info", "--run-dir", tmp_path / "missing")["ok"] is False
    p = child({"CUDA_VISIBLE_DEVICES": "1", "HF_TOKEN": "secret", "MY_API_KEY": "k", "OMP_NUM_THREADS": "2",
               "PYTHONPATH": "/a:/b", "WORLD_SIZE": "2"})
    rd = tmp_path / "run"
    write_record(rd, p.pid)
    time.sleep(0.2)
    info = ag(capsys, "info", "--run-dir", rd)
    assert info["live"] is True and info["run_dir"] == str(rd.resolve())
    job = info["job"]
    assert job["python"] == sys.executable  # as invoked (a venv's bin/python), not the resolved exe
    assert job["env"] == {"CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "2", "PYTHONPATH": "/a:/b",
                          "PATH": os.environ["PATH"]}
    assert job["distributed"] is True
    # the same pid with another start time: a reused pid, not our trainer
    write_record(rd, p.pid, create_time=psutil.Process(p.pid).create_time() - 50)
    info = ag(capsys, "info", "--run-dir", rd)
    assert info["live"] is False and "reused" in info["why"]
    st = ag(capsys, "stop", "--run-dir", rd, "--timeout", "5")
    assert st["refused"] and st["stopped"] is False
    assert p.poll() is None
    # another host's record is never signalled from here
    write_record(rd, p.pid, hostname="elsewhere")
    assert "reach the job's own host" in ag(capsys, "info", "--run-dir", rd)["why"]


def test_stop_confirms_checkpoint_at_stop_step(tmp_path, capsys):
    """A fake trainer that checkpoints and releases run.json on SIGINT."""
    rd = tmp_path / "run"
    rd.mkdir()
    script = f"""
import json, os, signal, sys, time, hashlib, psutil
rd = {str(rd)!r}
stop = []
signal.signal(signal.SIGINT, lambda *a: stop.append(1))
me = psutil.Process()
rec = dict(pid=os.getpid(), create_time=me.create_time(), hostname={socket.gethostname()!r}, live=True, step=0)
json.dump(rec, open(rd + '/run.json', 'w'))
while not stop:
    time.sleep(0.02)
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_deploy_agent import make_ckpt, set_latest
from pathlib import Path
make_ckpt(Path(rd) / 'checkpoints', 17); set_latest(Path(rd) / 'checkpoints', 17)
rec.update(live=False, step=17)
json.dump(rec, open(rd + '/run.json.tmp', 'w')); os.replace(rd + '/run.json.tmp', rd + '/run.json')
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end and not (rd / "run.json").exists():
            time.sleep(0.05)
        time.sleep(0.2)
        st = ag(capsys, "stop", "--run-dir", rd, "--timeout", "30")
        assert st["ok"] and st["stopped"] and st["step"] == 17 and st["checkpoint"]["step"] == 17, st
        assert st["problems"] == []
    finally:
        p.kill()
        p.wait()


def test_lock_switch_and_remove(tmp_path, capsys, child):
    rd = tmp_path / "run"
    rd.mkdir()
    me = json.dumps({"hostname": socket.gethostname(), "pid": os.getpid()})
    other_live = json.dumps({"hostname": socket.gethostname(), "pid": child().pid})
    assert ag(capsys, "lock", "--run-dir", rd, "--owner", other_live)["ok"]
    res = ag(capsys, "lock", "--run-dir", rd, "--owner", me)
    assert res["ok"] is False and "another deploy" in res["error"]
    # a lock left by a dead deployer on this host is stale
    dead = subprocess.Popen(["true"])
    dead.wait()
    (rd / "releases" / ".deploy.lock").write_text(json.dumps({"hostname": socket.gethostname(), "pid": dead.pid, "time": time.time()}))
    assert ag(capsys, "lock", "--run-dir", rd, "--owner", me)["ok"]
    assert ag(capsys, "unlock", "--run-dir", rd, "--owner", me)["ok"]
    assert not (rd / "releases" / ".deploy.lock").exists()

    for rid in ("r1", "r2"):
        (rd / "releases" / rid / "src" / "dflash_train").mkdir(parents=True)
        assert ag(capsys, "write-release", "--run-dir", rd, "--id", rid, "--meta", '{"kind": "dir"}')["ok"]
    assert ag(capsys, "switch", "--run-dir", rd, "--id", "nope")["ok"] is False
    assert ag(capsys, "switch", "--run-dir", rd, "--id", "r1") == {"ok": True, "current": "r1", "was": None}
    assert ag(capsys, "switch", "--run-dir", rd, "--id", "r2")["was"] == "r1"
    assert os.readlink(rd / "releases" / "current") == "r2" and os.readlink(rd / "releases" / "previous") == "r1"
    assert [p.name for p in (rd / "releases").iterdir() if p.name.startswith(".tmp")] == []
    # current and previous cannot be removed
    assert ag(capsys, "remove-release", "--run-dir", rd, "--id", "r1")["ok"] is False
    assert ag(capsys, "remove-release", "--run-dir", rd, "--id", "../x")["ok"] is False
    info = ag(capsys, "info", "--run-dir", rd)
    assert info["releases"]["list"] == ["r1", "r2"] and info["releases"]["current_release"]["kind"] == "dir"


def test_preserve_and_restore_timeline(tmp_path, capsys):
    rd = tmp_path / "run"
    ck = rd / "checkpoints"
    for s in (10, 20, 30):
        make_ckpt(ck, s)
    set_latest(ck, 10)
    (rd / "releases" / "new").mkdir(parents=True)
    assert ag(capsys, "preserve", "--run-dir", rd, "--id", "new", "--step", 10)["ok"]
    kept = rd / "releases" / "new" / "stop-checkpoint" / "step-00000010" / "model.safetensors"
    assert kept.stat().st_ino == (ck / "step-00000010" / "model.safetensors").stat().st_ino  # a hard link
    # the failed release trained on; its retention removed the stop checkpoint
    import shutil

    shutil.rmtree(ck / "step-00000010")
    set_latest(ck, 30)
    res = ag(capsys, "restore-timeline", "--run-dir", rd, "--id", "new", "--step", 10)
    assert res["ok"] and res["restored"] and sorted(res["moved"]) == ["step-00000020", "step-00000030"], res
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000010"]
    assert os.readlink(ck / "latest") == "step-00000010"
    assert A.rundir.verify_checkpoint(ck / "step-00000010") == []
    assert (rd / "releases" / "new" / "abandoned-checkpoints" / "step-00000030" / "manifest.json").exists()
    # corrupted checkpoint is reported
    (ck / "step-00000010" / "state.pt").write_bytes(b"x")
    assert A.rundir.verify_checkpoint(ck / "step-00000010")


def _health(capsys, rd, pid, *extra):
    log = rd / "logs" / "deploy.log"
    return ag(capsys, "health", "--run-dir", rd, "--pid", pid, "--from-step", 10, "--steps", 3, "--log", log,
              "--poll", "0.05", *extra)


def test_health_verdicts(tmp_path, capsys, child):
    p = child()
    rd = tmp_path / "run"
    (rd / "logs").mkdir(parents=True)
    log = rd / "logs" / "deploy.log"
    write_record(rd, p.pid, step=14, resumed_step=10)
    before = [{"step": s, "loss": 3.0, "tokens_per_s": 100.0} for s in (6, 8, 10)]
    after = [{"step": s, "loss": 2.5, "tokens_per_s": 80.0} for s in (12, 14)]
    (rd / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in before + after))
    log.write_text("INFO resumed from /r/checkpoints/step-00000010 at step 10 (99 tokens trained)\n")  # not read
    base = ag(capsys, "baseline", "--run-dir", rd, "--upto", 10)
    assert base["tokens_per_s"] == 100.0 and base["step"] == 10 and base["loss"] == 3.0
    ok = _health(capsys, rd, p.pid, "--timeout", "10", "--min-tps", "50")
    assert ok["ok"] and ok["resumed_step"] == 10 and ok["step"] == 14, ok
    slow = _health(capsys, rd, p.pid, "--timeout", "0.5", "--min-tps", "500")
    assert slow["ok"] is False and "below the minimum" in slow["message"]
    # not enough steps yet -> times out naming what is missing
    write_record(rd, p.pid, step=12, resumed_step=10)
    short = _health(capsys, rd, p.pid, "--timeout", "0.5")
    assert short["ok"] is False and "need 13" in short["message"]
    write_record(rd, p.pid, step=14, resumed_step=10)
    # a non-finite loss after the resume (the trainer writes "nan" as a string)
    (rd / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in before + after + [{"step": 16, "loss": "nan"}]))
    nan = _health(capsys, rd, p.pid, "--timeout", "10")
    assert nan["ok"] is False and "non-finite" in nan["message"]
    # resumed from the wrong step: read from run.json (resumed_step), never from a log line
    (rd / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in before + after))
    log.write_text("INFO resumed from /r/checkpoints/step-00000010 at step 10 (99 tokens trained)\n")
    write_record(rd, p.pid, step=14, resumed_step=8)
    wrong = _health(capsys, rd, p.pid, "--timeout", "10")
    assert wrong["ok"] is False and "resumed at step 8" in wrong["message"]
    # resumed at the stop step again (the log offsets are still accepted)
    write_record(rd, p.pid, step=14, resumed_step=10)
    offs = json.dumps({str(log): log.stat().st_size})
    assert _health(capsys, rd, p.pid, "--timeout", "10", "--log-offsets", offs)["ok"]
    # the process exits
    p.kill()
    p.wait()
    dead = _health(capsys, rd, p.pid, "--timeout", "10", "--log-offsets", offs)
    assert dead["ok"] is False and "exited" in dead["message"] and "log_tail" in dead


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="probes the CPU-only case")
def test_preflight_refuses_cuda_config_on_cpu_torch(tmp_path):
    from dflash_train.config import load_config, save_config

    rd = tmp_path / "run"
    rd.mkdir()
    save_config(load_config(None, ["train.device=cuda"]), rd / "config.yaml")
    src = Path(__file__).resolve().parents[1] / "src"
    pre = src / "dflash_train" / "deploy" / "preflight.py"
    cp = subprocess.run([sys.executable, "-", "--release-src", str(src), "--run-dir", str(rd)], input=pre.read_text(),
                        capture_output=True, text=True, timeout=300, cwd=tmp_path,
                        env={**os.environ, "PYTHONPATH": str(src)})
    verdict = json.loads(cp.stdout.strip().splitlines()[-1])
    checks = {c["name"]: c for c in verdict["checks"]}
    assert verdict["ok"] is False and checks["config"]["ok"] and checks["features"]["ok"] is False, verdict
    assert "cuda" in checks["features"]["detail"]
    assert "checkpoint" not in checks


def test_prune_keeps_current_previous_initial(tmp_path, capsys):
    rd = tmp_path / "run"
    for i, rid in enumerate(["initial", "a", "b", "c", "d"]):
        d = rd / "releases" / rid
        (d / "src" / "dflash_train").mkdir(parents=True)
        (d / "stop-checkpoint" / "step-00000001").mkdir(parents=True)
        assert ag(capsys, "write-release", "--run-dir", rd, "--id", rid)["ok"]
        os.utime(d / "release.json", (1000 + i, 1000 + i))
    ag(capsys, "switch", "--run-dir", rd, "--id", "a")
    ag(capsys, "switch", "--run-dir", rd, "--id", "d")
    res = ag(capsys, "prune", "--run-dir", rd, "--keep", "2")
    left = sorted(p.name for p in (rd / "releases").iterdir() if p.is_dir() and not p.is_symlink())
    assert left == ["a", "c", "d", "initial"], res  # b: oldest unprotected beyond keep=2
    assert (rd / "releases" / "d" / "stop-checkpoint").exists()  # current keeps its rollback point
    assert not (rd / "releases" / "a" / "stop-checkpoint").exists()


def test_cleanup_failures_are_said_not_swallowed(tmp_path, capsys):
    """A release that cannot be removed is reported as a failure, and the deployer turns a
    failed unlock (run through the shipped agent + rundir script) into a warning naming the lock."""
    import io

    from dflash_train.deploy.command import Deployer

    rd = tmp_path / "run"
    rel = rd / "releases"
    rel.mkdir(parents=True)
    (rel / "stuck").write_text("a file where a release directory should be")
    res = ag(capsys, "remove-release", "--run-dir", rd, "--id", "stuck")
    assert res["ok"] is False and "cannot remove" in res["error"]
    (rel / ".deploy.lock").write_text(json.dumps({"hostname": "elsewhere", "pid": 1, "time": time.time()}))
    out = io.StringIO()
    d = Deployer(rd, code=str(tmp_path), via=[], out=out)
    d.run_dir = str(rd)
    assert d.cleanup("unlock", "the lock stays", owner=d.owner) is None
    assert "held by someone else" in d.report["warnings"][0] and "the lock stays" in out.getvalue()
    assert (rel / ".deploy.lock").exists()
