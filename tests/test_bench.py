"""`bench` times the training step that `train` runs (train/step.py), on a tiny shape."""
from __future__ import annotations

import math


def test_bench_times_the_training_step(monkeypatch):
    import dflash_train.bench as bench
    import dflash_train.train.step as step

    monkeypatch.setitem(bench.SHAPES, "tiny", dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128,
                                                   vocab=512, draft_layers=1, seq=32, batch=2, anchors=4, block=4))
    calls = []
    real = step.loss_and_backward
    monkeypatch.setattr(step, "loss_and_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = bench.run_bench("cpu", "tiny", steps=2, log=lambda *a: None)
    assert len(calls) == 1 + 2 + 1 + 2  # warm-up + timed steps, alone and behind the pipeline
    for v in (res.trainer_tok_s, res.target_tok_s, res.pipeline_tok_s, res.trainer_mfu):
        assert math.isfinite(v) and v > 0
