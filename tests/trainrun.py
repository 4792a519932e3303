"""Helpers for tests that drive `dflash-train train` as a user would: a real
subprocess, real signals, real files."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the CLI as the interpreter running the tests runs it (any venv: `pip install -e .[test] && pytest`)
CLI = [sys.executable, "-m", "dflash_train.cli"]


def tiny_overrides(target_dir: Path, jsonl: Path, **extra) -> list[str]:
    base = {
        "target.path": str(target_dir),
        "data.source": f"jsonl:{jsonl}",
        "data.limit": 64,
        "data.max_tokens": 64,
        "data.heldout_fraction": 0.1,
        "data.cache_dir": str(jsonl.parent / "data-cache"),
        "model.num_layers": 1,
        "model.block_size": 4,
        "train.max_steps": 8,
        "train.batch_size": 2,
        "train.num_anchors": 4,
        "train.lr": 3e-3,
        "train.warmup_fraction": 0.1,
        "logging.every_steps": 1,
        "logging.tensorboard": False,
        "logging.progress": "plain",
        "checkpoint.every_steps": 4,
        "checkpoint.keep_last": 3,
        "pipeline.queue_depth": 2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_cmd(run_dir: Path, overrides: list[str], resume: str | Path | None = None) -> list[str]:
    extra = ["--resume", str(resume)] if resume is not None else []
    return [*CLI, "train", "--run-dir", str(run_dir), *extra, *overrides]


def env(step_delay: float | None = None, commit_delay: float | None = None) -> dict:
    """The environment of a trainer subprocess. step_delay: sleep after every step (a signal lands
    mid-run); commit_delay: hold each checkpoint before its commit (tests/hooks/dflash_test_hooks.py)."""
    e = dict(os.environ)
    e["PYTHONUNBUFFERED"] = "1"
    e["OMP_NUM_THREADS"] = "1"  # deterministic and polite on 2 shared cores
    e["PYTHONFAULTHANDLER"] = "1"  # a rank that aborts (SIGABRT/SIGSEGV) prints where it was
    if step_delay:
        e["DFLASH_TEST_STEP_DELAY"] = str(step_delay)
    if commit_delay:
        e["DFLASH_TEST_COMMIT_DELAY"] = str(commit_delay)
    return e


def run_train(run_dir: Path, overrides: list[str], timeout: float = 300,
              resume: str | Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(run_dir, overrides, resume), capture_output=True, text=True, timeout=timeout,
                          env=env(), cwd=REPO)


def start_train(run_dir: Path, overrides: list[str], log: Path, step_delay: float | None = None,
                commit_delay: float | None = None) -> subprocess.Popen:
    f = open(log, "w")
    return subprocess.Popen(train_cmd(run_dir, overrides), stdout=f, stderr=subprocess.STDOUT,
                            env=env(step_delay, commit_delay), cwd=REPO)


def metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the trainer may be mid-way through writing the last line
            continue
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if not r.get("eval")}


def wait_for(pred, timeout: float = 120, interval: float = 0.05, what: str = "condition"):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


def wait_step(run_dir: Path, step: int, proc: subprocess.Popen | None = None, timeout: float = 180) -> None:
    def ok():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited early with {proc.returncode}")
        return any(r.get("step", 0) >= step for r in metrics(run_dir))

    wait_for(ok, timeout, what=f"step {step}")


def signal_and_wait(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 120) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout)


def checkpoint_payload(ckpt: Path) -> tuple[dict, dict]:
    """(tensors of model.safetensors, the objects of state.pt: optimizer, scheduler, train state,
    RNG streams, data order) of a committed checkpoint, or of a run dir's `checkpoints/latest`."""
    from dflash_train.checkpoint.store import load_checkpoint

    tensors, objects, _ = load_checkpoint(ckpt)
    return tensors, objects


def _differences(a, b, where: str = "") -> list[str]:
    """Where `a` and `b` differ, tensors bit for bit (dtype, shape and every byte)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        same = torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)) \
            if a.numel() else True
        return [] if same else [f"{where}: values differ (max |a-b| "
                                f"{(a.double() - b.double()).abs().max().item() if a.is_floating_point() else '?'})"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}" if where else str(k))]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")]
    if type(a) is not type(b) or a != b:
        if isinstance(a, float) and isinstance(b, float) and a != a and b != b:  # both NaN
            return []
        return [f"{where}: {a!r} vs {b!r}"]
    return []


def assert_same_training_state(ckpt: Path, reference: Path) -> None:
    """The drafter's weights and the optimizer (with the scheduler, RNG streams, data order and
    train state) in checkpoint `ckpt` are bit for bit those of `reference` (checkpoints or run dirs)."""
    (ta, oa), (tb, ob) = checkpoint_payload(ckpt), checkpoint_payload(reference)
    assert oa["train_state"]["step"] == ob["train_state"]["step"], (oa["train_state"], ob["train_state"])
    diffs = _differences(ta, tb, "model") + _differences(oa, ob, "state")
    assert not diffs, "\n".join(diffs[:20])
    assert oa["optimizer"]["state"], "no optimizer state to compare"


def write_run_with_checkpoint(run: Path) -> Path:
    """A run dir with one real checkpoint at step 2 (CheckpointManager, no training): a drafter of the
    tiny target's shape and the default config."""
    from dflash_train.checkpoint.manager import CheckpointManager
    from dflash_train.config import RunConfig, save_config
    from dflash_train.model import DFlashDrafter, DrafterConfig

    run.mkdir(parents=True)
    save_config(RunConfig(), run / "config.yaml")
    cfg = DrafterConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                        layer_types=["full_attention"], sliding_window=None, block_size=4, mask_token_id=4,
                        target_layer_ids=[1], num_target_layers=4, vocab_size=300)
    mgr = CheckpointManager(run / "checkpoints", keep_last=2, async_save=False, log=lambda m: None)
    mgr.save(2, DFlashDrafter(cfg, seed=0).state_dict(), {"optimizer": {}},
             {"step": 2, "drafter_config": cfg.to_dict(), "target_path": "/models/t"})
    mgr.close()
    return run
