"""bench/gpu_check.py: the smoke run (CPU, tiny shapes, gloo) passes every check, and its checks
can fail (a wrong mask, a wrong block mask, a recompile after warm-up)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def _colocated_layout_in_code() -> bool:
    return "layout" in (REPO / "src" / "dflash_train" / "train" / "distributed.py").read_text()


def test_smoke_run_passes_every_check(tmp_path):
    # the training check runs pipeline.layout=colocated under torchrun: until the layout is in
    # train/distributed.py that run only proves the single-process path, so it is skipped then
    skip = [] if _colocated_layout_in_code() else ["--skip", "train_resume"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    res = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--smoke", "--out", str(tmp_path),
                          "--work", str(tmp_path / "work"), *skip],
                         capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    lines = res.stdout.splitlines()
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert [l.split()[1] for l in lines] == ["flex_vs_sdpa", "block_masks", "train_resume", "memory", "mfu"]
    for line in lines:
        assert line.startswith("ok ") or (skip and line.startswith("skip   train_resume")), line
    report = json.loads((tmp_path / "gpu_check_cpu-smoke.json").read_text())
    assert report["smoke"] and all(c["ok"] is not False for c in report["checks"])


def test_flex_check_fails_on_a_wrong_mask():
    from gpu_check.attention import SMOKE, compare_attention

    cpu = torch.device("cpu")
    assert compare_attention(SMOKE, "full_attention", cpu, torch.float32).ok
    wrong = compare_attention(SMOKE, "full_attention", cpu, torch.float32, flex_layer_type="sliding_attention")
    assert not wrong.ok and wrong.details["flex_rel_err"]["out"] > 1e-2


def test_block_mask_check_fails_on_a_different_mask():
    from gpu_check.attention import compare_block_masks

    # large enough for several 128-blocks, so the sliding window empties whole context blocks
    shape = dict(heads=2, kv_heads=1, head_dim=16, seq=512, anchors=32, block=8, window=16)
    cpu = torch.device("cpu")
    assert compare_block_masks(shape, "sliding_attention", cpu, compiled=False).ok
    r = compare_block_masks(shape, "full_attention", cpu, eager_layer_type="sliding_attention", compiled=False)
    assert not r.ok and r.details["differences"]


def test_recompiles_after_warmup_are_counted():
    from gpu_check.training import count_recompiles

    log = "\n".join(["step 1/12 loss 6.1", "V1207 [0/1] [__recompiles] Recompiling function forward in x.py:1",
                     "step 2/12 loss 6.0", "step 3/12 loss 5.9",
                     "V1207 [0/2] [__recompiles] Recompiling function forward in x.py:1", "step 4/12 loss 5.8"])
    assert count_recompiles(log, 3) == (1, 1)
    assert count_recompiles(log.replace("Recompiling", "Compiling"), 3) == (0, 0)


@pytest.mark.parametrize("diff", [False, True])
def test_checkpoint_comparison_is_bit_exact(tmp_path, diff):
    from safetensors.torch import save_file

    from gpu_check.training import checkpoint_differences

    a = {"w": torch.randn(4, 4), "b": torch.zeros(3)}
    b = {k: v.clone() for k, v in a.items()}
    if diff:
        b["b"][1] = -0.0  # equal as a number, not bit for bit
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    assert checkpoint_differences(tmp_path / "a.safetensors", tmp_path / "b.safetensors") == (["b"] if diff else [])
