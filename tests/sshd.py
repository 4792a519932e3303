"""A real OpenSSH server on 127.0.0.1 for the deploy/transport tests.

`LoopbackSshd.start(tmpdir)` generates a host key, a client key (put into an
authorized_keys file), an sshd config (`UsePAM no`, `StrictModes no`, key auth
only, listening on a free loopback port) and a client ssh config that trusts
exactly that host key; it starts `/usr/sbin/sshd -D -e -f <config>` and waits
until a real `ssh ... true` works. The client config is handed to our
transport the way a user would: `DFLASH_SSH_OPTIONS="-F <client config>"`.

Also writes a fake `pct` on the session PATH of the server: `pct exec CTID --
argv...` execs argv locally (records CTID in $PCT_LOG if set), so chains like
`--via ssh://root@127.0.0.1:PORT --via pct:200` can be exercised.

The server binary comes from .ci/setup_sshd.sh (apt-get install openssh-server);
`sshd_unavailable()` says why the tests must be skipped when it is missing.
"""
from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash_train.engine.local_servers import free_port

SSHD = "/usr/sbin/sshd"

FAKE_PCT = r"""#!/bin/sh
# test stand-in for Proxmox `pct exec CTID -- argv...`: runs argv here.
if [ "$1" != exec ]; then echo "fake pct: only 'exec' is supported" >&2; exit 2; fi
ctid=$2
case "$ctid" in ''|*[!0-9]*) echo "fake pct: bad CTID '$ctid'" >&2; exit 2;; esac
if [ "$3" != "--" ]; then echo "fake pct: expected -- after CTID" >&2; exit 2; fi
shift 3
if [ -n "$PCT_LOG" ]; then echo "$ctid" >> "$PCT_LOG"; fi
exec "$@"
"""


def sshd_unavailable() -> str | None:
    if not os.path.exists(SSHD):
        return f"{SSHD} not installed (run .ci/setup_sshd.sh: apt-get install openssh-server)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "ssh / ssh-keygen client not installed"
    if os.geteuid() != 0:
        return "the loopback sshd test server needs root (it logs in as the current user via sshd privilege separation)"
    return None


def write_fake_pct(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    p = bin_dir / "pct"
    p.write_text(FAKE_PCT)
    p.chmod(0o755)
    return p


class LoopbackSshd:
    def __init__(self, root: Path, port: int, proc: subprocess.Popen, client_config: Path, bin_dir: Path, user: str):
        self.root = root
        self.port = port
        self.proc = proc
        self.client_config = client_config
        self.bin_dir = bin_dir
        self.user = user

    @property
    def url(self) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}"

    @property
    def ssh_options(self) -> str:
        return f"-F {self.client_config}"

    @classmethod
    def start(cls, root: Path, extra_path: list[str] | None = None, timeout: float = 20.0) -> "LoopbackSshd":
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        user = getpass.getuser()
        bin_dir = root / "bin"
        write_fake_pct(bin_dir)
        host_key = root / "ssh_host_ed25519_key"
        client_key = root / "id_ed25519"
        for k in (host_key, client_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dflash-test", "-f", str(k)], check=True)
        auth = root / "authorized_keys"
        auth.write_text(client_key.with_suffix(".pub").read_text())
        auth.chmod(0o600)
        port = free_port()
        # privilege separation directory required by sshd
        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
        session_path = ":".join([str(bin_dir)] + (extra_path or []) + ["/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"])
        cfg = root / "sshd_config"
        cfg.write_text(
            "\n".join(
                [
                    f"Port {port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {host_key}",
                    f"PidFile {root / 'sshd.pid'}",
                    f"AuthorizedKeysFile {auth}",
                    "UsePAM no",
                    "StrictModes no",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PubkeyAuthentication yes",
                    "PermitRootLogin prohibit-password",
                    f"AllowUsers {user}",
                    "X11Forwarding no",
                    "AllowTcpForwarding no",
                    "PrintMotd no",
                    "LogLevel ERROR",
                    "MaxStartups 50:30:100",
                    "MaxSessions 50",
                    f"SetEnv PATH={session_path}",
                    "",
                ]
            )
        )
        known = root / "known_hosts"
        known.write_text(f"[127.0.0.1]:{port} " + " ".join(host_key.with_suffix(".pub").read_text().split()[:2]) + "\n")
        client_cfg = root / "ssh_config"
        client_cfg.write_text(
            "\n".join(
                [
                    "Host *",
                    f"  IdentityFile {client_key}",
                    "  IdentitiesOnly yes",
                    f"  UserKnownHostsFile {known}",
                    "  GlobalKnownHostsFile /dev/null",
                    "  StrictHostKeyChecking yes",
                    "  LogLevel ERROR",
                    "",
                ]
            )
        )
        test = subprocess.run([SSHD, "-t", "-f", str(cfg)], capture_output=True, text=True)
        if test.returncode != 0:
            raise RuntimeError(f"sshd -t rejected the generated config: {test.stderr}")
        log = open(root / "sshd.log", "ab")
        proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self = cls(root, port, proc, client_cfg, bin_dir, user)
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {proc.returncode}: {(root / 'sshd.log').read_text()[-2000:]}")
            r = subprocess.run(
                ["ssh", "-F", str(client_cfg), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-p", str(port),
                 f"{user}@127.0.0.1", "true"],
                capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30,
            )
            if r.returncode == 0:
                return self
            last = r.stderr
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"sshd on port {port} did not accept a login within {timeout}s: {last}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


if __name__ == "__main__":  # manual check: python tests/sshd.py /tmp/x
    import tempfile

    d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    s = LoopbackSshd.start(d)
    print(s.url, s.ssh_options)
    try:
        s.proc.wait()
    except KeyboardInterrupt:
        s.stop()
