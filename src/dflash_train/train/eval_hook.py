"""The trainer's side of the in-training eval (eval.every_steps): the evaluator it is given
(eval.in_training.HeldoutEval: pick_prompts + measure) runs on the leader; no usable prompt
disables it with a warning, and an eval that fails is skipped: an eval never ends a run."""
from __future__ import annotations

import logging
import time

from dflash_train.errors import UserError
from dflash_train.train.metrics import log_to_files

log = logging.getLogger("dflash_train")


class InTrainingEval:
    def __init__(self, cfg, evaluator, is_leader: bool) -> None:
        self.cfg = cfg
        self.evaluator = evaluator
        self.active = bool(is_leader and cfg.eval.every_steps)
        self.disabled: str | None = None
        self.prompts: list[str] | None = None
        # prompt-lookup baseline tau on the eval prompts: does not change with training, measured once
        self.tau_ngram: float | None = None
        self.ngram_measured = False

    def due(self, step: int) -> bool:
        return bool(self.cfg.eval.every_steps) and step % self.cfg.eval.every_steps == 0

    def pick_prompts(self, target) -> None:
        """At start-up: the run's held-out eval prompts (the evaluator's `pick_prompts`, the same
        ones the final eval scores). None usable -> the eval is disabled with a warning."""
        cfg = self.cfg
        if not self.active:
            return
        if self.evaluator is None:
            self.disabled = "no evaluator was given to run_training"
            log.warning("in-training eval disabled: %s", self.disabled)
            return
        try:
            prompts = self.evaluator.pick_prompts(target)
        except Exception as e:  # noqa: BLE001 - eval problems never end a run
            prompts = []
            why = f"cannot read or format the held-out prompts ({type(e).__name__}: {e})"
        else:
            why = (f"no held-out conversation of {cfg.data.source} (data.heldout_fraction="
                   f"{cfg.data.heldout_fraction}) has a prompt that fits data.max_tokens={cfg.data.max_tokens}")
        if not prompts:
            self.disabled = why
            log.warning("in-training eval disabled: %s; training continues without it "
                        "(run `dflash-train eval --drafter RUN --prompts FILE.jsonl` on the checkpoints)", why)
            return
        if len(prompts) < cfg.eval.num_prompts:
            log.warning("in-training eval: only %d held-out prompts fit data.max_tokens=%d (eval.num_prompts=%d)",
                        len(prompts), cfg.data.max_tokens, cfg.eval.num_prompts)
        self.prompts = prompts

    def run(self, step: int, drafter, target, metrics) -> float | None:
        """tau at `step` (logged to `metrics`), or None where no eval ran (not the leader, disabled, failed)."""
        if not self.active or self.disabled:
            return None
        if self.prompts is None:
            self.pick_prompts(target)
            if not self.prompts:
                return None
        prompts = self.prompts
        log.info("eval at step %d: %d held-out prompts", step, len(prompts))
        drafter.eval()
        try:
            res = self.evaluator.measure(drafter, target, prompts, measure_ngram=not self.ngram_measured)
        except Exception as e:  # noqa: BLE001 - an eval that cannot run never ends the run
            log.warning("eval at step %d could not run and was skipped (training continues): %s: %s",
                        step, type(e).__name__, e)
            if not isinstance(e, UserError):
                log_to_files(logging.WARNING, "eval traceback:", exc_info=True)
            return None
        finally:
            drafter.train()
        if not self.ngram_measured:
            self.tau_ngram = res["tau_ngram"]  # None at temperature > 0 (prompt lookup is greedy only)
            self.ngram_measured = True
        metrics.log({"step": step, "tau": res["tau"], "tau_ngram": self.tau_ngram, "eval": True, "time": time.time()})
        if self.tau_ngram is not None:
            log.info("eval at step %d: tau %.3f (prompt lookup baseline %.3f)", step, res["tau"], self.tau_ngram)
        else:
            log.info("eval at step %d: tau %.3f", step, res["tau"])
        return res["tau"]
