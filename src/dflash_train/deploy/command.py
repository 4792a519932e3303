"""`dflash-train deploy RUN_DIR --code DIR|GIT_REF [--via HOP ...]`: swap the code
of a running training job safely.

Phases (one timestamped line each; ``--json`` prints a report object at the end):

0. connect     read the run on the job's host (run.json, verified pid, the job's
               interpreter / argv / cwd / env, metrics, latest checkpoint)
1. release     the new code -> RUN_DIR/releases/<id>/src/dflash_train (tar over
               the chain for a directory, `git archive` for a git ref)
   preflight   in the new code's interpreter ON THE JOB'S HOST while the job
               keeps running: compile, import, config vs new schema, feature
               probes, strict checkpoint load into the new drafter
               (deploy/preflight.py). Any failure: refused, exit 1, job untouched.
               ``--dry-run`` stops here.
2. baseline    tokens/s (median of the last 3 logged intervals) and loss
3. stop        graceful stop of the verified pid (SIGINT, poll), confirm the
               checkpoint at the stop step (verified); it is also hard-linked
               into releases/<id>/stop-checkpoint/ so a rollback can use it
               even after the new code's checkpoint retention removed it
4. switch      releases/current -> <id> (temp symlink + os.replace); the first
               deploy first records the running code as release ``initial``
               (a snapshot of its package + the exact command line and env)
5. start       detached (setsid/nohup) on the job's host:
               ``cd CWD && env PYTHONPATH=<release>/src:... PY -m dflash_train.cli
               train <the job's own arguments> --resume <stop checkpoint>``,
               output to RUN_DIR/logs/deploy-<id>.log
6. health      within --health-timeout: run.json names the new pid and it is
               verified live, it resumed at the stop step, advanced
               --health-steps steps, every new logged loss is finite and the
               last logged tokens/s >= --min-speed x baseline
7. rollback    on any failure after the stop: stop the new process (SIGINT,
               SIGKILL only after --stop-timeout), switch `current` back, put
               the stop checkpoint back as `latest` (newer ones moved to
               releases/<id>/abandoned-checkpoints/), restart the previous
               release from it and check that it advances. Exit 1.

Exit codes: 0 deployed (or dry run passed), 1 refused / failed / rolled back,
2 user error (bad --via, missing run dir...).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from dflash_train import rundir
from dflash_train.deploy.releases import LOCK_FILE
from dflash_train.deploy.releasing import DeployError, ReleaseSteps
from dflash_train.deploy.remote import parse_json_output
from dflash_train.deploy.shipping import AGENT_SRC, PREFLIGHT_SRC
from dflash_train.deploy.transport import Transport, TransportError

KEEP_RELEASES = int(os.environ.get("DFLASH_DEPLOY_KEEP_RELEASES", "10"))


def _ts() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Deployer(ReleaseSteps):
    def __init__(self, run_dir: str | Path, code: str, via: Sequence[str], dry_run: bool = False, as_json: bool = False,
                 health_steps: int = 3, health_timeout: float = 300.0, min_speed: float = 0.5,
                 stop_timeout: float = 120.0, out=None) -> None:
        self.run_dir_arg = str(run_dir)
        self.code = code
        self.via = list(via or [])
        self.dry_run = dry_run
        self.as_json = as_json
        self.health_steps = int(health_steps)
        self.health_timeout = float(health_timeout)
        self.min_speed = float(min_speed)
        self.stop_timeout = float(stop_timeout)
        self.out = out or (sys.stderr if as_json else sys.stdout)
        self.t = Transport.from_via(self.via)
        self.agent_python = os.environ.get("DFLASH_REMOTE_PYTHON") or (sys.executable if self.t.is_local else "python3")
        self.owner = {"hostname": socket.gethostname(), "pid": os.getpid()}
        self.report: dict[str, Any] = {
            "ok": False, "result": None, "run_dir": self.run_dir_arg, "code": code, "via": self.via,
            "transport": self.t.describe(), "dry_run": dry_run, "phases": [],
        }
        self._phase_t0 = time.monotonic()
        self._t0 = time.monotonic()
        self.locked = False

    # ------------------------------------------------------------------ output

    def line(self, phase: str, msg: str) -> None:
        print(f"[{_ts()}] {phase}: {msg}", file=self.out, flush=True)

    def cleanup(self, op: str, consequence: str, **kw: Any) -> dict | None:
        """An agent op after the outcome is decided (history, prune, unlock, removing a
        release): a failure does not change the result, but it is said, with what it leaves
        behind, on the output and in the report's ``warnings``."""
        try:
            res = self.agent(op, **kw)
            err = None if res.get("ok") else res.get("error", "failed")
        except DeployError as e:
            res, err = None, str(e)
        if err is not None:
            msg = f"{op} failed: {err}; {consequence}"
            self.report.setdefault("warnings", []).append(msg)
            self.line("warning", msg)
            return None
        return res

    def phase(self, name: str, ok: bool, detail: str, t0: float, **extra: Any) -> None:
        sec = round(time.monotonic() - t0, 3)
        self.report["phases"].append({"name": name, "ok": ok, "seconds": sec, "detail": detail, **extra})
        self.line(name, f"{'ok' if ok else 'FAILED'} ({sec:.2f}s) {detail}")

    # ------------------------------------------------------------------ far end

    def agent(self, op: str, _timeout: float = 120.0, **kw: Any) -> dict:
        argv = [self.agent_python, "-", op, "--run-dir", self.run_dir]
        for k, v in kw.items():
            if v is None or v is False:
                continue
            flag = "--" + k.replace("_", "-")
            if v is True:
                argv.append(flag)
            else:
                argv += [flag, v if isinstance(v, str) else (json.dumps(v) if isinstance(v, (dict, list)) else str(v))]
        try:
            cp = self.t.run(argv, timeout=_timeout, input=AGENT_SRC)
        except subprocess.TimeoutExpired:
            raise DeployError(f"agent {op} via {self.t.describe()} timed out after {_timeout:g}s") from None
        except OSError as e:
            raise DeployError(f"cannot run the transport ({self.t.describe()}): {e}") from None
        res = parse_json_output(cp.stdout)
        if not isinstance(res, dict):
            hint = " (ssh could not connect)" if cp.returncode == 255 else ""
            raise DeployError(f"agent {op} via {self.t.describe()} failed{hint} (exit {cp.returncode}): "
                              f"{(cp.stderr or cp.stdout).strip()[-800:]}")
        return res

    # ------------------------------------------------------------------ main flow

    def run(self) -> int:
        self.run_dir = self.run_dir_arg
        try:
            rc = self._run()
        except DeployError as e:
            self.report["message"] = str(e)
            if not self.report.get("result"):
                self.report["result"] = "failed"
            self.line("deploy", f"FAILED: {e}")
            rc = 1
        except KeyboardInterrupt:
            last = self.report["phases"][-1]["name"] if self.report["phases"] else "connect"
            self.report.update(result="interrupted", message=(
                f"interrupted after phase '{last}': check the job with `dflash-train status {self.run_dir}` "
                f"(releases/current says which code a restart uses)"))
            self.line("deploy", self.report["message"])
            rc = 130
        finally:
            if self.locked and not self.dry_run and self.report.get("release"):
                entry = {k: self.report.get(k) for k in ("result", "release", "previous", "message", "pid")}
                entry["phases"] = {p["name"]: p["seconds"] for p in self.report["phases"]}
                entry["code"] = self.code
                self.cleanup("history", "this deploy is missing from releases/history.jsonl", entry=entry)
            if self.locked and self.report.get("result") in ("deployed", "rolled_back"):
                pr = self.cleanup("prune", f"old releases under {self.run_dir}/releases were not all removed",
                                  keep=KEEP_RELEASES, spare=self.report.get("release"))
                if pr and pr.get("removed"):
                    self.line("prune", f"removed {', '.join(pr['removed'])}")
            if self.locked:
                self.cleanup("unlock", f"{self._releases() / LOCK_FILE} is still held: other deploys of this "
                                       "run dir are refused until it is removed by hand (or 6 h pass)", owner=self.owner)
        self.report["exit_code"] = rc
        self.report["seconds"] = round(time.monotonic() - self._t0, 3)
        if self.as_json:
            print(json.dumps(self.report, indent=2, default=str), flush=True)
        return rc

    def _run(self) -> int:
        # ---- 0. connect
        t0 = time.monotonic()
        info = self.agent("info", _timeout=120)
        if not info.get("ok"):
            raise DeployError(info.get("error", "cannot read the run"))
        self.run_dir = info["run_dir"]  # absolute, on the far end
        self.info = info
        rec = info.get("record") or {}
        if not info.get("live"):
            self.phase("connect", False, f"no running job in {self.run_dir}: {info.get('why')}", t0)
            raise DeployError(f"nothing to deploy to: {info.get('why')} (deploy swaps the code of a RUNNING job; "
                              f"start it with `dflash-train train --run-dir {self.run_dir}`)")
        job = info.get("job") or {}
        argv = rec.get("argv") or []
        if "train" not in argv[1:2]:
            raise DeployError(f"run.json argv {argv!r} is not a `dflash-train train` command line; cannot restart it")
        if job.get("distributed"):
            raise DeployError(f"pid {rec.get('pid')} is one rank of a torchrun / multi-process job: "
                              "deploy restarts single-process jobs only (stop it and relaunch with torchrun)")
        if not job.get("python"):
            raise DeployError(f"cannot tell which Python runs pid {rec.get('pid')} (no /proc access?)")
        if not job.get("env_readable"):
            self.line("connect", f"warning: cannot read the environment of pid {rec.get('pid')}; restarting with this shell's")
        self.job = job
        self.record = rec
        self.python = job["python"]
        self.cwd = rec.get("cwd") or job.get("cwd") or "/"
        self.train_args = list(argv[1:])
        self.stop_ckpt_step: int | None = None
        self.new_pid: int | None = None
        self.new_ct: float | None = None
        self.phase("connect", True, f"{self.t.describe()}: pid {rec.get('pid')} live on {info['hostname']} at step "
                   f"{rec.get('step')}, python {self.python}, code {rec.get('code_version')}", t0)
        lock = self.agent("lock", owner=self.owner)
        if not lock.get("ok"):
            raise DeployError(lock.get("error"))
        self.locked = True

        # ---- 1. release + preflight
        t0 = time.monotonic()
        self.release_id, meta = self._materialize()
        self.rel_dir = str(rundir.RunDir(self.run_dir).release(self.release_id))
        self.report["release"] = self.release_id
        self.phase("release", True, f"{self.code} -> {self.rel_dir}", t0, **meta)
        t0 = time.monotonic()
        verdict = self._preflight(self.release_id)
        self.report["preflight"] = verdict
        failed = [c for c in verdict.get("checks", []) if not c.get("ok")]
        if not verdict.get("ok"):
            why = "; ".join(f"{c['name']}: {c['detail']}" for c in failed) or verdict.get("error", "preflight failed")
            self.phase("preflight", False, why, t0)
            self._drop_release()
            self.report["result"] = "refused"
            self.report["message"] = f"preflight refused the new code, the running job was not touched: {why}"
            self.line("deploy", f"REFUSED: {self.report['message']}")
            return 1
        self.phase("preflight", True, ", ".join(f"{c['name']} ok" for c in verdict.get("checks", [])), t0)
        if self.dry_run:
            self._drop_release()
            self.report.update(ok=True, result="dry_run_ok", message="preflight passed (dry run: nothing changed)")
            self.line("deploy", "dry run: preflight passed, nothing changed")
            return 0

        # ---- 2. baseline
        t0 = time.monotonic()
        base = self.agent("baseline", n=3)
        self.baseline = base
        self.report["baseline"] = {k: base.get(k) for k in ("tokens_per_s", "loss", "step", "intervals")}
        self.phase("baseline", True, f"tokens/s {base.get('tokens_per_s')}, loss {base.get('loss')} "
                   f"(last {base.get('intervals')} intervals, up to step {base.get('step')})", t0)

        # bookkeeping: the running code becomes a release (first deploy)
        self.prev_id = self._ensure_running_release()
        self.report["previous"] = self.prev_id

        # ---- 3. stop
        t0 = time.monotonic()
        st = self.agent("stop", _timeout=self.stop_timeout + 120, pid=rec["pid"], timeout=self.stop_timeout)
        if not st.get("stopped"):
            self.phase("stop", False, st.get("error", "stop failed"), t0)
            self.report["result"] = "failed"
            raise DeployError(f"the job did not stop: {st.get('error')}; code not switched")
        ck = st.get("checkpoint") or {}
        self.stop_ckpt_step = ck.get("step")
        self.report["stop"] = {k: st.get(k) for k in ("step", "seconds", "checkpoint", "problems", "killed")}
        if not st.get("ok"):
            self.phase("stop", False, "; ".join(st.get("problems") or []), t0)
            return self._rollback("the stop did not end with a verified checkpoint at the stop step: "
                                  + "; ".join(st.get("problems") or []), started_new=False)
        self.phase("stop", True, f"pid {rec['pid']} stopped at step {st.get('step')} in {st.get('seconds')}s, "
                   f"checkpoint {ck.get('path')} verified", t0)
        # from here on the old job is stopped: any failure, including a broken
        # transport, ends in a rollback (which restarts the previous release)
        try:
            return self._switch_start_health()
        except DeployError as e:
            return self._rollback(str(e), started_new=self.new_pid is not None)

    def _switch_start_health(self) -> int:
        pres = self.agent("preserve", id=self.release_id, step=self.stop_ckpt_step)
        if not pres.get("ok"):
            self.line("stop", f"warning: could not preserve the stop checkpoint: {pres.get('error')}")

        # ---- 4. switch
        t0 = time.monotonic()
        sw = self.agent("switch", id=self.release_id)
        if not sw.get("ok"):
            self.phase("switch", False, sw.get("error", "switch failed"), t0)
            return self._rollback(f"switch failed: {sw.get('error')}", started_new=False)
        self.phase("switch", True, f"releases/current -> {self.release_id} (was {sw.get('was')})", t0)

        # ---- 5. start + 6. health
        try:
            self.new_pid, self.new_ct = self._start(self.release_id, "start")
        except DeployError as e:
            return self._rollback(str(e), started_new=False)
        ok, msg = self._health("health", self.new_pid, self.release_id,
                               min_tps=self._min_tps())
        if not ok:
            return self._rollback(msg, started_new=True)
        self.report.update(ok=True, result="deployed", pid=self.new_pid,
                           message=f"release {self.release_id} running (pid {self.new_pid}) from step {self.stop_ckpt_step}")
        self.line("deploy", f"DONE: {self.report['message']}; previous release {self.prev_id} kept for rollback")
        return 0

    # ------------------------------------------------------------------ pieces

    def _min_tps(self) -> float:
        b = self.baseline.get("tokens_per_s") if getattr(self, "baseline", None) else None
        if not b or self.min_speed <= 0:
            return 0.0
        return float(b) * self.min_speed

    def _preflight(self, release_id: str) -> dict:
        env = self._release_env(release_id)
        argv = [self.python, "-", "--release-src", self._release_src(release_id), "--run-dir", self.run_dir,
                "--train-args", json.dumps(self._train_argv(None)[4:])]
        try:
            cp = self.t.run(argv, timeout=900, input=PREFLIGHT_SRC, env=env, cwd=self.cwd)
        except subprocess.TimeoutExpired:
            return {"ok": False, "checks": [{"name": "preflight", "ok": False, "detail": "timed out after 900s"}]}
        res = parse_json_output(cp.stdout)
        if not isinstance(res, dict):
            return {"ok": False, "checks": [{"name": "preflight", "ok": False,
                                             "detail": f"no verdict (exit {cp.returncode}): {(cp.stderr or cp.stdout).strip()[-800:]}"}]}
        return res

    def _start(self, release_id: str, phase: str) -> tuple[int, float | None]:
        t0 = time.monotonic()
        rd = rundir.RunDir(self.run_dir)
        ck = str(rd.checkpoint(self.stop_ckpt_step)) if self.stop_ckpt_step is not None else None
        cmd = self._command(release_id, ck)
        log = str(rd.deploy_log(release_id))
        offs = self.agent("log-offsets", log=log)
        self._log_offsets = offs.get("offsets") or {}
        self._log = log
        try:
            pid = self.t.spawn_detached(cmd["argv"], log, env=cmd["env"], cwd=cmd["cwd"])
        except (TransportError, subprocess.TimeoutExpired, OSError) as e:
            self.phase(phase, False, f"could not start release {release_id}: {e}", t0)
            raise DeployError(f"could not start release {release_id}: {e}") from None
        pr = self.agent("proc", pid=pid).get("proc") or {}
        self.phase(phase, True, f"release {release_id} started, pid {pid}, log {log}: {cmd['shell']}", t0,
                   pid=pid, command=cmd["shell"])
        return pid, pr.get("create_time")

    def _health(self, phase: str, pid: int, release_id: str, min_tps: float) -> tuple[bool, str]:
        t0 = time.monotonic()
        res = self.agent("health", _timeout=self.health_timeout + 120, pid=pid, from_step=self.stop_ckpt_step or 0,
                         steps=self.health_steps, min_tps=min_tps, log=self._log,
                         log_offsets=self._log_offsets, timeout=self.health_timeout)
        self.report.setdefault("health", []).append({k: res.get(k) for k in ("ok", "message", "seconds", "step", "resumed_step", "metrics")})
        if res.get("ok"):
            self.phase(phase, True, res.get("message", ""), t0)
            return True, res.get("message", "")
        msg = res.get("message") or res.get("error") or "health check failed"
        self.phase(phase, False, msg, t0, log_tail=(res.get("log_tail") or "")[-3000:])
        tail = (res.get("log_tail") or "").strip().splitlines()[-15:]
        if tail:
            print("\n".join("    | " + l for l in tail), file=self.out, flush=True)
        return False, msg

    def _rollback(self, reason: str, started_new: bool) -> int:
        self.report["failure"] = reason
        self.line("rollback", f"deploy failed ({reason}); rolling back to release {self.prev_id}")
        t0 = time.monotonic()
        try:
            if started_new:
                st = self.agent("stop", _timeout=self.stop_timeout + 120, pid=self.new_pid, force=True,
                                create_time=self.new_ct, timeout=self.stop_timeout)
                if not st.get("stopped"):
                    raise DeployError(f"could not stop the new process {self.new_pid}: {st.get('error')}")
                how = "had already exited" if st.get("already_exited") else ("killed" if st.get("killed") else "stopped")
                self.phase("rollback-stop", True, f"new process {self.new_pid} {how}", t0)
            t0 = time.monotonic()
            sw = self.agent("switch", id=self.prev_id)
            if not sw.get("ok"):
                raise DeployError(f"switch back failed: {sw.get('error')}")
            if self.stop_ckpt_step is None:
                raise DeployError("no checkpoint step to restart from")
            tl = self.agent("restore-timeline", id=self.release_id, step=self.stop_ckpt_step)
            if not tl.get("ok"):
                raise DeployError(f"could not restore checkpoint step {self.stop_ckpt_step}: {tl.get('error') or tl.get('problems')}")
            moved = f", moved aside {tl.get('moved')}" if tl.get("moved") else ""
            self.phase("rollback-switch", True, f"releases/current -> {self.prev_id}, latest -> step {self.stop_ckpt_step}{moved}", t0)
            pid, _ = self._start(self.prev_id, "rollback-start")
            ok, msg = self._health("rollback-health", pid, self.prev_id, min_tps=0.0)
            if not ok:
                raise DeployError(f"the previous release did not come back healthy: {msg}")
        except DeployError as e:
            self.report.update(ok=False, result="rollback_failed",
                               message=f"DEPLOY FAILED ({reason}) AND ROLLBACK FAILED: {e}. The job may not be running; "
                                       f"inspect with `dflash-train status {self.run_dir}`; restart command: "
                                       f"{self._command(self.prev_id, None)['shell']}")
            self.line("deploy", self.report["message"])
            return 1
        self.report.update(ok=False, result="rolled_back", pid=pid,
                           message=f"deploy of {self.release_id} failed ({reason}); rolled back: release {self.prev_id} "
                                   f"running again (pid {pid}) from step {self.stop_ckpt_step}")
        self.line("deploy", f"ROLLED BACK: {self.report['message']}")
        return 1


# --------------------------------------------------------------------------- helpers


def deploy_command(run_dir: Path, code: str, via: list[str], dry_run: bool, as_json: bool, health_steps: int,
                   health_timeout: float, min_speed: float, stop_timeout: float) -> int:
    """Entry point of `dflash-train deploy` (see the module docstring). Returns the exit code."""
    try:
        d = Deployer(run_dir, code, via, dry_run, as_json, health_steps, health_timeout, min_speed, stop_timeout)
    except TransportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return d.run()
