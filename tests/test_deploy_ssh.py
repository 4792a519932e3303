"""The ssh transport against a REAL OpenSSH server on 127.0.0.1 (tests/sshd.py),
alone and chained through a `pct`-style hop (a test `pct` on the server's PATH).
Skipped with the reason only when sshd is not installed (.ci/setup_sshd.sh)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sshd import LoopbackSshd, free_port, sshd_unavailable  # noqa: E402

from dflash_train.deploy.remote import remote_call, remote_run  # noqa: E402
from dflash_train.deploy.transport import Transport  # noqa: E402

pytestmark = pytest.mark.skipif(sshd_unavailable() is not None, reason=str(sshd_unavailable()))

VENV_BIN = str(Path(sys.executable).parent)
WEIRD = ["a b", "it's", '"dq"', "$HOME", "${PATH}", "`id`", "$(id)", "x\ny", "\\", "*", ";ls", "", "-n", "--", "é ü", "'\"$'"]
ECHO_ARGV = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    s = LoopbackSshd.start(tmp_path_factory.mktemp("sshd"), extra_path=[VENV_BIN])
    yield s
    s.stop()


@pytest.fixture
def ssh_env(sshd, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_SSH_OPTIONS", sshd.ssh_options)
    monkeypatch.setenv("DFLASH_REMOTE_PYTHON", sys.executable)
    monkeypatch.delenv("DFLASH_REMOTE_CLI", raising=False)
    return sshd


def test_ssh_run_quoting(ssh_env):
    t = Transport.from_via([ssh_env.url])
    cp = t.run(ECHO_ARGV + WEIRD, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == WEIRD
    # env + cwd + stdin, all crossing the shell once
    cp = t.run([sys.executable, "-c", "import os, sys; print(os.getcwd()); print(os.environ['Q']); print(sys.stdin.read())"],
               env={"Q": "it's $HOME"}, cwd="/tmp", input="in $put 'x'", timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout.splitlines() == ["/tmp", "it's $HOME", "in $put 'x'"]
    # exit codes come back
    assert t.run(["sh", "-c", "exit 7"], timeout=60).returncode == 7


def test_ssh_chained_through_pct_and_back(ssh_env, tmp_path, monkeypatch):
    log = tmp_path / "pct.log"
    # the env var is set on the far side by the first hop's shell: give it through env of the command
    t = Transport.from_via([ssh_env.url, "pct:200"])
    cp = t.run(ECHO_ARGV + WEIRD, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == WEIRD
    # ssh -> pct -> ssh -> pct: four levels, two of them shells
    t4 = Transport.from_via([ssh_env.url, "pct:201", ssh_env.url, "pct:202"])
    cp = t4.run(["env", f"PCT_LOG={log}"] + ECHO_ARGV + WEIRD, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == WEIRD


def test_ssh_pct_hop_really_runs_pct(ssh_env, tmp_path):
    """The pct hop is really taken on the far side (the fake records its CTID)."""
    log = tmp_path / "pct.log"
    cp = Transport.from_via([ssh_env.url]).run(
        ["env", f"PCT_LOG={log}"] + Transport.from_via(["pct:200", "pct:300"]).wrap(["true"]), timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert log.read_text().split() == ["200", "300"]


def test_ssh_copy_dir_and_spawn_detached(ssh_env, tmp_path):
    src = tmp_path / "code"
    (src / "src" / "pkg").mkdir(parents=True)
    (src / "src" / "pkg" / "m.py").write_text("VALUE = 'it''s $x'\n")
    (src / "src" / "pkg" / "odd name 'q'.txt").write_text("1\n")
    dest = tmp_path / "far side" / "release"
    t = Transport.from_via([ssh_env.url, "pct:200"])
    t.copy_dir(src, str(dest))
    assert (dest / "src" / "pkg" / "m.py").read_text() == "VALUE = 'it''s $x'\n"
    assert (dest / "src" / "pkg" / "odd name 'q'.txt").exists()

    out = tmp_path / "child.json"
    log = tmp_path / "logs dir" / "child.log"
    script = ("import os, sys, json, time; time.sleep(0.5); "
              f"json.dump({{'pid': os.getpid(), 'sid': os.getsid(0), 'ppid': os.getppid(), 'arg': sys.argv[1], 'stdin': sys.stdin.read()}}, open({str(out)!r} + '.tmp', 'w')); "
              f"os.replace({str(out)!r} + '.tmp', {str(out)!r}); print('child log line', flush=True); time.sleep(1)")
    t0 = time.monotonic()
    pid = t.spawn_detached([sys.executable, "-c", script, "$a 'b'"], str(log), env={"E": "x y"}, cwd=str(tmp_path))
    spawn_s = time.monotonic() - t0
    # spawn returned before the child finished: the ssh session did not wait for it
    assert not out.exists(), f"spawn waited for the child ({spawn_s:.2f}s)"
    end = time.monotonic() + 30
    while time.monotonic() < end and not out.exists():
        time.sleep(0.05)
    info = json.loads(out.read_text())
    assert info["pid"] == pid and info["sid"] == pid
    assert info["arg"] == "$a 'b'" and info["stdin"] == ""
    end = time.monotonic() + 30
    while time.monotonic() < end and "child log line" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.05)
    assert "child log line" in log.read_text()


def test_ssh_unreachable_fails_fast(ssh_env, monkeypatch):
    monkeypatch.setenv("DFLASH_SSH_CONNECT_TIMEOUT", "3")
    port = free_port()  # nothing listens there
    t = Transport.from_via([f"ssh://{ssh_env.user}@127.0.0.1:{port}"])
    cp = t.run(["true"], timeout=60)
    assert cp.returncode == 255


def test_remote_call_runs_cli_on_far_end(ssh_env, tmp_path, capfd):
    """`dflash-train <cmd> --via ...` runs the command on the far end; the far
    side's output is printed here and its exit code returned; --via is not
    forwarded (no recursion)."""
    rc = remote_call([ssh_env.url, "pct:200"], ["--help", "--via", ssh_env.url], timeout=120)
    out = capfd.readouterr()
    assert rc == 0, out.err
    assert "deploy" in out.out and "status" in out.out
    # default far-end command (no env): dflash-train found on the far PATH
    env = dict(os.environ)
    env.pop("DFLASH_REMOTE_PYTHON", None)
    cp = subprocess.run(
        [sys.executable, "-c",
         "import sys; from dflash_train.deploy.remote import remote_run; "
         "cp = remote_run(sys.argv[1:2], ['--help'], timeout=120); print(cp.returncode); print(cp.stdout)", ssh_env.url],
        env=env, capture_output=True, text=True, timeout=180)
    assert cp.stdout.startswith("0\n") and "deploy" in cp.stdout, cp.stdout + cp.stderr
    # the far end's exit code and stderr come back
    cp = remote_run([ssh_env.url], ["no-such-command"], timeout=120)
    assert cp.returncode == 2


def test_stop_and_deploy_refuse_a_reused_pid(ssh_env, tmp_path, capfd):
    """run.json names a pid that now belongs to another process (start time
    differs): `stop --via ssh -> pct` and `deploy` both refuse; it survives."""
    import socket

    import psutil

    from dflash_train.deploy.command import deploy_command

    rd = tmp_path / "run"
    rd.mkdir()
    victim = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL)
    try:
        ct = psutil.Process(victim.pid).create_time()
        (rd / "run.json").write_text(json.dumps({
            "pid": victim.pid, "create_time": ct - 3600.0, "hostname": socket.gethostname(),
            "argv": ["dflash-train", "train", "--run-dir", str(rd)], "cwd": str(tmp_path), "live": True, "step": 7,
        }))
        rc = remote_call([ssh_env.url, "pct:200"], ["stop", str(rd), "--timeout", "5"], timeout=120)
        out = capfd.readouterr()
        assert rc == 2, out.out + out.err
        assert "reused" in (out.out + out.err)
        code_dir = Path(__file__).resolve().parents[1] / "src"
        rc = deploy_command(rd, str(code_dir), [ssh_env.url], False, True, 3, 30.0, 0.0, 10.0)
        out = capfd.readouterr()
        assert rc == 1
        rep = json.loads(out.out)
        assert rep["result"] == "failed" and "reused" in rep["message"], rep
        assert victim.poll() is None, "the unrelated process was signalled"
        assert not (rd / "releases" / "current").exists()
    finally:
        victim.kill()
        victim.wait()


def test_status_json_comes_back_through_ssh_and_pct(ssh_env, tmp_path, capfd):
    """`status RUN --json --via ssh --via pct` runs status on the far end; its
    JSON is printed here unchanged; exit 0 live / 3 not live."""
    import socket

    import psutil

    rd = tmp_path / "run dir 'q'"
    rd.mkdir()
    proc = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL)
    try:
        (rd / "run.json").write_text(json.dumps({
            "pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "hostname": socket.gethostname(),
            "argv": ["dflash-train", "train"], "live": True, "step": 42, "code_version": "abc"}))
        (rd / "metrics.jsonl").write_text(json.dumps({"step": 42, "loss": 1.5, "tokens_per_s": 99.0}) + "\n")
        rc = remote_call([ssh_env.url, "pct:200"], ["status", str(rd), "--json"], timeout=120)
        out = capfd.readouterr()
        assert rc == 0, out.err
        info = json.loads(out.out)
        assert info["live"] is True and info["step"] == 42 and info["pid"] == proc.pid and info["run_dir"] == str(rd)
        proc.kill()
        proc.wait()
        rc = remote_call([ssh_env.url], ["status", str(rd), "--json"], timeout=120)
        out = capfd.readouterr()
        assert rc == 3 and json.loads(out.out)["live"] is False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
