"""The code side of a deploy (mixed into deploy/command.py's Deployer): the new code made
a release on the job's host (a directory copied, or `git archive` of a ref), the running
code recorded as a release the first time, and the command line, environment and
PYTHONPATH a release is started with."""
from __future__ import annotations

import os
import shlex
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from dflash_train import rundir
from dflash_train.deploy.transport import TransportError

CODE_EXCLUDES = ("__pycache__", "*.pyc", "*.pyo")


class DeployError(Exception):
    """A phase failed; the message is the one-line reason."""


class ReleaseSteps:
    """Needs from the Deployer: agent(), phase(), cleanup(), t (the transport), code, info,
    job, record, python, cwd, train_args, run_dir, owner, release_id."""

    def _releases(self) -> Path:
        return rundir.RunDir(self.run_dir).releases

    def _release_src(self, release_id: str) -> str:
        return str(rundir.RunDir(self.run_dir).release(release_id) / "src")

    def _materialize(self) -> tuple[str, dict]:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        src = Path(self.code).expanduser()
        if src.is_dir():
            pkg = _find_package(src)
            digest = _tree_hash(pkg)
            rid = _unique_id(f"{stamp}-{digest[:10]}", self.info)
            dest = f"{self._release_src(rid)}/dflash_train"
            try:
                self.t.copy_dir(pkg, dest, excludes=CODE_EXCLUDES)
            except TransportError as e:
                raise DeployError(f"copying {pkg} to the job's host failed: {e}") from None
            meta = {"source": str(pkg.resolve()), "kind": "dir", "code_version": f"tree-{digest[:12]}"}
        else:
            repo = _git_toplevel(Path.cwd())
            if repo is None:
                raise DeployError(f"--code {self.code!r}: not a directory, and {Path.cwd()} is not in a git repository")
            r = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{self.code}^{{commit}}"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise DeployError(f"--code {self.code!r}: neither a directory nor a git ref of {repo}")
            commit = r.stdout.strip()
            rid = _unique_id(f"{stamp}-{commit[:10]}", self.info)
            dest = str(rundir.RunDir(self.run_dir).release(rid))
            try:
                self.t.send_tar(["git", "-C", str(repo), "archive", "--format=tar", commit, "src/dflash_train"], dest)
            except TransportError as e:
                raise DeployError(f"git archive {commit[:12]} to the job's host failed: {e}") from None
            meta = {"source": f"git:{repo}@{self.code}", "kind": "git", "code_version": commit[:12], "commit": commit}
        meta["deployed_by"] = self.owner
        meta["command"] = self._command(rid, None)
        res = self.agent("write-release", id=rid, meta=meta)
        if not res.get("ok"):
            raise DeployError(res.get("error", "release write failed"))
        return rid, meta

    def _release_env(self, release_id: str) -> dict[str, str]:
        env = dict(self.job.get("env") or {})
        base = [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep)
                if p and not p.startswith(f"{self._releases()}/")]
        env["PYTHONPATH"] = os.pathsep.join([self._release_src(release_id)] + base)
        return env

    def _train_argv(self, resume: str | None) -> list[str]:
        args: list[str] = []
        skip = False
        for a in self.train_args:
            if skip:
                skip = False
                continue
            if a == "--resume":
                skip = True
                continue
            if a.startswith("--resume="):
                continue
            args.append(a)
        if resume:
            args += ["--resume", resume]
        return [self.python, "-m", "dflash_train.cli"] + args

    def _command(self, release_id: str, resume: str | None) -> dict:
        env = self._release_env(release_id)
        argv = self._train_argv(resume)
        shell = f"cd {shlex.quote(self.cwd)} && env " + " ".join(
            shlex.quote(f"{k}={v}") for k, v in sorted(env.items())) + " " + shlex.join(argv)
        return {"python": self.python, "argv": argv, "cwd": self.cwd, "env": env, "shell": shell}

    def _drop_release(self) -> None:
        self.cleanup("remove-release", f"{rundir.RunDir(self.run_dir).release(self.release_id)} is left on disk (remove it by hand)",
                     id=self.release_id)

    def _ensure_running_release(self) -> str:
        """Id of the release the running job runs; recorded (snapshot) if unknown."""
        rels = self.info.get("releases") or {}
        cur = rels.get("current")
        pp = (self.job.get("env") or {}).get("PYTHONPATH", "")
        first = pp.split(os.pathsep)[0] if pp else ""
        if cur and first == self._release_src(cur):
            return cur
        t0 = time.monotonic()
        rid = "initial" if "initial" not in (rels.get("list") or []) else _unique_id(
            "running-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"), self.info)
        original = {
            "python": self.python, "argv": self.record.get("argv"), "cmdline": self.job.get("cmdline"),
            "cwd": self.cwd, "env": self.job.get("env"), "code_version": self.record.get("code_version"),
            "shell": f"cd {shlex.quote(self.cwd)} && "
                     + (f"env {shlex.quote('PYTHONPATH=' + pp)} " if pp else "")
                     + shlex.join(self.job.get("cmdline") or []),
        }
        meta = {"kind": "running", "code_version": self.record.get("code_version"), "original_command": original,
                "command": self._command(rid, None)}
        res = self.agent("record-running", _timeout=300, id=rid, python=self.python, cwd=self.cwd,
                         env=self.job.get("env") or {}, meta=meta)
        if not res.get("ok"):
            raise DeployError(f"could not record the running code as release {rid}: {res.get('error')}")
        sw = self.agent("switch", id=rid)
        if not sw.get("ok"):
            raise DeployError(f"could not point releases/current at {rid}: {sw.get('error')}")
        self.phase("record", True, f"running code ({res.get('package')}, {self.record.get('code_version')}) "
                   f"recorded as release {rid}; original command: {original['shell']}", t0)
        return rid


def _find_package(src: Path) -> Path:
    for cand in (src / "src" / "dflash_train", src / "dflash_train", src):
        if (cand / "__init__.py").is_file() and cand.name == "dflash_train":
            return cand
    raise DeployError(f"--code {src}: no dflash_train package in it (looked for src/dflash_train, dflash_train, or the dir itself)")


def _tree_hash(pkg: Path) -> str:
    files = [p for p in sorted(pkg.rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")]
    return rundir.sha256_tree(pkg, files)


def _unique_id(base: str, info: dict) -> str:
    existing = set((info.get("releases") or {}).get("list") or [])
    rid, n = base, 1
    while rid in existing:
        n += 1
        rid = f"{base}-{n}"
    return rid


def _git_toplevel(path: Path) -> Path | None:
    r = subprocess.run(["git", "-C", str(path), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    return Path(r.stdout.strip()) if r.returncode == 0 else None
