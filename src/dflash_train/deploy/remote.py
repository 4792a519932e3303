"""Run a `dflash-train` subcommand on the far end of a `--via` chain.

The far end has dflash-train installed. What to run there, first match wins:

* env ``DFLASH_REMOTE_CLI``: the full command prefix, shell-split
  (e.g. ``/opt/venv/bin/dflash-train`` or ``env PYTHONPATH=/x python3 -m dflash_train.cli``)
* env ``DFLASH_REMOTE_PYTHON`` / ``remote_python=``: ``PY -m dflash_train.cli``
* default: ``dflash-train`` if it is on the far end's PATH, else
  ``python3 -m dflash_train.cli``.

The far side prints its answer (``status --json`` prints JSON); we print it
locally unchanged and return its exit code. ``--via`` is never forwarded.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any, Sequence

from dflash_train.deploy.transport import Transport, TransportError

_DEFAULT_CLI = [
    "sh",
    "-c",
    'if command -v dflash-train >/dev/null 2>&1; then exec dflash-train "$@"; '
    'else exec python3 -m dflash_train.cli "$@"; fi',
    "dflash-train",
]


def remote_cli_prefix(remote_python: str | None = None) -> list[str]:
    if os.environ.get("DFLASH_REMOTE_CLI"):
        return shlex.split(os.environ["DFLASH_REMOTE_CLI"])
    py = remote_python or os.environ.get("DFLASH_REMOTE_PYTHON")
    if py:
        return [py, "-m", "dflash_train.cli"]
    return list(_DEFAULT_CLI)


def _strip_via(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--via":
            skip = True
            continue
        if a.startswith("--via="):
            continue
        out.append(str(a))
    return out


def remote_run(via: Sequence[str], subcommand_argv: Sequence[str], timeout: float | None = None,
               remote_python: str | None = None):
    """CompletedProcess of `dflash-train <subcommand_argv>` on the far end."""
    t = Transport.from_via(via)
    argv = remote_cli_prefix(remote_python) + _strip_via(subcommand_argv)
    return t.run(argv, timeout=timeout)


def remote_call(via: Sequence[str], subcommand_argv: Sequence[str], timeout: float | None = None,
                remote_python: str | None = None) -> int:
    """Run `dflash-train <subcommand_argv>` on the far end, print its stdout to
    our stdout and its stderr to our stderr, return its exit code.
    Transport failures (ssh cannot connect: exit 255) come back as exit 255
    with a line naming the chain."""
    t = Transport.from_via(via)
    try:
        cp = remote_run(via, subcommand_argv, timeout=timeout, remote_python=remote_python)
    except TransportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # TimeoutExpired, OSError (ssh/pct not installed)
        print(f"error: remote {subcommand_argv[0] if subcommand_argv else ''} via {t.describe()} failed: {e}", file=sys.stderr)
        return 255
    if cp.stdout:
        sys.stdout.write(cp.stdout)
        sys.stdout.flush()
    if cp.stderr:
        sys.stderr.write(cp.stderr)
        sys.stderr.flush()
    if cp.returncode == 255 and any(h.kind == "ssh" for h in t.hops):
        print(f"error: ssh hop failed via {t.describe()} (exit 255)", file=sys.stderr)
    return cp.returncode


def remote_json(via: Sequence[str], subcommand_argv: Sequence[str], timeout: float | None = None,
                remote_python: str | None = None) -> tuple[int, Any]:
    """(exit code, parsed JSON of the last JSON line/object on stdout or None)."""
    cp = remote_run(via, subcommand_argv, timeout=timeout, remote_python=remote_python)
    return cp.returncode, parse_json_output(cp.stdout)


def parse_json_output(text: str) -> Any:
    text = (text or "").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") or line.startswith("["):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None
