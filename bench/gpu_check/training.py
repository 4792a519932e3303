"""Check 3: `dflash-train train` under torchrun (world size 1, pipeline.layout=colocated: an NCCL
process group on CUDA, gloo in smoke), a 50-step reference run, the same run stopped with
SIGTERM after a few steps and resumed, which must log the same loss at every step and end with
the same checkpoint tensors bit for bit; then once with train.compile=true under
TORCH_LOGS=recompiles, which must not recompile after the warm-up steps."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import Result, device
from .target_dir import make_target_dir, write_conversations

REPO = Path(__file__).resolve().parents[2]
HOOKS = REPO / "tests" / "hooks"  # DFLASH_TEST_STEP_DELAY is installed from there (sitecustomize), only
# smoke: torch.compile with the eager backend (sitecustomize there): dynamo traces and guards, so
# recompiles count the same, without ~50 s of inductor code generation on 2 CPU cores
EAGER_COMPILE = Path(__file__).resolve().parent / "eager_compile"
# Qwen3-8B's width (hidden, heads, head_dim, MLP, vocab) with 4 layers: the real matrices, a 4 GB target
REAL = dict(hidden=4096, layers=4, heads=32, kv_heads=8, head_dim=128, inter=12288, vocab=151936)
SMOKE = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512)
STEPS, STOP_AFTER, COMPILE_STEPS, WARMUP = 50, 10, 12, 3
SMOKE_STEPS, SMOKE_STOP_AFTER, SMOKE_COMPILE_STEPS = 8, 3, 5


def overrides(target: Path, jsonl: Path, work: Path, smoke: bool, steps: int, **extra) -> list[str]:
    dev, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    o = {
        "target.path": target, "data.source": f"jsonl:{jsonl}", "data.cache_dir": work / "data-cache",
        "data.max_tokens": 128 if smoke else 1024, "data.heldout_fraction": 0.0,
        "model.num_layers": 1, "model.block_size": 4 if smoke else 16,
        "train.max_steps": steps, "train.batch_size": 2, "train.num_anchors": 8 if smoke else 64,
        "train.lr": 1e-3, "train.device": dev, "train.dtype": dtype, "target.device": dev, "target.dtype": dtype,
        "pipeline.layout": "colocated", "pipeline.queue_depth": 2,
        "logging.every_steps": 1, "logging.progress": "plain", "logging.tensorboard": False,
        # checkpoints only where the run ends or is stopped: the resume point and the final tensors
        "checkpoint.every_steps": 100_000, "checkpoint.keep_last": 1, "eval.every_steps": 0,
    }
    o.update(extra)
    return [f"{k}={v}" for k, v in o.items()]


def torchrun(run_dir: Path, over: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "dflash_train.cli", "train", "--run-dir", str(run_dir), *over]


def env(step_delay: float | None = None, eager_compile: bool = False, **extra) -> dict:
    e = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    site = str(HOOKS) if step_delay else str(EAGER_COMPILE) if eager_compile else None  # one sitecustomize each
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), site, e.get("PYTHONPATH")]))
    if step_delay:
        e["DFLASH_TEST_STEP_DELAY"] = str(step_delay)
    return e


def run(run_dir: Path, over: list[str], log: Path, timeout: float, **env_kw) -> int:
    with open(log, "a") as f:
        return subprocess.run(torchrun(run_dir, over), stdout=f, stderr=subprocess.STDOUT, env=env(**env_kw),
                              cwd=REPO, timeout=timeout).returncode


def losses(run_dir: Path) -> dict[int, float]:
    p = run_dir / "metrics.jsonl"
    out = {}
    for line in p.read_text().splitlines() if p.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if not r.get("eval") and "loss" in r:
            out[int(r["step"])] = r["loss"]
    return out


def checkpoint_differences(a: Path, b: Path) -> list[str]:
    """Tensor names whose values (or dtype / shape) differ between two model.safetensors, and
    names only one side has."""
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    bad = sorted(set(ta) ^ set(tb))
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        # bit for bit: compare the bytes, so -0.0 vs 0.0 or NaN payloads count too
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            bad.append(name)
    return bad


def final_model(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"


def count_recompiles(log_text: str, warmup: int) -> tuple[int, int]:
    """(recompiles logged up to the end of step `warmup`, recompiles after it), from the merged
    output of a run with TORCH_LOGS=recompiles and logging.progress=plain."""
    lines = log_text.splitlines()
    marker = next((i for i, l in enumerate(lines) if re.match(rf"step {warmup}/\d+", l.strip())), len(lines))
    rec = [i for i, l in enumerate(lines) if "Recompiling function" in l or "recompile_limit" in l]
    return sum(i <= marker for i in rec), sum(i > marker for i in rec)


def stop_and_resume(rd: Path, over: list[str], log: Path, stop_after: int, timeout: float) -> dict:
    """Start the run with a step delay (the signal lands mid-run), SIGTERM the trainer's pid from
    run.json once `stop_after` steps are logged, then run the same command again (it resumes)."""
    with open(log, "a") as f:
        proc = subprocess.Popen(torchrun(rd, over), stdout=f, stderr=subprocess.STDOUT, env=env(step_delay=0.3),
                                cwd=REPO)
    end = time.time() + timeout
    while len(losses(rd)) < stop_after:
        if proc.poll() is not None:
            raise RuntimeError(f"the run to stop exited early ({proc.returncode}); see {log}")
        if time.time() > end:
            proc.kill()
            raise TimeoutError(f"no step {stop_after} within {timeout:.0f}s; see {log}")
        time.sleep(0.1)
    os.kill(json.loads((rd / "run.json").read_text())["pid"], signal.SIGTERM)  # what `dflash-train stop` does
    stop_rc = proc.wait(max(10.0, end - time.time()))
    stopped_at = max(losses(rd))
    before = losses(rd)
    resume_rc = run(rd, over, log, max(10.0, end - time.time()))
    return {"stop_rc": stop_rc, "stopped_at": stopped_at, "losses_before_resume": before, "resume_rc": resume_rc}


def check_training(smoke: bool, work: Path) -> Result:
    dev = device(smoke)
    steps, stop_after, compile_steps = ((SMOKE_STEPS, SMOKE_STOP_AFTER, SMOKE_COMPILE_STEPS) if smoke
                                        else (STEPS, STOP_AFTER, COMPILE_STEPS))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    target = make_target_dir(work / "target", SMOKE if smoke else REAL, dev,
                             torch.float32 if smoke else torch.bfloat16)
    jsonl = write_conversations(work / "conversations.jsonl", 200)
    build_s = time.time() - t0
    log = work / "train.log"
    over = overrides(target, jsonl, work, smoke, steps)
    d: dict = {"target_build_seconds": build_s, "log": str(log)}

    t0 = time.time()
    ref = work / "reference"
    d["reference_rc"] = run(ref, over, log, 600)
    d["reference_seconds"] = time.time() - t0
    ref_losses = losses(ref)
    text = log.read_text()
    d["process_group"] = next((b for b in ("nccl", "gloo") if b in text.lower()), "not in the log")

    t0 = time.time()
    rd = work / "stopped"
    d.update(stop_and_resume(rd, over, log, stop_after, 600))
    d["stop_resume_seconds"] = time.time() - t0
    got = losses(rd)
    # the steps before the stop were never resumed: differing there means the run itself is not
    # deterministic on this device, not that resuming loses state
    pre = {s: v for s, v in d.pop("losses_before_resume").items() if s <= d["stopped_at"]}
    d["pre_stop_steps_equal"] = all(ref_losses.get(s) == v for s, v in pre.items())
    d["differing_steps"] = sorted(s for s in set(ref_losses) | set(got) if ref_losses.get(s) != got.get(s))
    ckpt = (checkpoint_differences(final_model(ref, steps), final_model(rd, steps))
            if final_model(ref, steps).exists() and final_model(rd, steps).exists() else ["<missing checkpoint>"])
    d["checkpoint_differences"] = ckpt[:20]
    resume_ok = (d["reference_rc"] == 0 and sorted(ref_losses) == list(range(1, steps + 1)) and d["stop_rc"] == 0
                 and d["stopped_at"] < steps and d["resume_rc"] == 0 and not d["differing_steps"] and not ckpt)

    t0 = time.time()
    comp = work / "compiled"
    clog = work / "compiled.log"
    d["compiled_rc"] = run(comp, overrides(target, jsonl, work, smoke, compile_steps, **{"train.compile": True}),
                           clog, 600, eager_compile=smoke, TORCH_LOGS="recompiles")
    d["compiled_seconds"] = time.time() - t0
    d["recompiles_warmup"], d["recompiles_after_warmup"] = count_recompiles(clog.read_text(), WARMUP)
    compile_ok = (d["compiled_rc"] == 0 and len(losses(comp)) == compile_steps
                  and d["recompiles_after_warmup"] == 0)

    first, last = ref_losses.get(1), ref_losses.get(steps)
    figure = (f"{steps} steps ({d['process_group']}) loss {first:.3f}->{last:.3f}" if first and last
              else f"reference rc {d['reference_rc']}, {len(ref_losses)} steps")
    figure += (f"; stop at {d['stopped_at']} + resume: "
               + ("bit-exact" if resume_ok else
                  f"DIFFERS (steps {d['differing_steps'][:5]}, {len(ckpt)} tensors, pre-stop equal "
                  f"{d['pre_stop_steps_equal']}, rc {d['stop_rc']}/{d['resume_rc']})"))
    figure += (f"; compile: {d['recompiles_after_warmup']} recompiles after step {WARMUP} "
               f"({d['recompiles_warmup']} before, rc {d['compiled_rc']})")
    return Result(resume_ok and compile_ok, figure, d)
