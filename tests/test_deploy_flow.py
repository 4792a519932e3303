"""`dflash-train deploy` end to end with the real trainer on a tiny target:
real subprocesses, real signals, real files.

Job A (module fixture `job_a`) takes three deploys that preflight must refuse
(syntax error, renamed drafter parameter, config schema change) and a dry run
through ssh + a `pct` hop; it must keep running and stepping throughout.

Job B takes a good deploy (a copy of the repo's code with a harmless change):
resumed at the stop step, the loss sequence continues exactly as in an
uninterrupted reference run started alongside; then a deploy of code that
crashes after start: rolled back, the previous release running again from
the same checkpoint. The rollbacks deploy on top of the good deploy, a class
fixture (`good_deploy`) that whichever test of job B runs first makes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sshd import LoopbackSshd, sshd_unavailable  # noqa: E402
from trainrun import REPO, env, tiny_overrides, train_cmd, wait_for  # noqa: E402

SRC_PKG = REPO / "src" / "dflash_train"
DEPLOY_TIMEOUT = 400


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run that may be writing it right now (a partial last line is skipped)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if not r.get("eval")}


def wait_step(run_dir: Path, step: int, proc: subprocess.Popen | None = None, timeout: float = 180) -> None:
    def ok():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited early with {proc.returncode}")
        return any(s >= step for s in losses(run_dir))

    wait_for(ok, timeout, what=f"step {step}")


def job_overrides(target: Path, jsonl: Path) -> list[str]:
    # effectively endless (stopped by the tests), logging every 2 steps so a
    # health check sees a fresh interval quickly; checkpoints every 25 steps
    # with keep_last=2, so retention deletes old checkpoints during a deploy
    return tiny_overrides(target, jsonl, **{
        "train.max_steps": 100000, "logging.every_steps": 2, "checkpoint.every_steps": 25,
        "checkpoint.keep_last": 2})


class Job:
    def __init__(self, run_dir: Path, overrides: list[str], log: Path, nice: int = 0) -> None:
        self.run_dir = run_dir
        self.log = log
        f = open(log, "w")
        self.proc = subprocess.Popen(train_cmd(run_dir, overrides), stdout=f, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env(), cwd=REPO,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        f.close()

    def record(self) -> dict:
        try:
            return json.loads((self.run_dir / "run.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def live(self) -> bool:
        from dflash_train.rundir import is_live

        return is_live(self.record())

    def step(self) -> int:
        ls = losses(self.run_dir)
        return max(ls) if ls else 0

    def advances(self, by: int = 4, timeout: float = 120) -> int:
        s0 = self.step()
        wait_for(lambda: self.step() >= s0 + by, timeout, what=f"{self.run_dir} to advance {by} steps past {s0}")
        return self.step()

    def stop(self) -> None:
        from dflash_train.control.commands import stop_run

        if self.live():
            stop_run(self.run_dir, timeout=60, force=True, log=lambda m: None)
        # a trainer a deploy started is not our child: never leave one running after a test
        pid = self.record().get("pid")
        if isinstance(pid, int) and pid != self.proc.pid and psutil.pid_exists(pid):
            try:
                p = psutil.Process(pid)
                if "dflash_train" in " ".join(p.cmdline()):
                    p.terminate()
                    try:
                        p.wait(60)
                    except psutil.TimeoutExpired:
                        p.kill()
            except psutil.Error:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def deploy(run_dir: Path, code, *extra: str, env_extra: dict | None = None, cwd: Path = REPO) -> tuple[int, dict, str]:
    e = env()
    e.update(env_extra or {})
    cmd = [sys.executable, "-m", "dflash_train.cli", "deploy", str(run_dir), "--code", str(code), "--json",
           "--health-steps", "3", "--health-timeout", "150", "--min-speed", "0", "--stop-timeout", "60", *extra]
    t0 = time.monotonic()
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=DEPLOY_TIMEOUT, env=e, cwd=cwd)
    try:
        report = json.loads(cp.stdout)
    except ValueError:
        raise AssertionError(f"deploy printed no JSON report (exit {cp.returncode}):\n{cp.stdout}\n{cp.stderr}")
    report["_wall_s"] = time.monotonic() - t0
    phases = " ".join(f"{p['name']}={p['seconds']:.1f}s" for p in report["phases"])
    print(f"deploy {Path(str(code)).name}: exit {cp.returncode} {report.get('result')} in {report['_wall_s']:.1f}s: {phases}")
    return cp.returncode, report, cp.stderr


def code_copy(dest: Path, edit=None) -> Path:
    """A code dir (repo layout: dest/src/dflash_train) copied from this checkout, then edited."""
    pkg = dest / "src" / "dflash_train"
    shutil.copytree(SRC_PKG, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if edit:
        edit(pkg)
    return dest


def replace_in(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}: the test's edit no longer applies"
    path.write_text(text.replace(old, new) if count < 0 else text.replace(old, new, count))


def releases(run_dir: Path) -> list[str]:
    d = run_dir / "releases"
    return sorted(p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")) if d.is_dir() else []


def proc_pythonpath(pid: int) -> str:
    env_items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for item in env_items:
        if item.startswith(b"PYTHONPATH="):
            return item.split(b"=", 1)[1].decode()
    return ""


@pytest.fixture(scope="module")
def data(tiny_target_factory, tmp_path_factory):
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("deploy")
    jsonl = write_tiny_jsonl(root / "conv.jsonl", n=40)
    return tiny_target_factory("qwen3"), jsonl, root


# --------------------------------------------------------------------------- refusals (job A)


@pytest.fixture(scope="class")
def job_a(data):
    target, jsonl, root = data
    # niced: an endless job that only has to keep stepping; at full priority it takes a core from the other tests
    job = Job(root / "job-a", job_overrides(target, jsonl), root / "job-a.out", nice=10)
    try:
        wait_step(job.run_dir, 30, job.proc, timeout=240)  # past the first checkpoint (step 25)
        yield job
    finally:
        job.stop()


def _assert_untouched(job: Job, pid: int, rep: dict) -> None:
    assert job.live() and job.record()["pid"] == pid, "the running job was touched"
    assert job.proc.poll() is None
    assert not (job.run_dir / "releases" / "current").exists(), "a refused deploy switched code"
    assert releases(job.run_dir) == [], f"refused release left behind: {releases(job.run_dir)}"
    job.advances(4)


class TestPreflightRefusals:
    """Job A: deploys that must be refused while the job keeps running."""

    def test_syntax_error_is_refused_and_job_keeps_running(self, job_a, tmp_path):
        pid = job_a.record()["pid"]
        code = code_copy(tmp_path / "syntax", lambda pkg: (pkg / "model" / "loss.py").write_text(
            (pkg / "model" / "loss.py").read_text() + "\ndef broken(:\n    pass\n"))
        rc, rep, err = deploy(job_a.run_dir, code)
        assert rc == 1 and rep["result"] == "refused", err
        check = {c["name"]: c for c in rep["preflight"]["checks"]}
        assert check["compile"]["ok"] is False and "loss.py" in check["compile"]["detail"]
        assert [p["name"] for p in rep["phases"]] == ["connect", "release", "preflight"]
        _assert_untouched(job_a, pid, rep)

    def test_renamed_parameter_is_refused(self, job_a, tmp_path):
        pid = job_a.record()["pid"]
        # the code still works, but the checkpoint's `hidden_norm.weight` no longer has a home
        code = code_copy(tmp_path / "renamed", lambda pkg: replace_in(pkg / "model" / "drafter.py", "hidden_norm", "context_norm", -1))
        rc, rep, err = deploy(job_a.run_dir, code)
        assert rc == 1 and rep["result"] == "refused", err
        check = {c["name"]: c for c in rep["preflight"]["checks"]}
        assert all(check[n]["ok"] for n in ("compile", "import", "config", "features"))
        assert check["checkpoint"]["ok"] is False
        assert "hidden_norm.weight" in check["checkpoint"]["detail"] and "context_norm.weight" in check["checkpoint"]["detail"]
        _assert_untouched(job_a, pid, rep)

    def test_config_schema_change_is_refused(self, job_a, tmp_path):
        pid = job_a.record()["pid"]
        code = code_copy(tmp_path / "schema", lambda pkg: replace_in(
            pkg / "config_sections.py", "    grad_clip: float = Field(", "    max_grad_norm: float = Field("))
        rc, rep, err = deploy(job_a.run_dir, code)
        assert rc == 1 and rep["result"] == "refused", err
        check = {c["name"]: c for c in rep["preflight"]["checks"]}
        assert check["config"]["ok"] is False and "grad_clip" in check["config"]["detail"]
        _assert_untouched(job_a, pid, rep)

    def test_changed_default_that_would_change_the_run_config_is_refused(self, job_a, tmp_path):
        """The job did not set train.grad_clip; a release that changes its default
        would silently change the running job's config on restart."""
        pid = job_a.record()["pid"]
        code = code_copy(tmp_path / "default", lambda pkg: replace_in(
            pkg / "config_sections.py", "grad_clip: float = Field(1.0,", "grad_clip: float = Field(2.0,"))
        rc, rep, err = deploy(job_a.run_dir, code)
        assert rc == 1 and rep["result"] == "refused", err
        check = {c["name"]: c for c in rep["preflight"]["checks"]}
        assert check["config"]["ok"] is False and "train.grad_clip: 1.0 -> 2.0" in check["config"]["detail"]
        _assert_untouched(job_a, pid, rep)

    @pytest.mark.skipif(sshd_unavailable() is not None, reason=str(sshd_unavailable()))
    def test_dry_run_of_a_git_ref_through_ssh_and_pct(self, job_a, tmp_path):
        """--code GIT_REF: `git archive` of the commit over ssh -> pct, preflight
        on the far end, nothing changes."""
        sshd = LoopbackSshd.start(tmp_path / "sshd", extra_path=[str(Path(sys.executable).parent)])
        try:
            pid = job_a.record()["pid"]
            repo = code_copy(tmp_path / "repo")
            git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
            subprocess.run(git + ["init", "-q"], check=True)
            subprocess.run(git + ["add", "src"], check=True)
            subprocess.run(git + ["commit", "-q", "-m", "release candidate"], check=True)
            (repo / "src" / "dflash_train" / "config.py").write_text("this is not python (uncommitted, not deployed)\n")
            rc, rep, err = deploy(job_a.run_dir, "HEAD", "--dry-run", "--via", sshd.url, "--via", "pct:200",
                                  env_extra={"DFLASH_SSH_OPTIONS": sshd.ssh_options, "DFLASH_REMOTE_PYTHON": sys.executable},
                                  cwd=repo)
            assert rc == 0 and rep["result"] == "dry_run_ok", err + json.dumps(rep, indent=1)[-3000:]
            assert rep["transport"] == f"local -> {sshd.url} -> pct:200"
            assert rep["phases"][1]["kind"] == "git" and len(rep["phases"][1]["commit"]) == 40
            assert all(c["ok"] for c in rep["preflight"]["checks"])
            _assert_untouched(job_a, pid, rep)
        finally:
            sshd.stop()


# --------------------------------------------------------------------------- deploy + rollback (job B)


@pytest.fixture(scope="class")
def job_b(data):
    target, jsonl, root = data
    ov = job_overrides(target, jsonl)
    job = Job(root / "job-b", ov, root / "job-b.out")
    # the uninterrupted reference, same arguments, started alongside
    ref = Job(root / "reference", ov, root / "reference.out", nice=10)
    state: dict = {"ref": ref}
    try:
        wait_step(job.run_dir, 30, job.proc, timeout=240)
        yield job, state
    finally:
        job.stop()
        ref.stop()


@pytest.fixture(scope="class")
def good_deploy(job_b, tmp_path_factory):
    """(pid before, (rc, report, stderr)) of job B's good deploy (a copy of the code with a harmless
    change), made once for the class by whichever test needs it first, so each test also runs alone."""
    job, _ = job_b
    old_pid = job.record()["pid"]
    code = code_copy(tmp_path_factory.mktemp("v2"), lambda pkg: (pkg / "__init__.py").write_text(
        (pkg / "__init__.py").read_text() + '\nDEPLOY_TEST_MARK = "v2"  # a harmless change\n'))
    return old_pid, deploy(job.run_dir, code)


class TestDeployAndRollback:
    """Job B, in order: a good deploy, then one that crashes after start."""

    def test_deploy_resumes_at_stop_step_and_loss_continues_exactly(self, job_b, good_deploy):
        job, state = job_b
        old_pid, (rc, rep, err) = good_deploy
        assert rc == 0 and rep["result"] == "deployed", err + json.dumps(rep, indent=1)[-4000:]
        assert [p["name"] for p in rep["phases"]] == [
            "connect", "release", "preflight", "baseline", "record", "stop", "switch", "start", "health"]
        rel = rep["release"]
        stop_step = rep["stop"]["step"]
        assert rep["stop"]["checkpoint"]["step"] == stop_step
        # releases side by side; current -> new, previous -> the recorded running code
        rd = job.run_dir
        assert os.readlink(rd / "releases" / "current") == rel
        assert os.readlink(rd / "releases" / "previous") == "initial"
        initial = json.loads((rd / "releases" / "initial" / "release.json").read_text())
        assert initial["original_command"]["argv"][1] == "train" and initial["original_command"]["cwd"] == str(REPO)
        assert (rd / "releases" / "initial" / "src" / "dflash_train" / "cli.py").is_file()
        assert "DEPLOY_TEST_MARK" in (rd / "releases" / rel / "src" / "dflash_train" / "__init__.py").read_text()
        # the new process: verified live, running the new release, resumed at the stop step
        new_pid = rep["pid"]
        assert new_pid != old_pid
        wait_for(lambda: job.live() and job.record().get("pid") == new_pid, 60, what="the new trainer's run.json")
        assert proc_pythonpath(new_pid).split(":")[0] == str(rd / "releases" / rel / "src")
        log = (rd / "logs" / f"deploy-{rel}.log").read_text()
        assert f"at step {stop_step}" in log and f"step-{stop_step:08d}" in log
        assert job.record()["code_version"].startswith("pkg-")  # not the git checkout any more
        health = rep["health"][-1]
        assert health["ok"] and health["resumed_step"] == stop_step and health["step"] >= stop_step + 3
        # the loss sequence continues exactly as the uninterrupted run's
        end = job.advances(6)
        ref = state["ref"]
        wait_step(ref.run_dir, end, ref.proc, timeout=300)
        got, want = losses(rd), losses(ref.run_dir)
        common = [s for s in sorted(got) if s <= end]
        assert common and common[-1] >= stop_step + 6 and min(common) <= stop_step - 10
        assert [got[s] for s in common] == [want[s] for s in common]  # bit for bit
        steps = [r["step"] for r in metrics(rd) if not r.get("eval")]
        assert steps == sorted(set(steps)), "metrics.jsonl has duplicate or out-of-order steps after the deploy"

    def test_crash_after_start_rolls_back_to_previous_release(self, job_b, good_deploy, tmp_path):
        """Deployed through ssh -> pct (local if no sshd): the new release crashes
        after start; rollback restarts the previous release from the same checkpoint."""
        job, state = job_b
        assert good_deploy[1][0] == 0, "the good deploy this one builds on failed"
        prev = good_deploy[1][1]["release"]
        rd = job.run_dir
        code = code_copy(tmp_path / "crash", lambda pkg: replace_in(
            pkg / "train" / "run.py", "    def _loop(self, stopper) -> int:\n",
            "    def _loop(self, stopper) -> int:\n        raise RuntimeError('deploy test: this release crashes after start')\n"))
        # through ssh -> pct when an sshd is available: the whole flow, detached starts included, over the chain
        sshd = None if sshd_unavailable() else LoopbackSshd.start(tmp_path / "sshd", extra_path=[str(Path(sys.executable).parent)])
        try:
            via = ["--via", sshd.url, "--via", "pct:200"] if sshd else []
            extra_env = {"DFLASH_SSH_OPTIONS": sshd.ssh_options, "DFLASH_REMOTE_PYTHON": sys.executable} if sshd else {}
            rc, rep, err = deploy(job.run_dir, code, *via, env_extra=extra_env)
        finally:
            if sshd:
                sshd.stop()
        assert rc == 1 and rep["result"] == "rolled_back", err + json.dumps(rep, indent=1)[-4000:]
        if sshd:
            assert rep["transport"].endswith("-> pct:200")
        names = [p["name"] for p in rep["phases"]]
        assert names[:8] == ["connect", "release", "preflight", "baseline", "stop", "switch", "start", "health"]
        assert names[8:] == ["rollback-stop", "rollback-switch", "rollback-start", "rollback-health"]
        assert "exited" in rep["failure"]
        assert rep["previous"] == prev
        stop_step = rep["stop"]["step"]
        # previous code running again, from the same checkpoint
        assert os.readlink(rd / "releases" / "current") == prev
        pid = rep["pid"]
        assert job.live() and job.record()["pid"] == pid
        assert proc_pythonpath(pid).split(":")[0] == str(rd / "releases" / prev / "src")
        rb = rep["health"][-1]
        assert rb["ok"] and rb["resumed_step"] == stop_step
        assert job.advances(4) > stop_step
        failed_log = (rd / "logs" / f"deploy-{rep['release']}.log").read_text()
        assert "this release crashes after start" in failed_log

    def test_too_slow_release_is_stopped_gracefully_and_rolled_back(self, job_b, good_deploy, tmp_path):
        """A release that runs but misses --min-speed: the live new process is
        stopped gracefully (it checkpoints), its checkpoints are moved aside,
        the previous release resumes from the deploy's stop checkpoint and
        the loss sequence is still the uninterrupted run's."""
        job, state = job_b
        assert good_deploy[1][0] == 0, "the good deploy this one builds on failed"
        rd = job.run_dir
        prev = os.readlink(rd / "releases" / "current")
        code = code_copy(tmp_path / "v3", lambda pkg: (pkg / "__init__.py").write_text(
            (pkg / "__init__.py").read_text() + '\nDEPLOY_TEST_MARK = "v3"\n'))
        # an unreachable speed bar: the health check fails at its timeout with the process alive
        rc, rep, err = deploy(rd, code, "--min-speed", "1000000", "--health-timeout", "18")
        assert rc == 1 and rep["result"] == "rolled_back", err + json.dumps(rep, indent=1)[-4000:]
        assert "below the minimum" in rep["failure"] or "not healthy" in rep["failure"], rep["failure"]
        stop_step = rep["stop"]["step"]
        rb_stop = next(p for p in rep["phases"] if p["name"] == "rollback-stop")
        assert "stopped" in rb_stop["detail"] and "killed" not in rb_stop["detail"]
        # whatever the failed release checkpointed is out of the way, the stop checkpoint is back
        # (none if it was stopped before its first step, e.g. still loading on a busy machine)
        aside = rd / "releases" / rep["release"] / "abandoned-checkpoints"
        assert all(int(p.name.split("-")[1]) > stop_step for p in (aside.iterdir() if aside.is_dir() else []))
        assert os.readlink(rd / "releases" / "current") == prev
        assert job.record()["pid"] == rep["pid"] and job.live()
        assert rep["health"][-1]["resumed_step"] == stop_step
        end = job.advances(4)
        ref = state["ref"]
        wait_step(ref.run_dir, end, ref.proc, timeout=300)
        got, want = losses(rd), losses(ref.run_dir)
        common = [s for s in sorted(got) if s <= end]
        assert common[-1] > stop_step
        assert [got[s] for s in common] == [want[s] for s in common]
