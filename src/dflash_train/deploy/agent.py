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
verification, metrics tail, atomic writes) is dflash_train/rundir.py, standard
library only: `deploy` sends its source with this script (deploy/command.py,
`shipped_script`), so the agent, `status`, `stop` and resume share one
definition. Liveness: the pid exists, is not a zombie, and its start time
equals run.json's create_time within 1 s; a reused pid is NOT the trainer. A
record from another host is refused (deploy must reach the job's own host
through --via).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

try:  # installed by deploy's bootstrap (deploy/command.py: shipped_script) on the far end
    rundir = sys.modules["dflash_train_shipped_rundir"]
except KeyError:  # imported from the package (tests, the deployer itself)
    from dflash_train import rundir

def liveness(record: dict | None) -> tuple[bool, str]:
    """The run-dir protocol's liveness; a record from another host is never acted on here."""
    return rundir.liveness(record, other_host="refuse")


RELEASES = "releases"
CURRENT = "current"
PREVIOUS = "previous"
RELEASE_FILE = "release.json"
LOCK_FILE = ".deploy.lock"
ENV_PREFIXES = ("CUDA_", "NCCL_", "OMP_", "MKL_", "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                "DFLASH_", "NVIDIA_", "XLA_", "TRITON_")
ENV_NAMES = ("PYTHONPATH", "PATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "HOME", "LANG", "LC_ALL", "TMPDIR",
             "PYTHONHASHSEED", "PYTHONUNBUFFERED")
SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY$|^KEY", re.I)
RESUMED_RE = re.compile(r"resumed from (.+?) at step (\d+)")


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


def releases_state(run_dir: Path) -> dict:
    rel = run_dir / RELEASES
    out: dict = {"dir": str(rel), "current": None, "previous": None, "list": []}
    for name in (CURRENT, PREVIOUS):
        try:
            out[name] = os.readlink(rel / name)
        except OSError:
            pass
    if rel.is_dir():
        for p in sorted(rel.iterdir()):
            if p.is_dir() and not p.is_symlink() and (p / RELEASE_FILE).exists():
                out["list"].append(p.name)
    if out["current"]:
        out["current_release"] = rundir.read_json(rel / out["current"] / RELEASE_FILE)
    return out


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
        "releases": releases_state(run_dir),
        "config_exists": (run_dir / "config.yaml").is_file(),
    }
    if live:
        out["job"] = job_process(record["pid"])
    return out


def op_lock(a) -> dict:
    rel = Path(a.run_dir) / RELEASES
    rel.mkdir(parents=True, exist_ok=True)
    lock = rel / LOCK_FILE
    owner = json.loads(a.owner)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = rundir.read_json(lock) or {}
            stale = False
            if held.get("hostname") == owner.get("hostname") and isinstance(held.get("pid"), int):
                stale = not rundir.pid_alive(held["pid"])
            elif time.time() - float(held.get("time", 0) or 0) > 6 * 3600:
                stale = True
            if stale:
                try:
                    os.unlink(lock)
                except FileNotFoundError:
                    pass
                continue
            return {"ok": False, "error": f"another deploy holds {lock}: {json.dumps(held)}"}
        with os.fdopen(fd, "w") as f:
            json.dump(dict(owner, time=time.time()), f)
        return {"ok": True}
    return {"ok": False, "error": f"could not take {lock}"}


def op_unlock(a) -> dict:
    lock = Path(a.run_dir) / RELEASES / LOCK_FILE
    held = rundir.read_json(lock) or {}
    owner = json.loads(a.owner)
    if held and (held.get("hostname"), held.get("pid")) != (owner.get("hostname"), owner.get("pid")):
        return {"ok": False, "error": "lock is held by someone else"}
    try:
        os.unlink(lock)
    except FileNotFoundError:
        pass
    return {"ok": True}


def op_record_running(a) -> dict:
    """Snapshot the package the running job imports (found by asking its own
    interpreter, with its env and cwd) into releases/ID/src/dflash_train."""
    import subprocess

    run_dir = Path(a.run_dir)
    dest = run_dir / RELEASES / a.id
    env = dict(os.environ)
    env.update(json.loads(a.env))
    cp = subprocess.run(
        [a.python, "-c", "import os, dflash_train; print(os.path.dirname(os.path.abspath(dflash_train.__file__)))"],
        cwd=a.cwd, env=env, capture_output=True, text=True, timeout=120,
    )
    if cp.returncode != 0:
        return {"ok": False, "error": f"cannot locate the running code with {a.python}: {cp.stderr.strip()[-1000:]}"}
    pkg = Path(cp.stdout.strip().splitlines()[-1])
    tmp = run_dir / RELEASES / f".tmp-{a.id}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(pkg, tmp / "src" / "dflash_train", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    meta = json.loads(a.meta)
    meta.update({"id": a.id, "created_at": rundir.now_iso(), "snapshot_of": str(pkg)})
    rundir.atomic_write_text(tmp / RELEASE_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    os.rename(tmp, dest)
    rundir.fsync_dir(dest.parent)
    return {"ok": True, "path": str(dest), "package": str(pkg)}


def op_write_release(a) -> dict:
    dest = Path(a.run_dir) / RELEASES / a.id
    if not (dest / "src" / "dflash_train").is_dir():
        return {"ok": False, "error": f"{dest}/src/dflash_train missing after the copy"}
    meta = json.loads(a.meta)
    meta.update({"id": a.id, "created_at": rundir.now_iso()})
    rundir.atomic_write_text(dest / RELEASE_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return {"ok": True, "path": str(dest)}


def op_switch(a) -> dict:
    rel = Path(a.run_dir) / RELEASES
    if not (rel / a.id / RELEASE_FILE).exists():
        return {"ok": False, "error": f"release {a.id} not found under {rel}"}
    try:
        old = os.readlink(rel / CURRENT)
    except OSError:
        old = None
    rundir.set_link(rel, CURRENT, a.id)
    if old and old != a.id:
        rundir.set_link(rel, PREVIOUS, old)
    return {"ok": True, "current": a.id, "was": old}


def op_stop(a) -> dict:
    run_dir = Path(a.run_dir)
    record = rundir.read_record(run_dir)
    if a.create_time is not None and a.pid and (record or {}).get("pid") != a.pid:
        # a process we started that has not (yet) taken run.json: verify it by
        # the start time we saw right after starting it
        info = rundir.proc_info(a.pid)
        if info is None or info["zombie"]:
            return {"ok": True, "stopped": True, "pid": a.pid, "already_exited": True, "problems": []}
        if abs(info["create_time"] - a.create_time) > rundir.START_TIME_TOLERANCE_S:
            return {"ok": False, "stopped": False, "refused": True,
                    "error": f"pid {a.pid} was reused by another process: not stopping it"}
        record = {"pid": a.pid, "create_time": info["create_time"]}
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
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM if a.signal == "TERM" else signal.SIGINT)
    killed = False
    while rundir.pid_alive(pid):
        if time.monotonic() - t0 > a.timeout:
            if not a.force:
                return {"ok": False, "stopped": False, "pid": pid,
                        "error": f"pid {pid} did not stop within {a.timeout:g}s (signal sent; it may still stop later)"}
            os.kill(pid, signal.SIGKILL)
            killed = True
            end = time.monotonic() + 30
            while rundir.pid_alive(pid) and time.monotonic() < end:
                time.sleep(0.05)
            break
        time.sleep(0.05)
    seconds = time.monotonic() - t0
    after = rundir.read_record(run_dir) or {}
    step = after.get("step")
    ck = latest_checkpoint(run_dir)
    out = {"ok": True, "stopped": True, "pid": pid, "killed": killed, "seconds": round(seconds, 3),
           "step": step, "record_live": after.get("live"), "checkpoint": ck}
    problems = []
    if killed:
        problems.append(f"pid {pid} was killed (SIGKILL): no checkpoint at the stop step")
    if after.get("live"):
        problems.append("run.json still says live=true after the process ended (it did not exit cleanly)")
    if ck is None:
        problems.append("no checkpoint after the stop")
    elif isinstance(step, int) and ck["step"] != step:
        problems.append(f"latest checkpoint is step {ck['step']} but the run stopped at step {step}")
    elif ck is not None:
        problems += rundir.verify_checkpoint(Path(ck["path"]))
    out["problems"] = problems
    out["ok"] = not problems
    return out


def op_remove_release(a) -> dict:
    rel = Path(a.run_dir) / RELEASES
    st = releases_state(Path(a.run_dir))
    if a.id in (st.get("current"), st.get("previous")) or "/" in a.id or a.id.startswith("."):
        return {"ok": False, "error": f"refusing to remove release {a.id} (current/previous or bad id)"}
    try:
        shutil.rmtree(rel / a.id)
    except FileNotFoundError:
        pass
    except OSError as e:
        return {"ok": False, "error": f"cannot remove {rel / a.id}: {e}"}
    return {"ok": True}


def op_history(a) -> dict:
    """Append one line (the deploy's summary) to releases/history.jsonl."""
    rel = Path(a.run_dir) / RELEASES
    rel.mkdir(parents=True, exist_ok=True)
    line = json.dumps(dict(json.loads(a.entry), at=rundir.now_iso()), default=str)
    with open(rel / "history.jsonl", "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    return {"ok": True}


def op_prune(a) -> dict:
    """Bound the disk used by releases: the preserved stop checkpoint and the
    abandoned checkpoints of every release but `current` are removed (they
    only serve the rollback of the latest deploy; hard links cost nothing
    until retention deletes the originals), and beyond the newest `keep`
    releases the oldest are removed (never current, previous or initial).
    `spare` (the release just deployed or rolled back) keeps everything, so a
    failed release's abandoned checkpoints stay for inspection until the next deploy."""
    rel = Path(a.run_dir) / RELEASES
    st = releases_state(Path(a.run_dir))
    protected = {st.get("current"), st.get("previous"), "initial"}
    removed, failed = [], []

    def remove(path: Path, label: str) -> None:
        try:
            shutil.rmtree(path)
            removed.append(label)
        except OSError as e:
            failed.append(f"{label}: {e}")

    for name in st["list"]:
        if name in (st.get("current"), a.spare):
            continue
        for sub in ("stop-checkpoint", "abandoned-checkpoints"):
            if (rel / name / sub).exists():
                remove(rel / name / sub, f"{name}/{sub}")
    by_age = sorted(st["list"], key=lambda n: (rel / n / RELEASE_FILE).stat().st_mtime)
    for name in by_age[: max(0, len(by_age) - a.keep)]:
        if name not in protected and name != a.spare:
            remove(rel / name, name)
    out = {"ok": not failed, "removed": removed}
    if failed:
        out["error"] = "could not remove " + "; ".join(failed)
    return out


def op_preserve(a) -> dict:
    src = Path(a.run_dir) / "checkpoints" / f"step-{a.step:08d}"
    dest = Path(a.run_dir) / RELEASES / a.id / "stop-checkpoint" / src.name
    if not src.is_dir():
        return {"ok": False, "error": f"{src} missing"}
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, dest / f.name)
        except OSError:
            shutil.copy2(f, dest / f.name)
    return {"ok": True, "path": str(dest)}


def op_restore_timeline(a) -> dict:
    run_dir = Path(a.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    moved = []
    aside = run_dir / RELEASES / a.id / "abandoned-checkpoints"
    for s, p in rundir.list_checkpoints(ckpt_dir):
        if s > a.step:
            aside.mkdir(parents=True, exist_ok=True)
            os.rename(p, aside / p.name)
            moved.append(p.name)
    target = ckpt_dir / f"step-{a.step:08d}"
    restored = False
    if not target.is_dir():
        keep = run_dir / RELEASES / a.id / "stop-checkpoint" / target.name
        if not keep.is_dir():
            return {"ok": False, "error": f"{target} is gone and no preserved copy at {keep}", "moved": moved}
        tmp = ckpt_dir / f".tmp-restore-{target.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in keep.iterdir():
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
        rundir.fsync_dir(tmp)
        os.rename(tmp, target)
        restored = True
    rundir.set_link(ckpt_dir, "latest", target.name)
    problems = rundir.verify_checkpoint(target)
    return {"ok": not problems, "moved": moved, "restored": restored, "path": str(target), "problems": problems}


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


def _resumed_step(log_paths: list[Path], since_bytes: dict) -> int | None:
    for p in log_paths:
        try:
            with open(p, "rb") as f:
                f.seek(since_bytes.get(str(p), 0))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        found = RESUMED_RE.findall(text)
        if found:
            return int(found[-1][1])
    return None


def op_health(a) -> dict:
    """Poll until healthy, failed, or timeout."""
    run_dir = Path(a.run_dir)
    logs = [Path(a.log), run_dir / "logs" / "train.log"]
    since = json.loads(a.log_offsets) if a.log_offsets else {}
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
        if resumed is None:
            resumed = _resumed_step(logs, since)
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
    for p in [Path(a.log), Path(a.run_dir) / "logs" / "train.log"]:
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
    add("lock", op_lock, ("--owner", {"required": True}))
    add("unlock", op_unlock, ("--owner", {"required": True}))
    add("record-running", op_record_running, ("--id", {"required": True}), ("--python", {"required": True}),
        ("--cwd", {"required": True}), ("--env", {"default": "{}"}), ("--meta", {"default": "{}"}))
    add("write-release", op_write_release, ("--id", {"required": True}), ("--meta", {"default": "{}"}))
    add("switch", op_switch, ("--id", {"required": True}))
    add("stop", op_stop, ("--timeout", {"type": float, "default": 120.0}), ("--force", {"action": "store_true"}),
        ("--pid", {"type": int, "default": 0}), ("--signal", {"default": "INT"}),
        ("--create-time", {"type": float, "default": None}))
    p = sub.add_parser("proc")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--run-dir", default=None)
    p.set_defaults(fn=lambda a: {"ok": True, "pid": a.pid, "proc": rundir.proc_info(a.pid)})
    add("remove-release", op_remove_release, ("--id", {"required": True}))
    add("preserve", op_preserve, ("--id", {"required": True}), ("--step", {"type": int, "required": True}))
    add("restore-timeline", op_restore_timeline, ("--id", {"required": True}), ("--step", {"type": int, "required": True}))
    add("health", op_health, ("--pid", {"type": int, "required": True}), ("--from-step", {"type": int, "required": True}),
        ("--steps", {"type": int, "default": 3}), ("--timeout", {"type": float, "default": 300.0}),
        ("--min-tps", {"type": float, "default": 0.0}), ("--log", {"required": True}),
        ("--log-offsets", {"default": ""}), ("--poll", {"type": float, "default": 0.2}))
    add("prune", op_prune, ("--keep", {"type": int, "default": 10}), ("--spare", {"default": None}))
    add("history", op_history, ("--entry", {"required": True}))
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
