"""DFlash 2 training as a user runs it: `dflash-train train` with model.architecture=dflash2
(real subprocesses, real signals, real files): selector metrics logged, SIGTERM + resume bit-exact,
a DFlash 1 checkpoint refused as DFlash 2."""
from __future__ import annotations

import math
import signal

import pytest

from trainrun import losses, metrics, run_train, signal_and_wait, start_train, tiny_overrides, wait_step

DFLASH2 = {"model.architecture": "dflash2", "model.selector_rank": 8, "model.selector_top_k": 6,
           "model.conv_group_size": 16, "train.selector_loss_weight": 0.5}


@pytest.fixture(scope="module")
def reference(train_setup):
    target, jsonl, root = train_setup
    rd = root / "reference"
    res = run_train(rd, tiny_overrides(target, jsonl, **DFLASH2))
    assert res.returncode == 0, res.stdout + res.stderr
    return rd


def test_dflash2_run_logs_selector_metrics_and_resumes_bit_exact(train_setup, reference):
    target, jsonl, root = train_setup
    ref = reference
    recs = [r for r in metrics(ref) if not r.get("eval")]
    assert [r["step"] for r in recs] == list(range(1, 9))
    for r in recs:
        for key in ("selector_loss", "selector_topk_recall", "selector_accuracy", "selector_path_tau", "argmax_path_tau"):
            assert math.isfinite(r[key]), key
        assert 0 <= r["selector_accuracy"] <= r["selector_topk_recall"] <= 1 and r["selector_path_tau"] >= 1
    rd = root / "stopped"
    proc = start_train(rd, tiny_overrides(target, jsonl, **DFLASH2), root / "stopped.log", step_delay=0.3)
    wait_step(rd, 3, proc)
    assert signal_and_wait(proc, signal.SIGTERM) == 0, (root / "stopped.log").read_text()
    assert max(losses(rd)) < 8, "the run finished before the signal; the test proves nothing"
    res = run_train(rd, tiny_overrides(target, jsonl, **DFLASH2))
    assert res.returncode == 0, res.stdout + res.stderr
    assert losses(rd) == losses(ref)  # exact float equality, every step


def test_dflash1_checkpoint_resumed_as_dflash2_is_refused(train_setup):
    target, jsonl, root = train_setup
    rd = root / "dflash1"
    res = run_train(rd, tiny_overrides(target, jsonl, **{"train.max_steps": 4}))
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_train(rd, tiny_overrides(target, jsonl, **DFLASH2))
    assert res.returncode == 2, res.stdout + res.stderr
    err = res.stderr.strip().splitlines()
    assert any("model.architecture" in line and '"dflash"' in line and '"dflash2"' in line for line in err), res.stderr
    assert "Traceback" not in res.stderr
    assert max(losses(rd)) == 4  # nothing trained, nothing lost


def test_an_older_manifest_without_architecture_is_dflash1():
    from dflash_train.model.dflash2 import architecture_mismatch
    from test_model_dflash2 import our_config

    now = our_config(("full_attention",), None)
    msg = architecture_mismatch({"hidden_size": 32}, now, "runs/x/checkpoints/step-00000004")
    assert "DFlash 1 drafter (model.architecture: dflash)" in msg and "DFlash 2 drafter (model.architecture: dflash2)" in msg
    assert architecture_mismatch({"architecture": "dflash2"}, now, "x") is None


def test_export_of_a_dflash2_run_loads_in_the_reference(reference, tmp_path):
    """`dflash-train export RUN --out DIR` on a trained DFlash 2 run; the reference loads it."""
    import subprocess
    import sys

    from trainrun import REPO, env

    rd = reference
    out = tmp_path / "export"
    res = subprocess.run([sys.executable, "-m", "dflash_train.cli", "export", str(rd), "--out", str(out)],
                         capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    from dflash.model import DFlash2DraftModel

    ref, info = DFlash2DraftModel.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert "DFlash 2" in (out / "README.md").read_text()


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_dflash2_under_torchrun(train_setup, tmp_path, sharding):
    """1 target rank + 2 trainer ranks with DDP / FSDP2: the selector's parameters are used after the
    wrapped forward (in the loss); every step completes (DDP's reducer fails the next step when a
    parameter's gradient never arrives; FSDP2 would meet sharded parameters), losses finite, and the
    checkpoint holds the selector."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from trainrun import REPO, env

    target, jsonl, root = train_setup
    over = tiny_overrides(target, jsonl, **DFLASH2, **{"train.max_steps": 10, "pipeline.target_ranks": 1,
                                                       "train.sharding": sharding, "train.lr": 1e-2,
                                                       "checkpoint.every_steps": 100})
    rd = tmp_path / sharding
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "dflash_train.cli", "train", "--run-dir", str(rd), *over]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    ls = losses(rd)
    assert sorted(ls) == list(range(1, 11)) and all(math.isfinite(v) for v in ls.values())
    recs = [r for r in metrics(rd) if not r.get("eval")]
    assert all(math.isfinite(r["selector_loss"]) for r in recs)
    sd = load_file(str((rd / "checkpoints" / "latest").resolve() / "model.safetensors"))
    assert any(k.startswith("candidate_selector.") for k in sd)
