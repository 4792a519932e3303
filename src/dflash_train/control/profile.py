"""`dflash-train profile RUN_DIR`: py-spy profile of the live trainer.

Finds the trainer pid in run.json (verified against its recorded start time,
like status/stop), then runs, concurrently and in --nonblocking mode (the
trainer is never paused, so both samplers can attach at once):

    py-spy dump   --pid PID                                   -> dump.txt  (thread stacks now)
    py-spy record --pid PID --duration S --threads --format flamegraph -o flamegraph.svg
    py-spy record --pid PID --duration S --threads --format raw        -o stacks.txt

and summarises stacks.txt into top.txt: samples per thread (threads are named
``trainer``, ``target-worker-N``, ``postprocess-N`` by the trainer, so the
busy fraction of each pipeline stage is visible) and the top functions by
self and inclusive samples. Only active (non-idle) stacks are sampled, so a
thread's samples / (seconds * rate) approximates how busy it was.

Output: `out` is a directory (default RUN_DIR/profiles/<UTC time>/); if it ends
in ``.svg`` it names the flamegraph and the other files go beside it with the
same stem (``X.svg``, ``X.stacks.txt``, ``X.top.txt``, ``X.dump.txt``).
py-spy is looked up next to the running Python (.venv/bin) then on PATH; it
needs ptrace rights on the trainer (root, or the same user with
kernel.yama.ptrace_scope=0 / CAP_SYS_PTRACE in containers).

Exit: 0 profile written, 1 py-spy failed (its error is printed), 2 run not live / no py-spy.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from dflash_train.rundir import liveness, read_record

RATE_HZ = 100
_THREAD_RE = re.compile(r"^thread \((\w+)\)(?::\s*(.*))?$")
_LINE_RE = re.compile(r":\d+\)$")


def find_py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    if here.is_file():
        return str(here)
    return shutil.which("py-spy")


def _paths(run_dir: Path, out: Path | None) -> dict[str, Path]:
    if out is None:
        out = Path(run_dir) / "profiles" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(out)
    if out.suffix == ".svg":
        out.parent.mkdir(parents=True, exist_ok=True)
        stem = out.with_suffix("")
        return {"svg": out, "raw": Path(f"{stem}.stacks.txt"), "top": Path(f"{stem}.top.txt"), "dump": Path(f"{stem}.dump.txt")}
    out.mkdir(parents=True, exist_ok=True)
    return {"svg": out / "flamegraph.svg", "raw": out / "stacks.txt", "top": out / "top.txt", "dump": out / "dump.txt"}


def _func(frame: str) -> str:
    """'step (dflash_train/train/loop.py:123)' -> 'step (dflash_train/train/loop.py)'."""
    return _LINE_RE.sub(")", frame.strip())


def summarize_stacks(text: str, seconds: float, rate: int = RATE_HZ, top: int = 25) -> str:
    """Top-functions report from py-spy ``--format raw --threads`` output."""
    threads: Counter[str] = Counter()
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        line = line.rstrip()
        if not line or " " not in line:
            continue
        stack, _, count_s = line.rpartition(" ")
        try:
            n = int(count_s)
        except ValueError:
            continue
        frames = stack.split(";")
        tname = "?"
        m = _THREAD_RE.match(frames[0]) if frames else None
        if m:
            tname = (m.group(2) or f"thread {m.group(1)}").strip() or f"thread {m.group(1)}"
            frames = frames[1:]
        elif frames and frames[0].startswith("process "):
            frames = frames[1:]
        total += n
        threads[tname] += n
        if frames:
            self_c[_func(frames[-1])] += n
            for f in {_func(f) for f in frames}:
                incl[f] += n
    possible = max(1.0, seconds * rate)
    out = [f"{total} samples over {seconds:g}s at {rate} Hz (active stacks only; idle threads not sampled)", "",
           "threads (samples, ~share of wall time active):"]
    w = max([len(t) for t in threads] + [6])
    for t, n in threads.most_common():
        out.append(f"  {t:<{w}}  {n:>7}  {100 * n / possible:5.1f}%")
    for title, c in (("top functions by self samples (where time is spent):", self_c),
                     ("top functions by inclusive samples (on the stack):", incl)):
        out += ["", title, f"  {'samples':>7}  {'% all':>6}  function (file)"]
        for f, n in c.most_common(top):
            out.append(f"  {n:>7}  {100 * n / max(total, 1):5.1f}%  {f}")
    return "\n".join(out) + "\n"


def profile_command(run_dir: Path, seconds: float, out: Path | None) -> int:
    run_dir = Path(run_dir)
    rec = read_record(run_dir)
    live, why = liveness(rec)
    if not live:
        print(f"error: cannot profile: the run in {run_dir} is not live ({why})", file=sys.stderr)
        return 2
    import socket

    if rec.get("hostname") not in (None, socket.gethostname()):
        print(f"error: the run is on host {rec.get('hostname')}; run profile there", file=sys.stderr)
        return 2
    pyspy = find_py_spy()
    if pyspy is None:
        print("error: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 2
    pid = str(rec["pid"])
    secs = max(1, int(round(seconds)))
    paths = _paths(run_dir, out)
    dump = subprocess.run([pyspy, "dump", "--pid", pid, "--nonblocking"], capture_output=True, text=True, timeout=60)
    paths["dump"].write_text(dump.stdout + dump.stderr)
    common = [pyspy, "record", "--pid", pid, "--duration", str(secs), "--rate", str(RATE_HZ), "--threads", "--nonblocking"]
    procs = {
        "svg": subprocess.Popen(common + ["--format", "flamegraph", "-o", str(paths["svg"])],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        "raw": subprocess.Popen(common + ["--format", "raw", "-o", str(paths["raw"])],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    failed = []
    for key, p in procs.items():
        try:
            text, _ = p.communicate(timeout=secs + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        if p.returncode != 0 or not paths[key].is_file():
            failed.append(f"py-spy record ({key}) exit {p.returncode}: {text.strip()[-800:]}")
    if failed:
        hint = "" if dump.returncode == 0 else f"\npy-spy dump also failed: {(dump.stdout + dump.stderr).strip()[-400:]}"
        print("error: " + "\n".join(failed) + hint, file=sys.stderr)
        return 1
    summary = summarize_stacks(paths["raw"].read_text(), secs)
    header = f"py-spy profile of pid {pid} ({run_dir}, step {rec.get('step')}), {secs}s\n"
    paths["top"].write_text(header + summary)
    print(header + summary)
    print(f"flamegraph: {paths['svg']}\nraw stacks: {paths['raw']}\ntop functions: {paths['top']}\nthread dump: {paths['dump']}")
    return 0
