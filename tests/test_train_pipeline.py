"""The real pipeline (tiny target) against the synchronous path; queue depths;
offline (precomputed) == online; non-finite steps are skipped and stop the run."""
from __future__ import annotations

import json
import math

import pytest
import torch

from trainrun import losses, run_train, tiny_overrides


@pytest.fixture(scope="module")
def tiny(tiny_target_factory, tmp_path_factory):
    from conftest import write_tiny_jsonl

    root = tmp_path_factory.mktemp("pipe")
    return tiny_target_factory("qwen3"), write_tiny_jsonl(root / "conv.jsonl", n=40), root


def test_real_source_pipeline_equals_synchronous(tiny):
    from dflash_train.config import load_config
    from dflash_train.data import DataOrder, load_prepared
    from dflash_train.pipeline.source import TargetBatchSource
    from dflash_train.pipeline.stages import Pipeline, synchronous_batches
    from dflash_train.targets import load_target

    target_dir, jsonl, root = tiny
    cfg = load_config(None, tiny_overrides(target_dir, jsonl))
    target = load_target(cfg.target)
    data = load_prepared(cfg, target.tokenizer, target.family)
    rows = (data.input_ids, data.loss_mask, data.document_ids)

    def source():
        return TargetBatchSource(rows, DataOrder(data.num_rows, 0), target, [1, 3], batch_size=3)

    ref = synchronous_batches(source(), 10)
    for depth in (1, 60):
        got = []
        with Pipeline(source(), depth, torch.device("cpu"), max_batches=10) as p:
            for b in p:
                got.append(b)
        assert len(got) == 10
        for a, b in zip(ref, got):
            assert a.positions == b.positions and a.order_state == b.order_state
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.features, b.features)


def test_queue_depths_give_identical_losses(tiny):
    target_dir, jsonl, root = tiny
    runs = {}
    for depth in (1, 60):
        rd = root / f"depth{depth}"
        res = run_train(rd, tiny_overrides(target_dir, jsonl, **{"pipeline.queue_depth": depth,
                                                                 "train.max_steps": 6}))
        assert res.returncode == 0, res.stderr
        runs[depth] = losses(rd)
    assert runs[1] == runs[60] and len(runs[1]) == 6


def _over(tiny) -> list[str]:
    target_dir, jsonl, _ = tiny
    return tiny_overrides(target_dir, jsonl, **{"pipeline.cache_features": True, "train.max_steps": 6})


@pytest.fixture(scope="module")
def precomputed(tiny):
    """`dflash-train precompute` (float32) of the tiny data, shared by the tests below, made by
    whichever of them runs first (each also runs alone)."""
    import subprocess

    from trainrun import CLI, REPO, env

    pre = tiny[2] / "features"
    res = subprocess.run([*CLI, "precompute", "--out", str(pre), "--dtype", "float32", "--rows-per-shard", "32",
                          *_over(tiny)], capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    return pre


def test_offline_equals_online(tiny, precomputed):
    """precompute (float32) -> train from disk == online training with per-row capture."""
    root = tiny[2]
    over = _over(tiny)
    online = root / "online"
    assert run_train(online, over).returncode == 0
    pre = precomputed
    index = json.loads((pre / "index.json").read_text())
    assert len(index["shards"]) >= 2 and all(len(s["sha256"]) == 64 for s in index["shards"])
    offline = root / "offline"
    res = run_train(offline, over + [f"data.source=precomputed:{pre}"])
    assert res.returncode == 0, res.stderr
    assert losses(offline) == losses(online)
    # training from features never runs the decoder: it is not loaded (the peak RSS a user pays)
    log = (offline / "logs" / "train.log").read_text()
    assert "target head only (no decoder layer loaded)" in log
    assert "target head only" not in (online / "logs" / "train.log").read_text()


def test_corrupt_precomputed_shard_is_a_clear_error(tiny, precomputed, tmp_path):
    target_dir, jsonl, root = tiny
    pre = precomputed
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(pre, bad)
    shard = bad / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = run_train(tmp_path / "r", tiny_overrides(target_dir, jsonl) + [f"data.source=precomputed:{bad}"])
    assert res.returncode == 2
    assert "shard-00000.safetensors: checksum mismatch" in res.stderr and "Traceback" not in res.stderr


def test_non_finite_steps_are_skipped_then_stop(tiny, monkeypatch, tmp_path):
    """In-process: a loss that turns NaN is skipped and logged; N in a row stop
    the run with a checkpoint of the last good state."""
    import dflash_train.train.step as step_mod  # the training step's loss
    from dflash_train.config import load_config
    from dflash_train.train.run import run_training

    target_dir, jsonl, _ = tiny
    real = step_mod.dflash_loss
    calls = {"n": 0}

    def poisoned(*a, **k):
        out = real(*a, **k)
        calls["n"] += 1
        if calls["n"] == 2 or calls["n"] >= 4:
            # the step's loss is the all-reduced sum of `total` over its weight: poison what it backpropagates
            out.total = out.total * float("nan")
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(step_mod, "dflash_loss", poisoned)
    cfg = load_config(None, tiny_overrides(target_dir, jsonl, **{"train.max_steps": 50,
                                                                 "train.max_consecutive_skips": 3}))
    rd = tmp_path / "nan"
    code = run_training(cfg, rd, resume="never", argv=["test"])
    assert code == 1
    recs = [json.loads(l) for l in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert recs[-1]["skipped"] == 4
    log = (rd / "logs" / "train.log").read_text()
    assert "step 2: non-finite loss" in log and "3 consecutive non-finite steps" in log
    from dflash_train.checkpoint import load_checkpoint

    tensors, objects, manifest = load_checkpoint(rd / "checkpoints" / "latest")
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert manifest["step"] == 6


def test_compiled_drafter_layers_match_eager(tiny):
    """train.compile=true compiles each drafter layer (inductor on CPU); the
    losses equal the eager run's to float tolerance."""
    target_dir, jsonl, root = tiny
    runs = {}
    for compiled in (False, True):
        rd = root / f"compile-{compiled}"
        res = run_train(rd, tiny_overrides(target_dir, jsonl, **{"train.compile": compiled, "train.max_steps": 3,
                                                                 "checkpoint.every_steps": 100}), timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[compiled] = losses(rd)
    assert sorted(runs[True]) == [1, 2, 3]
    for step, value in runs[False].items():
        assert math.isclose(runs[True][step], value, rel_tol=1e-4), (step, runs[True][step], value)
