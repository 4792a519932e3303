"""Composable transports: run a command, start a detached process, copy a
directory -- locally or on the far end of a chain of hops.

A hop is one of

* ``ssh://[user@]host[:port]``  the system ``ssh`` (the user's ssh config is
  honoured; we only add ``-o BatchMode=yes -o ConnectTimeout=N``; extra options
  from the env var ``DFLASH_SSH_OPTIONS``, shell-split, e.g. ``-F ~/my_config``)
* ``pct:CTID``                  ``pct exec CTID -- argv...``   (Proxmox LXC)
* ``docker:NAME``               ``docker exec -i NAME argv...``
* ``kubectl:[NS/]POD``          ``kubectl exec -i [-n NS] POD -- argv...``

and a chain is the list of hops in the order they are crossed
(``--via ssh://root@host --via pct:200``: ssh to host, then into container
200). No hop: the local machine.

Quoting: every hop is a function argv -> argv. Hops that take an argv
(pct/docker/kubectl exec) pass it through untouched; ssh goes through the far
user's login shell, so the inner argv is joined with ``shlex.quote`` into ONE
string. Nesting wraps innermost first, so each shell level quotes exactly once
and any argument (spaces, quotes, ``$``, newlines) arrives byte-exact.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

DEFAULT_CONNECT_TIMEOUT = 10


class TransportError(Exception):
    """A hop could not be parsed or the chain failed before the command ran."""


# --------------------------------------------------------------------------- hops


@dataclass(frozen=True)
class Hop:
    kind: str  # ssh | pct | docker | kubectl
    target: str  # ssh: [user@]host ; pct: CTID ; docker: NAME ; kubectl: POD
    port: int | None = None
    namespace: str | None = None
    spec: str = ""

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The local argv that runs `argv` on the far side of this hop."""
        argv = [str(a) for a in argv]
        if not argv:
            raise TransportError("empty command")
        if self.kind == "ssh":
            cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={_connect_timeout()}"]
            cmd += shlex.split(os.environ.get("DFLASH_SSH_OPTIONS", ""))
            if self.port is not None:
                cmd += ["-p", str(self.port)]
            # "--" ends ssh's options; the remote command is one string that
            # the far user's shell parses back into exactly `argv`.
            return cmd + ["--", self.target, shlex.join(argv)]
        if self.kind == "pct":
            return ["pct", "exec", self.target, "--"] + argv
        if self.kind == "docker":
            return ["docker", "exec", "-i", self.target] + argv
        if self.kind == "kubectl":
            ns = ["-n", self.namespace] if self.namespace else []
            return ["kubectl", "exec", "-i"] + ns + [self.target, "--"] + argv
        raise TransportError(f"unknown hop kind {self.kind!r}")

    def __str__(self) -> str:
        return self.spec or f"{self.kind}:{self.target}"


def _connect_timeout() -> int:
    raw = os.environ.get("DFLASH_SSH_CONNECT_TIMEOUT", str(DEFAULT_CONNECT_TIMEOUT))
    try:
        return max(1, int(float(raw)))
    except ValueError:
        raise TransportError(f"DFLASH_SSH_CONNECT_TIMEOUT={raw!r} is not a number") from None


_SSH_RE = re.compile(
    r"^ssh://(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.\-]*)@)?"
    r"(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_][A-Za-z0-9_.\-]*)(?::(?P<port>\d+))?/?$"
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def parse_hop(spec: str) -> Hop:
    """Parse one ``--via`` value; raises TransportError with the accepted forms."""
    s = spec.strip()
    forms = "ssh://[user@]host[:port] | pct:CTID | docker:NAME | kubectl:[NS/]POD"
    if s.startswith("ssh://"):
        m = _SSH_RE.match(s)
        if not m:
            raise TransportError(f"bad ssh hop {spec!r}; expected ssh://[user@]host[:port]")
        host = m["host"].strip("[]")
        target = f"{m['user']}@{host}" if m["user"] else host
        port = int(m["port"]) if m["port"] else None
        if port is not None and not (0 < port < 65536):
            raise TransportError(f"bad ssh port in {spec!r}")
        return Hop("ssh", target, port=port, spec=s)
    kind, sep, rest = s.partition(":")
    if not sep or not rest:
        raise TransportError(f"bad hop {spec!r}; use {forms}")
    if kind == "pct":
        if not rest.isdigit():
            raise TransportError(f"bad pct hop {spec!r}; CTID must be a number")
        return Hop("pct", rest, spec=s)
    if kind == "docker":
        if not _NAME_RE.match(rest):
            raise TransportError(f"bad docker hop {spec!r}; expected docker:NAME")
        return Hop("docker", rest, spec=s)
    if kind == "kubectl":
        ns, slash, pod = rest.rpartition("/")
        if (slash and not _NAME_RE.match(ns)) or not _NAME_RE.match(pod):
            raise TransportError(f"bad kubectl hop {spec!r}; expected kubectl:[NS/]POD")
        return Hop("kubectl", pod, namespace=ns or None, spec=s)
    raise TransportError(f"unknown hop {spec!r}; use {forms}")


# --------------------------------------------------------------------------- transport

# Run a command in a directory with extra environment, without a shell-quoting
# layer of our own: "$@" keeps every argument intact.
_CD_EXEC = 'cd "$1" || exit 97; shift; exec "$@"'
# Start detached: new session (setsid), immune to SIGHUP (nohup), stdin from
# /dev/null, stdout+stderr appended to the log; print the pid and return at once.
_SPAWN = (
    'cd "$1" || exit 97; log=$2; shift 2; '
    'mkdir -p "$(dirname "$log")" || exit 98; '
    'nohup setsid "$@" </dev/null >>"$log" 2>&1 & echo "$!"'
)


@dataclass
class Transport:
    hops: list[Hop] = field(default_factory=list)

    @classmethod
    def from_via(cls, via: Iterable[str] | None) -> "Transport":
        return cls([parse_hop(v) for v in (via or [])])

    @property
    def is_local(self) -> bool:
        return not self.hops

    def describe(self) -> str:
        return " -> ".join(["local"] + [str(h) for h in self.hops])

    # -- building argvs

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The local argv that runs `argv` at the far end of the chain."""
        out = [str(a) for a in argv]
        for hop in reversed(self.hops):
            out = hop.wrap(out)
        return out

    @staticmethod
    def with_env_cwd(argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> list[str]:
        """argv that runs `argv` with extra env vars and in `cwd` (far-end paths)."""
        out = [str(a) for a in argv]
        if env:
            out = ["env"] + [f"{k}={v}" for k, v in env.items()] + out
        if cwd is not None:
            out = ["sh", "-c", _CD_EXEC, "sh", str(cwd)] + out
        return out

    # -- running

    def run(
        self,
        argv: Sequence[str],
        timeout: float | None = None,
        input: str | bytes | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run argv at the far end; captured stdout/stderr (text). stdin is
        `input` or /dev/null. Raises subprocess.TimeoutExpired on timeout
        (the local end of the chain is killed)."""
        full = self.wrap(self.with_env_cwd(argv, env, cwd))
        data = input.encode() if isinstance(input, str) else input
        proc = subprocess.run(
            full,
            input=data,
            stdin=None if data is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )
        cp = subprocess.CompletedProcess(
            proc.args, proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
        )
        if check and cp.returncode != 0:
            raise TransportError(
                f"command failed (exit {cp.returncode}) via {self.describe()}: {shlex.join(argv)}\n{_tail(cp.stderr)}"
            )
        return cp

    def spawn_detached(
        self,
        argv: Sequence[str],
        log_path: str,
        env: dict[str, str] | None = None,
        cwd: str = "/",
        timeout: float = 60.0,
    ) -> int:
        """Start argv at the far end so that it outlives this command (and the
        ssh session): setsid + nohup, stdin /dev/null, output appended to
        `log_path`. Returns the far-end pid of the started program."""
        inner = self.with_env_cwd(argv, env, None)
        cmd = ["sh", "-c", _SPAWN, "sh", str(cwd), str(log_path)] + inner
        cp = self.run(cmd, timeout=timeout)
        out = cp.stdout.strip().splitlines()
        if cp.returncode != 0 or not out or not out[-1].strip().isdigit():
            raise TransportError(
                f"could not start detached process via {self.describe()} (exit {cp.returncode}): {_tail(cp.stderr)}"
            )
        return int(out[-1])

    def copy_dir(
        self,
        src: str | Path,
        dest: str,
        excludes: Sequence[str] = (".git", ".venv", "__pycache__", "*.pyc", "runs", ".cache", ".pytest_cache", "*.egg-info"),
        timeout: float = 600.0,
    ) -> None:
        """Copy the CONTENTS of local directory `src` into far-end `dest`
        (created): ``tar c | <chain> tar x -C dest``."""
        src = Path(src)
        if not src.is_dir():
            raise TransportError(f"not a directory: {src}")
        producer = ["tar", "-C", str(src), "-cf", "-"] + [f"--exclude={e}" for e in excludes] + ["."]
        self.send_tar(producer, dest, timeout=timeout)

    def send_tar(self, producer: Sequence[str], dest: str, timeout: float = 600.0, cwd: str | None = None) -> None:
        """Pipe the tar stream written by the local command `producer` into
        ``tar x -C dest`` at the far end."""
        consumer = self.wrap(["sh", "-c", 'mkdir -p "$1" && exec tar -xf - -C "$1"', "sh", dest])
        p1 = subprocess.Popen(list(producer), stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=cwd)
        try:
            p2 = subprocess.run(consumer, stdin=p1.stdout, capture_output=True, timeout=timeout)
        finally:
            assert p1.stdout is not None
            p1.stdout.close()
            try:
                p1_err = p1.communicate(timeout=30)[1]
            except subprocess.TimeoutExpired:
                p1.kill()
                p1_err = p1.communicate()[1]
        if p1.returncode != 0:
            raise TransportError(f"{shlex.join(producer)} failed (exit {p1.returncode}): {_tail(p1_err.decode(errors='replace'))}")
        if p2.returncode != 0:
            raise TransportError(
                f"tar extract into {dest} via {self.describe()} failed (exit {p2.returncode}): {_tail(p2.stderr.decode(errors='replace'))}"
            )


def _tail(text: str, n: int = 2000) -> str:
    text = (text or "").strip()
    return text if len(text) <= n else "..." + text[-n:]
