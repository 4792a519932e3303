"""The in-training evaluation (`eval.every_steps`), handed to the trainer by the CLI and
the demo (`run_training(..., evaluator=HeldoutEval(cfg))`), so train/ never imports eval/:
which held-out prompts (`eval_prompts`, the final eval's), and tau of real speculative decoding on them. The trainer decides
when, logs the result, marks `best`, and never lets an eval end a run."""
from __future__ import annotations

from typing import Any, Sequence

from dflash_train.eval.tau import evaluate_tau
from dflash_train.eval.prompts import eval_prompts


class HeldoutEval:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.eval_cfg = cfg.eval
        self.seed = cfg.train.seed

    def pick_prompts(self, target) -> list[str]:
        """The run's held-out eval prompts: `eval_prompts`, the very ones `dflash-train eval
        --prompts heldout` scores afterwards (data.regenerated or not)."""
        return eval_prompts(self.cfg, target)

    def measure(self, drafter, target, prompts: Sequence[str], measure_ngram: bool) -> dict[str, Any]:
        """{"tau", "tau_ngram", ...} of `drafter` on `prompts` (evaluate_tau, no plain decoding)."""
        return evaluate_tau(drafter, target, prompts, self.eval_cfg.max_new_tokens, self.eval_cfg.temperature,
                            seed=self.seed, measure_plain=False, measure_ngram=measure_ngram, run_cfg=self.cfg)
