"""Runs `specforge train` in-process (the venv's own CLI entry, specforge.cli.main) with two
read-only instruments and one optional stop rule; no change to the model, loss, data or optimizer:

* supervised tokens: OnlineDFlashModel.forward returns metrics["accuracy_denom"] = weight_mask.sum(),
  the number of (anchor, block position) predictions that carry loss in that micro-batch
  (specforge/algorithms/common/dflash_family_model.py forward); we add them up.
* train seconds: wall time of TrainerController.fit (the training loop incl. data loading;
  model assembly before and export after are not in it); per-step times too.
* --seconds S (SpecForge has no time budget): after each optimizer step, once S seconds of fit()
  have passed, controller.max_steps is set to the current step, so the loop's own max_steps check
  (training/controller.py `_fit`) ends it and Trainer.fit saves the final checkpoint as usual. The
  LR schedule keeps its horizon (training.max_steps), as dflash-train's train.max_seconds does.

usage: python train_wrap.py STATS_JSON SECONDS(0 = none) -- <specforge train args...>
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("SPECFORGE_DEVICE", "cpu")


def main() -> int:
    stats_path, seconds = sys.argv[1], float(sys.argv[2])
    assert sys.argv[3] == "--"
    args = sys.argv[4:]

    import torch
    from specforge.algorithms.common import dflash_family_model as dfm
    from specforge.training import controller as ctl
    from specforge.training import profiling as prof

    stats = {"supervised_tokens": 0.0, "micro_batches": 0, "steps": 0, "fit_seconds": None,
             "step_end_times": [], "time_budget_hit": False, "torch_threads": torch.get_num_threads(),
             "losses": []}
    state = {"controller": None, "t0": None}

    orig_forward = dfm.OnlineDFlashModel.forward

    def counted_forward(self, *a, **k):
        loss, acc, metrics = orig_forward(self, *a, **k)
        stats["supervised_tokens"] += float(metrics["accuracy_denom"])
        stats["micro_batches"] += 1
        stats["losses"].append(float(loss.detach()))
        return loss, acc, metrics

    dfm.OnlineDFlashModel.forward = counted_forward

    orig_fit = ctl.TrainerController.fit

    def timed_fit(self, data):
        state["controller"], state["t0"] = self, time.perf_counter()
        try:
            return orig_fit(self, data)
        finally:
            stats["fit_seconds"] = time.perf_counter() - state["t0"]
            stats["steps"] = int(self.global_step)

    ctl.TrainerController.fit = timed_fit

    orig_after = prof.StepProfiler.after_optimizer_step

    def after_step(self, global_step):
        orig_after(self, global_step)
        elapsed = time.perf_counter() - state["t0"]
        stats["step_end_times"].append(round(elapsed, 4))
        c = state["controller"]
        if seconds > 0 and elapsed >= seconds and c is not None:
            c.max_steps = global_step
            stats["time_budget_hit"] = True

    prof.StepProfiler.after_optimizer_step = after_step

    from specforge.cli import main as sf_main

    try:
        rc = sf_main(args)
    finally:
        with open(stats_path, "w") as f:
            json.dump(stats, f)
    return int(rc or 0)


if __name__ == "__main__":
    raise SystemExit(main())
