"""speculators 0.9.0 `train` on CPU: the peer's own trainer, with the minimum of monkeypatches (no file edits).

Run with the peer venv's python, with the same arguments as `python -m speculators.train ...`.
Patches (all in this process, none in the installed package):
  1. torch.accelerator.synchronize -> no-op. speculators/train/trainer.py:80,92 (_StepTimer.mark/now, run on every
     logged step, log_freq defaults to 1) call it; with no accelerator it raises.
  2. speculators.train.trainer.get_local_rank -> "cpu". trainer.py:348 `self.model.to(self.local_rank)` and
     :533/:643 `v.to(self.local_rank, ...)` use local rank 0 = the accelerator; on CPU:
     "RuntimeError: Cannot access accelerator device when none is available."
  3. Trainer.run_training replaced by a loop over the SAME Trainer.train_epoch (the forward/backward/clip/optimizer/
     scheduler step are the peer's) that (a) stops at --max-steps without starting the next epoch (the stock loop
     runs one more step in every remaining epoch, since train_epoch checks max_steps only after a step),
     (b) stops at a wall-clock budget (env SPEC_TRAIN_SECONDS) at a step boundary, (c) skips the validation
     epochs and the per-epoch checkpoints (not training; they would only cost time), and saves ONE checkpoint,
     at the end, to <save-path>/<last epoch>/, in float32 (env SPEC_SAVE_DTYPE; the stock save casts the fp32
     master weights to bfloat16, checkpointer.py:344).
  4. Instrumentation only: speculators.models.dflash.core.compute_metrics is wrapped to count the supervised
     (anchor, block position) predictions of every training step = the number of nonzero entries of the
     aligned loss mask the peer's loss uses (anchor slot excluded, padded anchors excluded).
Stats go to the JSON file named by env SPEC_STATS.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

torch.accelerator.synchronize = lambda *a, **k: None  # patch 1

import speculators.train.trainer as trainer_mod  # noqa: E402

trainer_mod.get_local_rank = lambda: "cpu"  # patch 2

import speculators.models.dflash.core as dflash_core  # noqa: E402
from speculators.train.cli import main  # noqa: E402
from speculators.train.config import TrainConfig  # noqa: E402

STATS = {"steps": 0, "supervised_tokens": 0, "anchors_valid": 0, "packed_tokens": 0, "train_seconds": 0.0,
         "step_seconds": [], "loss": [], "stopped_by": None}
_BUDGET = float(os.environ["SPEC_TRAIN_SECONDS"]) if os.environ.get("SPEC_TRAIN_SECONDS") else None

_orig_metrics = dflash_core.compute_metrics


def _counting_metrics(logits, targets, loss_mask, block_size=1, *a, **k):  # patch 4
    loss, metrics = _orig_metrics(logits, targets, loss_mask, block_size, *a, **k)
    if torch.is_grad_enabled():  # training forward (validation runs under no_grad)
        STATS["supervised_tokens"] += int((loss_mask != 0).sum())
        STATS["anchors_valid"] += int((loss_mask.reshape(-1, block_size) != 0).any(dim=1).sum())
        STATS["loss"].append(float(loss.detach()))
    return loss, metrics


dflash_core.compute_metrics = _counting_metrics
_orig_backbone = dflash_core.DFlashDraftModel._backbone_forward


def _counting_backbone(self, hidden_states, input_ids, loss_mask, verifier_last_hidden_states, document_ids,
                       *a, **k):  # instrumentation: real (non-padding) tokens packed into each training step
    if torch.is_grad_enabled():
        STATS["packed_tokens"] += int((document_ids != -1).sum())
    return _orig_backbone(self, hidden_states, input_ids, loss_mask, verifier_last_hidden_states, document_ids,
                          *a, **k)


dflash_core.DFlashDraftModel._backbone_forward = _counting_backbone


def _run_training(self):  # patch 3
    t_start = time.perf_counter()
    last_step_t = [t_start]
    stop = {"flag": False}

    def on_step():
        now = time.perf_counter()
        STATS["step_seconds"].append(now - last_step_t[0])
        last_step_t[0] = now
        STATS["steps"] = self.global_step
        if _BUDGET is not None and now - t_start >= _BUDGET:
            stop["flag"] = True
            STATS["stopped_by"] = "seconds"
            # train_epoch breaks right after the callback when global_step >= max_steps
            self.config = self.config._replace(max_steps=self.global_step)

    epoch = self.current_epoch
    for epoch in range(self.current_epoch, self.config.num_epochs):
        self.train_epoch(epoch, step_callback=on_step)
        if stop["flag"]:
            break
        if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
            STATS["stopped_by"] = "steps"
            break
    else:
        STATS["stopped_by"] = STATS["stopped_by"] or "epochs"
    STATS["train_seconds"] = time.perf_counter() - t_start
    STATS["steps"] = self.global_step
    STATS["last_epoch"] = epoch
    t0 = time.perf_counter()
    # the stock save casts to bfloat16 (checkpointer.py:344 float_dtype=torch.bfloat16); keep float32 weights
    save_dtype = getattr(torch, os.environ.get("SPEC_SAVE_DTYPE", "float32"))
    self.checkpointer.save_checkpoint(self.model, self.optimizers, epoch, float_dtype=save_dtype)
    STATS["save_seconds"] = time.perf_counter() - t0
    STATS["lr_final"] = [opt.param_groups[0]["lr"] for opt in self.optimizers]
    STATS["optimizers"] = [type(opt).__name__ for opt in self.optimizers]
    STATS["num_batches_per_epoch"] = len(self.train_loader)


trainer_mod.Trainer.run_training = _run_training

if __name__ == "__main__":
    if os.environ.get("SPEC_THREADS"):
        torch.set_num_threads(int(os.environ["SPEC_THREADS"]))
    cfg = TrainConfig.resolve(sys.argv[1:])
    STATS["resolved_config"] = cfg.flatten()
    t0 = time.perf_counter()
    main(cfg)
    STATS["process_seconds"] = time.perf_counter() - t0
    STATS["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    STATS["torch_threads"] = torch.get_num_threads()
    if os.environ.get("SPEC_STATS"):
        with open(os.environ["SPEC_STATS"], "w") as f:
            json.dump(STATS, f, indent=1, default=str)
