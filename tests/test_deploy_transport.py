"""Transports without a network: hop parsing, argv building for every hop kind,
the local transport end to end (run, quoting, detached start, directory copy)
and a chain through a fake `pct` on PATH."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sshd import write_fake_pct  # noqa: E402

from dflash_train.deploy.remote import _strip_via, parse_json_output, remote_cli_prefix  # noqa: E402
from dflash_train.deploy.transport import Hop, Transport, TransportError, parse_hop  # noqa: E402

WEIRD = ["a b", "it's", '"dq"', "$HOME", "${PATH}", "`id`", "$(id)", "x\ny", "\\", "*", ";ls", "", "-n", "--", "é ü"]
ECHO_ARGV = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"]


def test_parse_hops():
    assert parse_hop("ssh://root@host") == Hop("ssh", "root@host", spec="ssh://root@host")
    h = parse_hop("ssh://u@10.0.0.1:2222")
    assert (h.kind, h.target, h.port) == ("ssh", "u@10.0.0.1", 2222)
    assert parse_hop("ssh://myalias").target == "myalias"  # a Host alias from ~/.ssh/config
    assert parse_hop("ssh://u@[::1]:22").target == "u@::1"
    assert (parse_hop("pct:200").kind, parse_hop("pct:200").target) == ("pct", "200")
    assert parse_hop("docker:trainer-1").target == "trainer-1"
    k = parse_hop("kubectl:ml/train-0")
    assert (k.kind, k.namespace, k.target) == ("kubectl", "ml", "train-0")
    assert parse_hop("kubectl:train-0").namespace is None
    for bad in ["ssh://", "ssh://a b", "ssh://u@h:99999", "pct:abc", "pct:", "docker:", "docker:-x",
                "kubectl:a/b/c", "lxc:1", "host", "ssh://u@h;rm"]:
        with pytest.raises(TransportError):
            parse_hop(bad)


def test_wrap_each_hop_kind(monkeypatch):
    monkeypatch.delenv("DFLASH_SSH_OPTIONS", raising=False)
    monkeypatch.setenv("DFLASH_SSH_CONNECT_TIMEOUT", "7")
    argv = ["python3", "-c", "print('$x y')"]
    assert Transport.from_via(["pct:200"]).wrap(argv) == ["pct", "exec", "200", "--"] + argv
    assert Transport.from_via(["docker:tr"]).wrap(argv) == ["docker", "exec", "-i", "tr"] + argv
    assert Transport.from_via(["kubectl:ns/p"]).wrap(argv) == ["kubectl", "exec", "-i", "-n", "ns", "p", "--"] + argv
    ssh = Transport.from_via(["ssh://root@h:2200"]).wrap(argv)
    assert ssh[:-2] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7", "-p", "2200", "--"]
    assert ssh[-2] == "root@h" and shlex.split(ssh[-1]) == argv
    # the user's own options come through the env var, nothing else is overridden
    monkeypatch.setenv("DFLASH_SSH_OPTIONS", "-F '/my cfg' -o ProxyJump=bastion")
    ssh = Transport.from_via(["ssh://h"]).wrap(["true"])
    assert ssh == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7", "-F", "/my cfg", "-o", "ProxyJump=bastion",
                   "--", "h", "true"]


def test_nested_quoting_one_level_per_shell(monkeypatch):
    """ssh -> pct -> ssh: the inner ssh command string is quoted again by the
    outer ssh; parsing it back level by level yields the original argv."""
    monkeypatch.delenv("DFLASH_SSH_OPTIONS", raising=False)
    t = Transport.from_via(["ssh://a@h1", "pct:200", "ssh://b@h2:22"])
    full = t.wrap(["echo"] + WEIRD)
    assert full[-2] == "a@h1"
    level1 = shlex.split(full[-1])  # what h1's shell runs
    assert level1[:4] == ["pct", "exec", "200", "--"] and level1[4] == "ssh"
    assert level1[-2] == "b@h2"
    level2 = shlex.split(level1[-1])  # what h2's shell runs
    assert level2 == ["echo"] + WEIRD


def test_local_run_quoting_env_cwd(tmp_path):
    t = Transport()
    cp = t.run(ECHO_ARGV + WEIRD, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == WEIRD
    d = tmp_path / "dir with 'quote' $x"
    d.mkdir()
    cp = t.run([sys.executable, "-c", "import os; print(os.getcwd()); print(os.environ['ODD'])"],
               env={"ODD": "v a l'$x"}, cwd=str(d), timeout=30)
    assert cp.stdout.splitlines() == [str(d), "v a l'$x"]
    cp = t.run([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"], input="abc $x", timeout=30)
    assert cp.stdout.strip() == "x$ cba"
    # stdin is /dev/null when no input is given: a reader does not hang
    cp = t.run(["cat"], timeout=30)
    assert cp.returncode == 0 and cp.stdout == ""
    with pytest.raises(subprocess.TimeoutExpired):
        t.run(["sleep", "30"], timeout=0.5)


def test_chain_through_fake_pct(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    write_fake_pct(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    log = tmp_path / "pct.log"
    monkeypatch.setenv("PCT_LOG", str(log))
    t = Transport.from_via(["pct:200", "pct:201"])
    cp = t.run(ECHO_ARGV + WEIRD, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert json.loads(cp.stdout) == WEIRD
    assert log.read_text().split() == ["200", "201"]


def _wait(pred, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    return pred()


def test_local_spawn_detached_survives_and_is_detached(tmp_path):
    out = tmp_path / "out.json"
    log = tmp_path / "logs" / "x.log"
    script = (
        "import os, sys, json, time; "
        "data = sys.stdin.read(); "
        "print('hello from child', flush=True); "
        f"json.dump({{'pid': os.getpid(), 'sid': os.getsid(0), 'stdin': data, 'arg': sys.argv[1], 'env': os.environ.get('X_ENV'), 'cwd': os.getcwd()}}, open({str(out)!r}, 'w')); "
        "time.sleep(1.5)"
    )
    t = Transport()
    pid = t.spawn_detached([sys.executable, "-c", script, "a b $c"], str(log), env={"X_ENV": "1 2"}, cwd=str(tmp_path))
    assert _wait(lambda: out.exists() and out.stat().st_size > 0)
    info = json.loads(_wait(lambda: out.read_text()))
    assert info["pid"] == pid  # the pid returned is the program itself
    assert info["sid"] == pid  # its own session: no SIGHUP from ours
    assert info["stdin"] == ""  # /dev/null
    assert info["arg"] == "a b $c" and info["env"] == "1 2" and info["cwd"] == str(tmp_path)
    assert _wait(lambda: "hello from child" in log.read_text())
    # it has outlived the command that started it; now wait for its exit
    import psutil

    p = psutil.Process(pid)
    assert p.is_running()
    end = time.monotonic() + 30
    while time.monotonic() < end and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)


def test_copy_dir_local_and_through_chain(tmp_path, monkeypatch):
    src = tmp_path / "code"
    (src / "src" / "pkg").mkdir(parents=True)
    (src / "src" / "pkg" / "a.py").write_text("x = 1\n")
    (src / "src" / "pkg" / "name with space $x.txt").write_text("odd\n")
    (src / "src" / "pkg" / "__pycache__").mkdir()
    (src / "src" / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    (src / ".git").mkdir()
    (src / ".git" / "HEAD").write_text("ref")
    dest = tmp_path / "dest dir" / "rel"
    Transport().copy_dir(src, str(dest))
    assert (dest / "src" / "pkg" / "a.py").read_text() == "x = 1\n"
    assert (dest / "src" / "pkg" / "name with space $x.txt").read_text() == "odd\n"
    assert not (dest / ".git").exists() and not (dest / "src" / "pkg" / "__pycache__").exists()
    bin_dir = tmp_path / "bin"
    write_fake_pct(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    dest2 = tmp_path / "d2"
    Transport.from_via(["pct:300"]).copy_dir(src, str(dest2))
    assert (dest2 / "src" / "pkg" / "a.py").read_text() == "x = 1\n"
    with pytest.raises(TransportError):
        Transport().copy_dir(tmp_path / "missing", str(dest2))


def test_remote_helpers(monkeypatch):
    assert _strip_via(["status", "R", "--via", "ssh://h", "--via=pct:1", "--json"]) == ["status", "R", "--json"]
    assert parse_json_output('noise\n{"a": 1}\n') == {"a": 1}
    assert parse_json_output('{\n "a": [1, 2]\n}\n') == {"a": [1, 2]}
    assert parse_json_output("nothing") is None
    monkeypatch.delenv("DFLASH_REMOTE_CLI", raising=False)
    monkeypatch.setenv("DFLASH_REMOTE_PYTHON", "/opt/py/bin/python")
    assert remote_cli_prefix() == ["/opt/py/bin/python", "-m", "dflash_train.cli"]
    monkeypatch.setenv("DFLASH_REMOTE_CLI", "env PYTHONPATH='/a b' python3 -m dflash_train.cli")
    assert remote_cli_prefix() == ["env", "PYTHONPATH=/a b", "python3", "-m", "dflash_train.cli"]
