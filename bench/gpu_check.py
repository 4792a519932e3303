"""The device check a lent GPU runs in under 10 minutes (one H100 or H200, no internet; random
weights at real shapes, nothing downloaded). Each check runs in its own process under its own
time limit (a hang or a CUDA fault costs that check only) and prints one line:

    ok|FAILED  <check>  <figure>

Results: bench/results/gpu_check_<gpu-name>.json (and $OUT/ when set); the exit code is 1 when
any check failed. --smoke runs the same logic on CPU (tiny shapes, gloo, float32, a few steps).

    bash bench/gpu_check.sh                 # on the GPU machine
    python bench/gpu_check.py --smoke       # on CPU: the script's own logic
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name, module:function, seconds on the GPU, seconds in --smoke (the GPU limits sum to < 10 min)
CHECKS = [
    ("flex_vs_sdpa", "attention:check_flex_vs_sdpa", 100, 60),
    ("block_masks", "attention:check_block_masks", 60, 30),
    ("train_resume", "training:check_training", 250, 240),
    ("memory", "perf:check_memory", 80, 60),
    ("mfu", "perf:check_mfu", 100, 60),
]


def run_child(name: str, smoke: bool, work: Path, result_file: Path) -> int:
    """In the check's own process: run it, write its Result as JSON."""
    import importlib

    sys.path.insert(0, str(REPO / "bench"))
    entry = next(e for n, e, *_ in CHECKS if n == name)
    mod, fn = entry.split(":")
    try:
        r = getattr(importlib.import_module(f"gpu_check.{mod}"), fn)(smoke, work)
        out = {"ok": bool(r.ok), "figure": r.figure, "details": r.details}
    except Exception as e:  # noqa: BLE001 - an exception is this check's FAILED line
        traceback.print_exc()
        out = {"ok": False, "figure": f"{type(e).__name__}: {e}".splitlines()[0][:300], "details": {}}
    result_file.write_text(json.dumps(out, indent=2, default=str))
    return 0


def run_check(name: str, limit: float, smoke: bool, work: Path) -> dict:
    """Run one check in a new session (so a timeout kills torchrun and its workers too)."""
    work.mkdir(parents=True, exist_ok=True)
    result_file, log = work / "result.json", work / "check.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--work", str(work),
           "--result", str(result_file), *(["--smoke"] if smoke else [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.time() - t0
    if rc is None:
        out = {"ok": False, "figure": f"timed out after {limit:.0f}s (its limit)", "details": {}}
    elif result_file.exists():
        out = json.loads(result_file.read_text())
    else:
        out = {"ok": False, "figure": f"the check's process died (exit {rc}) without a result", "details": {}}
    if not out["ok"]:  # where it went wrong, on stderr (stdout carries the check lines only)
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print(f"--- {name}: last lines of {log}\n" + "\n".join(tail), file=sys.stderr, flush=True)
    return dict(out, name=name, seconds=round(seconds, 1), limit_seconds=limit, log=str(log))


def gpu_name(smoke: bool) -> str:
    if smoke:
        return "cpu-smoke"
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no-cuda"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, gloo, float32: the logic only")
    p.add_argument("--only", help="comma-separated checks to run (default: all): " + ",".join(c[0] for c in CHECKS))
    p.add_argument("--skip", default="", help="comma-separated checks not to run (reported as skipped)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where the JSON goes")
    p.add_argument("--work", type=Path, help="scratch directory (default: a new temporary one)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return run_child(a.child, a.smoke, a.work, a.result)

    import torch

    names = [c[0] for c in CHECKS]
    only = a.only.split(",") if a.only else names
    skip = set(filter(None, a.skip.split(",")))
    unknown = (set(only) | skip) - set(names)
    if unknown:
        p.error(f"unknown checks {sorted(unknown)}; use {names}")
    work = a.work or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    gpu = gpu_name(a.smoke)
    print(f"gpu_check: {gpu}, torch {torch.__version__}, work {work}", file=sys.stderr, flush=True)
    results = []
    for name, _, limit, smoke_limit in CHECKS:
        if name not in only:
            continue
        if name in skip:
            r = {"name": name, "ok": None, "figure": "skipped (--skip)"}
        else:
            r = run_check(name, smoke_limit if a.smoke else limit, a.smoke, work / name)
        status = "skip" if r["ok"] is None else ("ok" if r["ok"] else "FAILED")
        print(f"{status:<6} {name:<13} {r['figure']}" + (f"  [{r['seconds']:.0f}s]" if "seconds" in r else ""),
              flush=True)
        results.append(r)
    report = {"gpu": gpu, "smoke": a.smoke, "torch": torch.__version__, "python": platform.python_version(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checks": results}
    text = json.dumps(report, indent=2, default=str) + "\n"
    targets = [a.out] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for d in targets:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"gpu_check_{gpu}.json").write_text(text)
    print(f"gpu_check: wrote {targets[0] / f'gpu_check_{gpu}.json'}", file=sys.stderr, flush=True)
    return 1 if any(r["ok"] is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
