"""The far-end agent's operations on RUN_DIR/releases (deploy/agent.py dispatches them):
one deploy at a time (lock / unlock), the code releases (record-running, write-release,
switch, remove-release, prune, history) and the checkpoint timeline around a release
(preserve, restore-timeline). Shipped with the agent like rundir (deploy/command.py
`shipped_script`): standard library and the shipped rundir only."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

try:  # installed by deploy's bootstrap (deploy/command.py: shipped_script) on the far end
    rundir = sys.modules["dflash_train_shipped_rundir"]
except KeyError:  # imported from the package (tests, the deployer itself)
    from dflash_train import rundir

CURRENT = "current"
PREVIOUS = "previous"
RELEASE_FILE = "release.json"
LOCK_FILE = ".deploy.lock"


def releases_state(run_dir: Path) -> dict:
    rel = rundir.RunDir(run_dir).releases
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



def op_lock(a) -> dict:
    rel = rundir.RunDir(a.run_dir).releases
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
    lock = rundir.RunDir(a.run_dir).releases / LOCK_FILE
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
    run_dir = Path(a.run_dir)
    dest = rundir.RunDir(run_dir).release(a.id)
    env = dict(os.environ)
    env.update(json.loads(a.env))
    cp = subprocess.run(
        [a.python, "-c", "import os, dflash_train; print(os.path.dirname(os.path.abspath(dflash_train.__file__)))"],
        cwd=a.cwd, env=env, capture_output=True, text=True, timeout=120,
    )
    if cp.returncode != 0:
        return {"ok": False, "error": f"cannot locate the running code with {a.python}: {cp.stderr.strip()[-1000:]}"}
    pkg = Path(cp.stdout.strip().splitlines()[-1])
    tmp = rundir.RunDir(run_dir).releases / f".tmp-{a.id}-{os.getpid()}"
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
    dest = rundir.RunDir(a.run_dir).releases / a.id
    if not (dest / "src" / "dflash_train").is_dir():
        return {"ok": False, "error": f"{dest}/src/dflash_train missing after the copy"}
    meta = json.loads(a.meta)
    meta.update({"id": a.id, "created_at": rundir.now_iso()})
    rundir.atomic_write_text(dest / RELEASE_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return {"ok": True, "path": str(dest)}


def op_switch(a) -> dict:
    rel = rundir.RunDir(a.run_dir).releases
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



def op_remove_release(a) -> dict:
    rel = rundir.RunDir(a.run_dir).releases
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
    rel = rundir.RunDir(a.run_dir).releases
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
    rel = rundir.RunDir(a.run_dir).releases
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
    src = rundir.RunDir(a.run_dir).checkpoint(a.step)
    dest = rundir.RunDir(a.run_dir).releases / a.id / "stop-checkpoint" / src.name
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
    ckpt_dir = rundir.RunDir(run_dir).checkpoints
    moved = []
    aside = rundir.RunDir(run_dir).release(a.id) / "abandoned-checkpoints"
    for s, p in rundir.list_checkpoints(ckpt_dir):
        if s > a.step:
            aside.mkdir(parents=True, exist_ok=True)
            os.rename(p, aside / p.name)
            moved.append(p.name)
    target = rundir.RunDir(run_dir).checkpoint(a.step)
    restored = False
    if not target.is_dir():
        keep = rundir.RunDir(run_dir).release(a.id) / "stop-checkpoint" / target.name
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
    rundir.set_link(ckpt_dir, rundir.LATEST, target.name)
    problems = rundir.verify_checkpoint(target)
    return {"ok": not problems, "moved": moved, "restored": restored, "path": str(target), "problems": problems}
