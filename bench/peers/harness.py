"""The peer comparison's rules of equal compute (issue 48, items 1 and 3), apart from any trainer:

* cores: `cores_for(parallel)` hands each of --parallel trainers ONE core of this process's
  affinity (``os.sched_getaffinity``) and refuses, in one line, to run more trainers at a time than
  there are cores; `run_pinned` starts the trainer under ``taskset -c N`` (every thread and child
  process it starts inherits the mask) with OMP/MKL at 1 thread, so a trainer's extra Python
  threads (dflash-train's capture thread) share its one core instead of taking another;
* CPU seconds: `run_pinned` waits for the trainer with ``os.wait4`` and records the user + system
  CPU seconds of its whole process tree (every descendant it waited for) beside the wall clock;
  `time_v` reads the ``/usr/bin/time -v`` block each trainer's own script writes around its
  training process (the training stage alone);
* horizon: `horizon_steps` is THE rule for every row (common recipe and peer defaults alike): the
  LR schedule's horizon is the steps the trainer reaches in the budget at its measured pace, times
  HORIZON_MARGIN, so the wall-clock budget, not the horizon, ends every run; `stopped_early` flags a
  run that ended before its budget (a table cell, not a silent row);
* seeds: `seed_stats` (mean, spread = max - min, standard deviation) for the table's writer.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HORIZON_MARGIN = 1.25  # the horizon a quarter past the measured reach: the clock ends the run
EARLY = 0.97           # a run whose training ended before 97 % of its budget stopped early
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cores_for(parallel: int, affinity: set[int] | None = None) -> list[int]:
    """One core per trainer running at a time, from this process's affinity; SystemExit (one line)
    when there are fewer cores than trainers at a time."""
    cores = sorted(os.sched_getaffinity(0) if affinity is None else affinity)
    if parallel < 1:
        raise SystemExit(f"--parallel {parallel}: at least 1")
    if parallel > len(cores):
        raise SystemExit(f"--parallel {parallel}: this process may use {len(cores)} core(s) ({cores}); "
                         f"each trainer gets a core of its own, so run at most {len(cores)} at a time")
    return cores[:parallel]


class CorePool:
    """Cores handed to one trainer at a time each (a thread pool's jobs take and give back)."""

    def __init__(self, cores: list[int]):
        self._q: queue.Queue[int] = queue.Queue()
        for c in cores:
            self._q.put(c)

    @contextmanager
    def core(self):
        c = self._q.get()
        try:
            yield c
        finally:
            self._q.put(c)


def pinned_env(env: dict | None = None, threads: int = 1) -> dict:
    out = dict(os.environ if env is None else env)
    for v in THREAD_VARS:
        out[v] = str(threads)
    out["TOKENIZERS_PARALLELISM"] = "false"
    return out


def pinned_command(cmd: list[str], core: int) -> list[str]:
    """`cmd` under ``taskset -c CORE`` (util-linux); the affinity is inherited by every thread and
    child. Without taskset, a Python exec shim sets the same mask before it execs `cmd`."""
    if shutil.which("taskset"):
        return ["taskset", "-c", str(core)] + list(cmd)
    return [sys.executable, "-c", "import os, sys; os.sched_setaffinity(0, {%d}); os.execvp(sys.argv[1], sys.argv[1:])"
            % core] + list(cmd)


def run_pinned(cmd: list[str], log: Path, core: int, env: dict | None = None, threads: int = 1) -> dict:
    """Run `cmd` on one core, its output to `log`; the measurement of its whole process tree:
    {"rc", "core", "threads", "wall_s", "user_s", "sys_s", "cpu_s", "cpu_per_wall", "max_rss_mb"}
    (rusage of the child from wait4: it and every descendant it waited for)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full = pinned_command(cmd, core)
    print("+", " ".join(full), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        p = subprocess.Popen(full, stdout=f, stderr=subprocess.STDOUT, env=pinned_env(env, threads))
        _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    cpu = ru.ru_utime + ru.ru_stime
    return {"rc": p.returncode, "core": core, "threads": threads, "wall_s": wall, "user_s": ru.ru_utime,
            "sys_s": ru.ru_stime, "cpu_s": cpu, "cpu_per_wall": cpu / wall if wall > 0 else None,
            "max_rss_mb": ru.ru_maxrss / 1024.0, "command": full}


_TIME_V = {"user_s": r"User time \(seconds\): ([0-9.]+)", "sys_s": r"System time \(seconds\): ([0-9.]+)",
           "cpu_percent": r"Percent of CPU this job got: ([0-9]+)%",
           "max_rss_kb": r"Maximum resident set size \(kbytes\): (\d+)"}


def time_v(text: str) -> dict | None:
    """The last ``/usr/bin/time -v`` block in `text`: user, system, CPU % and peak RSS; None if absent."""
    out = {}
    for k, pat in _TIME_V.items():
        m = re.findall(pat, text)
        if m:
            out[k] = float(m[-1])
    if "user_s" not in out:
        return None
    out["cpu_s"] = out["user_s"] + out.get("sys_s", 0.0)
    return out


def horizon_steps(seconds: float, step_seconds: float, margin: float = HORIZON_MARGIN) -> int:
    """The LR schedule's horizon for a wall-clock budget: the steps reached at `step_seconds` a
    step, times `margin` (the same rule for every trainer and recipe)."""
    return max(1, round(seconds / step_seconds * margin))


def stopped_early(result: dict, seconds: float) -> bool:
    """A budgeted run that ended before its budget (its horizon or its data ran out first). A run
    whose trainer says its clock stopped it (ours and speculators: stopped_by "seconds"; SpecForge:
    time_budget_hit) did not, whatever its own count of training seconds."""
    if result.get("stopped_by") == "seconds" or result.get("time_budget_hit"):
        return False
    t = result.get("train_seconds")
    return bool(seconds) and t is not None and t < EARLY * seconds


def measured_pace(result: dict) -> float | None:
    """Seconds per optimizer step of a finished run (training clock / steps)."""
    t, n = result.get("train_seconds"), result.get("steps")
    return t / n if t and n else None


def seed_stats(values: list[float]) -> dict:
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"n": 0, "mean": None, "min": None, "max": None, "spread": None, "sd": None}
    return {"n": len(v), "mean": statistics.fmean(v), "min": min(v), "max": max(v), "spread": max(v) - min(v),
            "sd": statistics.stdev(v) if len(v) > 1 else None}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
