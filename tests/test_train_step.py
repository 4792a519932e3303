"""ONE train step (train/step.py TrainStep): the Trainer runs it and `bench` times it, so
one step from the same drafter, batches and anchor generator gives the same update."""
from __future__ import annotations

import copy

import torch


def test_bench_step_and_trainer_step_give_the_same_update(train_setup, tmp_path, monkeypatch):
    import dflash_train.bench as bench
    from dflash_train.config import load_config
    from dflash_train.train.run import run_training
    from dflash_train.train.step import TrainStep
    from trainrun import tiny_overrides

    target_dir, jsonl, _ = train_setup
    seen: dict = {}
    real_call = TrainStep.__call__

    def recording_call(self, next_batch, on_policy=False, **kw):
        if not seen:  # the Trainer's first step: what went in and what came out
            seen.update(drafter=copy.deepcopy(self.drafter), gen=self.anchor_gen.get_state(), batches=[],
                        target=self.target, cfg=self.cfg, anchors=self.num_anchors)

            def taken():
                b = next_batch()
                seen["batches"].append(b)
                return b

            res = real_call(self, taken, on_policy, **kw)
            seen["after"] = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
            return res
        return real_call(self, next_batch, on_policy, **kw)

    monkeypatch.setattr(TrainStep, "__call__", recording_call)
    # two micro-batches: the update depends on the one normalisation over the whole step
    cfg = load_config(None, tiny_overrides(target_dir, jsonl, **{"train.max_steps": 1, "train.grad_accum": 2}))
    assert run_training(cfg, tmp_path / "run", resume="never", argv=["test"]) == 0
    assert len(seen["batches"]) == 2

    drafter = seen["drafter"]
    before = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    gen = torch.Generator().set_state(seen["gen"])
    step = bench.bench_step(drafter, seen["target"], seen["cfg"], seen["anchors"], gen)
    batches = iter(seen["batches"])
    res = step(lambda: next(batches))
    assert res.finite and len(res.micro) == 2
    after = drafter.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after), "the step changed nothing"
    for k, v in seen["after"].items():
        assert torch.equal(after[k], v), k
