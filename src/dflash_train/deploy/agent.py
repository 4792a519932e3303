"""Far-end helper for `dflash-train deploy`: one small, self-contained script.

It is sent over the transport chain on stdin (``python - OP --args ...``) and
runs on the job's host, so it imports nothing from the dflash_train installed
there (the far end may run another version of it, or the new code under test):
only the standard library (psutil if present, for the exact process start
time) and the rundir module shipped with it.
Every op prints one JSON object on stdout; exit code 0 unless the op itself
could not run (bad arguments).

Ops::

    info     --run-dir R                   run.json + verified liveness, the job's interpreter/cwd/env,
                                           metrics tail, latest checkpoint, releases
    lock / unlock --run-dir R --owner S    one deploy at a time per run dir
    record-running --run-dir R --id ID --python PY --cwd D --env JSON --argv JSON
                                           snapshot the running job's package into releases/ID
    write-release --run-dir R --id ID --meta JSON
    switch   --run-dir R --id ID           releases/current -> ID (temp link + os.replace), previous kept
    stop     --run-dir R --timeout T [--force] [--pid P]
                                           SIGINT the verified pid, poll, confirm the checkpoint at the stop step
    preserve --run-dir R --id ID --step S  hard-link copy of checkpoints/step-S into releases/ID/
    restore-timeline --run-dir R --id ID --step S
                                           after a failed new release: newer step dirs moved aside,
                                           step-S back in place, latest -> step-S
    health   --run-dir R --pid P --from-step S --steps K --timeout T --min-tps X --log L
                                           wait until the new process is verified live, resumed at S,
                                           advanced K steps with finite loss and tok/s >= X

The run-dir protocol (run.json and liveness, checkpoint layout / latest /
verification, stop-and-confirm, metrics tail, atomic writes) is the package
dflash_train/rundir, standard library only: `deploy` sends its source with this
script and deploy/releases.py (the releases ops) (deploy/command.py,
`shipped_script`), so the agent, `status`, `stop` and resume share one
definition. Liveness: the pid exists, is not a zombie, and its start time
equals run.json's create_time within rundir.START_TIME_TOLERANCE_S; a reused
pid is NOT the trainer. A record from another host is refused (deploy must
reach the job's own host through --via). The health check reads the step the
new process resumed at from run.json (``resumed_step``, written by the trainer).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

try:  # installed by deploy's bootstrap (deploy/command.py: shipped_script) on the far end
    rundir = sys.modules["dflash_train_shipped_rundir"]
    releases = sys.modules["dflash_train_shipped_releases"]
except KeyError:  # imported from the package (tests, the deployer itself)
    from dflash_train import rundir
    from dflash_train.deploy import releases

def liveness(record: dict | None) -> tuple[bool, str]:
    """The run-dir protocol's liveness; a record from another host is never acted on here."""
    return rundir.liveness(record, other_host="refuse")


ENV_PREFIXES = ("CUDA_", "NCCL_", "OMP_", "MKL_", "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                "DFLASH_", "NVIDIA_", "XLA_", "TRITON_")
ENV_NAMES = ("PYTHONPATH", "PATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "HOME", "LANG", "LC_ALL", "TMPDIR",
             "PYTHONHASHSEED", "PYTHONUNBUFFERED")
SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY$|^KEY", re.I)


# --------------------------------------------------------------------------- processes


def job_process(pid: int) -> dict:
    """Interpreter, argv, cwd and (filtered) environment of a live pid, from /proc."""
    out: dict = {"pid": pid}
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        out["cmdline"] = [c.decode(errors="surrogateescape") for c in cmd if c != b""]
    except OSError as e:
        out["cmdline_error"] = str(e)
    try:
        out["cwd"] = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        pass
    try:
        out["exe"] = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        pass
    env: dict = {}
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            k, sep, v = item.decode(errors="surrogateescape").partition("=")
            if sep:
                env[k] = v
        out["env_readable"] = True
    except OSError:
        out["env_readable"] = False
    out["env"] = {k: v for k, v in env.items() if keep_env(k)}
    # started by torchrun / a launcher with several ranks: one restarted process would not be the same job
    ws = env.get("WORLD_SIZE")
    out["distributed"] = bool(env.get("TORCHELASTIC_RUN_ID") or (ws and ws != "1"))
    # the interpreter as it was invoked (a venv's bin/python, NOT the resolved exe)
    py = None
    cmdline = out.get("cmdline") or []
    if cmdline:
        first = cmdline[0]
        if os.sep in first:
            py = first if os.path.isabs(first) else os.path.normpath(os.path.join(out.get("cwd", "/"), first))
        else:
            for d in env.get("PATH", os.environ.get("PATH", "")).split(os.pathsep):
                cand = os.path.join(d, first)
                if d and os.access(cand, os.X_OK):
                    py = cand
                    break
        if py and not re.search(r"python[0-9.]*$", os.path.basename(py)):
            py = None  # started through a wrapper we cannot re-run faithfully
    out["python"] = py or out.get("exe")
    return out


def keep_env(name: str) -> bool:
    if SECRET_RE.search(name):
        return False
    return name in ENV_NAMES or name.startswith(ENV_PREFIXES)


# --------------------------------------------------------------------------- run dir


def latest_checkpoint(run_dir: Path) -> dict | None:
    p = rundir.latest_checkpoint(run_dir)
    return None if p is None else {"step": rundir.parse_step(p.name), "path": str(p.resolve())}


def metrics_tail(run_dir: Path, n: int) -> list[dict]:
    """The last `n` training lines of metrics.jsonl (eval lines left out)."""
    return rundir.last_metrics(run_dir, n, evals=False)


# --------------------------------------------------------------------------- ops


def op_info(a) -> dict:
    run_dir = Path(a.run_dir).expanduser()
    if not run_dir.is_dir():
        return {"ok": False, "error": f"run dir {run_dir} does not exist on {socket.gethostname()}"}
    run_dir = run_dir.resolve()
    record = rundir.read_record(run_dir)
    live, why = liveness(record)
    out = {
        "ok": True,
        "hostname": socket.gethostname(),
        "run_dir": str(run_dir),
        "record": record,
        "live": live,
        "why": why,
        "metrics": metrics_tail(run_dir, a.metrics),
        "latest_checkpoint": latest_checkpoint(run_dir),
        "releases": releases.releases_state(run_dir),
        "config_exists": rundir.RunDir(run_dir).config.is_file(),
    }
    if live:
        out["job"] = job_process(record["pid"])
    return out


def op_stop(a) -> dict:
    """rundir's stop-and-confirm of the verified trainer (or of a process we started that has
    not taken run.json yet, verified by the start time we saw right after starting it)."""
    run_dir = Path(a.run_dir)
    record = rundir.read_record(run_dir)
    if a.create_time is not None and a.pid and (record or {}).get("pid") != a.pid:
        record = {"pid": a.pid, "create_time": a.create_time}
    else:
        live, why = liveness(record)
        if not live:
            if a.pid and (record or {}).get("pid") == a.pid and not rundir.pid_alive(a.pid):
                return {"ok": True, "stopped": True, "pid": a.pid, "already_exited": True, "problems": []}
            return {"ok": False, "stopped": False, "error": f"not stopping: {why}", "refused": True}
    pid = record["pid"]
    if a.pid and pid != a.pid:
        return {"ok": False, "stopped": False, "refused": True,
                "error": f"run.json names pid {pid}, expected {a.pid}: not stopping someone else's process"}
    res = rundir.stop_and_confirm(run_dir, pid, record.get("create_time"), rundir.parse_signal(a.signal) or
                                  rundir.SIGNALS["INT"], a.timeout, force=a.force)
    if res.already_exited:
        return {"ok": True, "stopped": True, "pid": pid, "already_exited": True, "problems": []}
    if res.refused:
        return {"ok": False, "stopped": False, "refused": True, "error": f"{res.refused}: not stopping it"}
    if not res.exited:
        return {"ok": False, "stopped": False, "pid": pid,
                "error": f"pid {pid} did not stop within {a.timeout:g}s (signal sent; it may still stop later)"}
    ck = res.checkpoint
    return {"ok": res.confirmed, "stopped": True, "pid": pid, "killed": res.killed, "seconds": round(res.waited_s, 3),
            "step": res.step, "record_live": res.record_live, "problems": res.problems,
            "checkpoint": None if ck is None else {"step": res.checkpoint_step, "path": str(ck.resolve())}}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _log_tail(paths: list[Path], n: int = 3000) -> str:
    out = []
    for p in paths:
        try:
            with open(p, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                out.append(f"--- {p}\n" + f.read().decode(errors="replace"))
        except OSError:
            pass
    return "\n".join(out)


def op_health(a) -> dict:
    """Poll until healthy, failed, or timeout."""
    run_dir = Path(a.run_dir)
    logs = [Path(a.log), rundir.RunDir(run_dir).train_log()]
    t0 = time.monotonic()
    seen_live = False
    resumed = None
    last_step = None
    verdict = None
    while True:
        record = rundir.read_record(run_dir) or {}
        ours = record.get("pid") == a.pid
        alive = rundir.pid_alive(a.pid)
        if ours:
            live, why = liveness(record)
            seen_live = seen_live or live
            if isinstance(record.get("step"), int):
                last_step = record["step"]
            if isinstance(record.get("resumed_step"), int):  # the trainer records where it resumed
                resumed = record["resumed_step"]
        new = [m for m in metrics_tail(run_dir, 200) if isinstance(m.get("step"), int) and m["step"] > a.from_step]
        bad = [m for m in new if not _finite(m.get("loss"))]
        if resumed is not None and resumed != a.from_step:
            verdict = (False, f"the new process resumed at step {resumed}, expected {a.from_step}")
        elif bad:
            verdict = (False, f"non-finite loss {bad[0].get('loss')!r} at step {bad[0].get('step')}")
        elif ours and isinstance(last_step, int) and last_step >= a.from_step + a.steps and new and seen_live:
            tps = new[-1].get("tokens_per_s")
            if a.min_tps > 0 and not (_finite(tps) and tps >= a.min_tps):
                if not alive or time.monotonic() - t0 > a.timeout:
                    verdict = (False, f"tokens/s {tps} below the minimum {a.min_tps:.1f} (min_speed x baseline)")
            else:
                verdict = (True, f"live (pid {a.pid} verified), resumed at step {a.from_step if resumed is None else resumed}, "
                                 f"advanced to step {last_step}, loss {new[-1].get('loss')}, tokens/s {tps}")
        if verdict is None and not alive:
            verdict = (False, f"the new process (pid {a.pid}) exited"
                              + (f" at step {last_step}" if last_step is not None else " before reporting a step")
                              + ("" if seen_live else " without ever being verified live in run.json"))
        if verdict is None and time.monotonic() - t0 > a.timeout:
            verdict = (False, f"not healthy within {a.timeout:g}s: live={seen_live and alive}, step {last_step} "
                              f"(need {a.from_step + a.steps}), {len(new)} metrics lines after step {a.from_step}")
        if verdict is not None:
            break
        time.sleep(a.poll)
    ok, msg = verdict
    out = {"ok": ok, "message": msg, "seconds": round(time.monotonic() - t0, 3), "step": last_step,
           "resumed_step": resumed, "alive": rundir.pid_alive(a.pid),
           "metrics": [m for m in metrics_tail(run_dir, 200) if isinstance(m.get("step"), int) and m["step"] > a.from_step][-5:]}
    if not ok:
        out["log_tail"] = _log_tail(logs)
    return out


def op_log_offsets(a) -> dict:
    out = {}
    for p in [Path(a.log), rundir.RunDir(a.run_dir).train_log()]:
        try:
            out[str(p)] = p.stat().st_size
        except OSError:
            out[str(p)] = 0
    return {"ok": True, "offsets": out}


def op_baseline(a) -> dict:
    ms = [m for m in metrics_tail(Path(a.run_dir), 200) if isinstance(m.get("step"), int)]
    if a.upto is not None:
        ms = [m for m in ms if m["step"] <= a.upto]
    last = ms[-a.n:]
    tps = [m["tokens_per_s"] for m in last if _finite(m.get("tokens_per_s"))]
    return {"ok": True, "intervals": len(last), "tokens_per_s": statistics.median(tps) if tps else None,
            "loss": last[-1].get("loss") if last else None, "step": last[-1]["step"] if last else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-deploy-agent")
    sub = ap.add_subparsers(dest="op", required=True)

    def add(name, fn, *args):
        p = sub.add_parser(name)
        p.add_argument("--run-dir", required=True)
        for spec in args:
            flag, kw = spec
            p.add_argument(flag, **kw)
        p.set_defaults(fn=fn)
        return p

    add("info", op_info, ("--metrics", {"type": int, "default": 20}))
    add("lock", releases.op_lock, ("--owner", {"required": True}))
    add("unlock", releases.op_unlock, ("--owner", {"required": True}))
    add("record-running", releases.op_record_running, ("--id", {"required": True}), ("--python", {"required": True}),
        ("--cwd", {"required": True}), ("--env", {"default": "{}"}), ("--meta", {"default": "{}"}))
    add("write-release", releases.op_write_release, ("--id", {"required": True}), ("--meta", {"default": "{}"}))
    add("switch", releases.op_switch, ("--id", {"required": True}))
    add("stop", op_stop, ("--timeout", {"type": float, "default": 120.0}), ("--force", {"action": "store_true"}),
        ("--pid", {"type": int, "default": 0}), ("--signal", {"default": "INT"}),
        ("--create-time", {"type": float, "default": None}))
    p = sub.add_parser("proc")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--run-dir", default=None)
    p.set_defaults(fn=lambda a: {"ok": True, "pid": a.pid, "proc": rundir.proc_info(a.pid)})
    add("remove-release", releases.op_remove_release, ("--id", {"required": True}))
    add("preserve", releases.op_preserve, ("--id", {"required": True}), ("--step", {"type": int, "required": True}))
    add("restore-timeline", releases.op_restore_timeline, ("--id", {"required": True}), ("--step", {"type": int, "required": True}))
    add("health", op_health, ("--pid", {"type": int, "required": True}), ("--from-step", {"type": int, "required": True}),
        ("--steps", {"type": int, "default": 3}), ("--timeout", {"type": float, "default": 300.0}),
        ("--min-tps", {"type": float, "default": 0.0}), ("--log", {"required": True}),
        ("--log-offsets", {"default": ""}), ("--poll", {"type": float, "default": 0.2}))
    add("prune", releases.op_prune, ("--keep", {"type": int, "default": 10}), ("--spare", {"default": None}))
    add("history", releases.op_history, ("--entry", {"required": True}))
    add("log-offsets", op_log_offsets, ("--log", {"required": True}))
    add("baseline", op_baseline, ("--n", {"type": int, "default": 3}), ("--upto", {"type": int, "default": None}))
    a = ap.parse_args(argv)
    try:
        out = a.fn(a)
    except Exception as e:  # noqa: BLE001 - reported as JSON to the deployer
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(out, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
