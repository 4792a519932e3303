"""`dflash-train train`: set up a run directory, build target / data / drafter,
resume, run the loop, stop safely.

Single process (CPU or one GPU) runs the threaded pipeline in-process. Under
torchrun the ranks take roles (train/distributed.py): target ranks serve
batches (pipeline/remote.py), trainer ranks run this loop with DDP or FSDP2.

The Trainer composes small parts: train/preflight.py (checks that write nothing),
pipeline/training_data.py (the data and the target), train/step.py (one step),
train/state.py + train/resume.py (checkpoint payload, resume rules),
train/interval.py (what a logging interval adds up), train/eval_hook.py (the
in-training eval callback), train/faults.py (what a refused write does to the run).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dflash_train.checkpoint import CheckpointManager, CheckpointWriteError, FollowerCheckpoints
from dflash_train.config import ConfigError, RunConfig, save_config
from dflash_train.control.signals import AbortRun, StopController, grace_warning
from dflash_train.errors import UserError
from dflash_train.model.dflash2 import build_drafter
from dflash_train.model.drafter import DrafterConfig
from dflash_train.model.init_from_target import InitFromTargetError, init_from_target
from dflash_train.pipeline.layout import advice as layout_advice
from dflash_train.pipeline.layout import check_memory, memory_line
from dflash_train.pipeline.remote import load_trainer_target, serve_target_rank, trainer_pipeline
from dflash_train.pipeline.training_data import open_training_data
from dflash_train.rundir import BEST, RunDir, RunDirBusy, RunRecord, step_dir_name
from dflash_train.storage import StorageError, writing
from dflash_train.train.distributed import DistContext
from dflash_train.train.eval_hook import InTrainingEval
from dflash_train.train.faults import RunFaults
from dflash_train.train.interval import IntervalMeter
from dflash_train.train.metrics import MetricsLogger, log_to_files, setup_logging
from dflash_train.train.preflight import (
    TrainError,
    check_mask_unused,
    check_run_dir,
    check_target_fit,
    preflight,
    refuse_busy,
)
from dflash_train.train.resume import resume_run
from dflash_train.train.schedule import step_budget
from dflash_train.train.state import TrainState, checkpoint_meta, checkpoint_payload, recipe_of
from dflash_train.train.step import TrainStep, capped_anchors
from dflash_train.train.vocab_subset import vocab_subset_from_counts
from dflash_train.utils import code_version, resolve_device

log = logging.getLogger("dflash_train")

__all__ = ["TrainError", "Trainer", "run_training", "seed_everything"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_training(cfg: RunConfig, run_dir: Path, resume: str = "auto", argv: list[str] | None = None,
                 target=None, config_origin: str | None = None, evaluator=None) -> int:
    """Train; returns the process exit code. `target`: an already loaded Target to reuse (demo).
    `config_origin`: where `cfg` came from, for the log. `evaluator`: the in-training eval run
    every eval.every_steps (eval.in_training.HeldoutEval: pick_prompts + measure); without
    one, eval.every_steps only logs that there is none."""
    ctx = DistContext.from_env(cfg)
    try:
        if ctx.is_target_rank:
            setup_logging(Path(run_dir), ctx.rank, leader=False)
            code = serve_target_rank(cfg, ctx)
        else:
            code = Trainer(cfg, Path(run_dir), resume, argv or sys.argv, ctx, target, config_origin, evaluator).run()
    except (ConfigError, UserError, FileNotFoundError) as e:
        # a user mistake: the CLI prints it as one line; the run's log keeps it too
        log_to_files(logging.ERROR, f"error: {e}")
        raise
    except Exception:
        # an internal error: its traceback goes to logs/train.log as well as stderr
        log_to_files(logging.ERROR, "internal error (a bug, not a mistake of yours): traceback follows", exc_info=True)
        raise
    finally:
        ctx.shutdown()
    if code == 130 or ctx.distributed:
        # Leave now, everything written and the process groups destroyed. 130 (a second signal):
        # interpreter finalisation would reset signal handlers, and a third signal must still mean
        # "exit 130 at once". torchrun ranks: gloo's worker threads can still hold work whose
        # tensors need the GIL while the interpreter is torn down, which aborts the rank
        # (SIGABRT, "terminate called without an active exception"; seen on a tensor-parallel
        # follower rank that finished first, 1 run in ~12; pytorch PR #179291 describes it).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume: str, argv: list[str], ctx, target=None,
                 config_origin: str | None = None, evaluator=None) -> None:
        self.cfg = cfg
        self.stop_reason: str | None = None  # max_steps, time budget, SIGTERM, ... (run.json at release)
        self.config_origin = config_origin
        self.num_anchors = cfg.train.num_anchors
        self._given_target = target
        self.run_dir = run_dir
        self.resume_arg = resume
        self.argv = argv
        self.ctx = ctx
        self.is_leader = ctx.is_leader
        self.state = TrainState()
        self.evals = InTrainingEval(cfg, evaluator, ctx.is_leader)
        self.faults = RunFaults()
        self._metrics: MetricsLogger | None = None
        self._logged = 0  # logging intervals so far

    # ------------------------------------------------------------------ set-up
    def _setup_logging(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            RunDir(self.run_dir).checkpoints.mkdir(exist_ok=True)
            setup_logging(self.run_dir, self.ctx.rank, self.is_leader)
        except OSError as e:
            raise TrainError(f"--run-dir {self.run_dir}: cannot write there: {e.strerror or e} "
                             f"({e.filename or self.run_dir})") from None
        if self.config_origin:
            log.info("config: %s", self.config_origin)

    def _setup_run_dir(self) -> None:
        self.record = None
        if self.is_leader:
            self.record = RunRecord(self.run_dir)
            try:
                with writing(RunDir(self.run_dir).record):
                    self.record.acquire(argv=self.argv, code_version=code_version(), config_hash=self.cfg.hash())
            except RunDirBusy as e:
                raise TrainError(str(e)) from None
            with writing(RunDir(self.run_dir).config):
                save_config(self.cfg, RunDir(self.run_dir).config)
        log.info("run dir %s, code %s, config %s", self.run_dir, code_version(), self.cfg.hash())

    def _load_target(self, tokenizer):
        """The target this rank needs (under torchrun: the embedding / lm_head / final norm only;
        the target ranks run the decoder), checked against model.target_layer_ids / mask_token_id."""
        t0 = time.perf_counter()
        target = load_trainer_target(self.ctx, self.cfg, self.ctx.target_device(self.device), tokenizer)
        self._log_target(target, time.perf_counter() - t0)
        return target

    def _log_target(self, target, seconds: float) -> None:
        check_target_fit(self.cfg, target.num_layers, target.vocab_size)
        log.info("target %s loaded in %.1fs: %d layers, hidden %d, vocab %d",
                 self.cfg.target.path, seconds, target.num_layers, target.hidden_size, target.vocab_size)

    def _build(self) -> None:
        cfg = self.cfg
        self.device = self.ctx.trainer_device(resolve_device(cfg.train.device))
        seed_everything(cfg.train.seed)
        self.data, self.target = open_training_data(cfg, self._load_target, self._given_target,
                                                    split=not self.ctx.colocated)
        if self._given_target is not None:
            self._log_target(self.target, 0.0)
        self.num_anchors = capped_anchors(cfg.train.num_anchors, int(self.data.input_ids.shape[1]))
        # THE step count (train.max_steps, or train.epochs over these rows), before the schedule is laid out
        counts = self.data.row_counts()  # prepare's counts: nothing below scans the rows
        self.budget = step_budget(cfg.train, self.data.document_ids, self.ctx.num_trainers, counts.real_tokens)
        log.info("%s", self.budget.line())
        self.evals.pick_prompts(self.target)
        self.vocab_subset = vocab_subset_from_counts(counts.supervised_counts, cfg.train.vocab_subset)
        self.drafter_cfg = DrafterConfig.from_target(cfg.model, self.target)
        if self.vocab_subset is not None and self.drafter_cfg.architecture == "dflash":
            # the drafter drafts over the loss's vocabulary: checkpoints carry it, export serves it
            self.drafter_cfg = dataclasses.replace(self.drafter_cfg, draft_vocab_size=int(self.vocab_subset.numel()))
        torch.manual_seed(cfg.train.seed)
        self.drafter = build_drafter(self.drafter_cfg, seed=cfg.train.seed)
        if self.drafter_cfg.draft_vocab_size:
            self.drafter.draft_vocab.copy_(self.vocab_subset)
        n_params = sum(p.numel() for p in self.drafter.parameters())
        target_bytes = sum(p.numel() * p.element_size() for p in self.target.model.parameters())
        log.info("%s", memory_line(self.ctx, target_bytes, n_params))
        if self.device.type == "cuda":  # weights + grads + AdamW beside the target, before they are allocated
            shards = self.ctx.num_trainers if cfg.train.sharding == "fsdp2" else 1
            check_memory(torch.cuda.mem_get_info(self.device)[0], n_params // shards, str(self.device))
        self.drafter = self.drafter.to(self.device)
        if cfg.model.init_from_target_layers is not None:
            try:
                got = init_from_target(self.drafter, self.target, cfg.model)
            except InitFromTargetError as e:
                raise TrainError(str(e)) from None
            log.info("drafter layers initialised from %s", ", ".join(got))
        log.info("drafter: %d layers, %.2fM params, target layers %s, block size %d, mask token %d",
                 self.drafter_cfg.num_layers, n_params / 1e6, self.drafter_cfg.target_layer_ids,
                 self.drafter_cfg.block_size, self.drafter_cfg.mask_token_id)
        check_mask_unused(self.drafter_cfg.mask_token_id, counts.token_counts)
        if self.vocab_subset is not None:
            self.vocab_subset = self.vocab_subset.to(self.device)
        # wrap before the optimizer exists: FSDP2 replaces the parameters with sharded ones
        self.model = self.ctx.wrap_model(self.drafter)
        self.anchor_gen = torch.Generator(device="cpu").manual_seed(cfg.train.seed + 1_000_003 * self.ctx.trainer_index)
        train_cfg = cfg.train.model_copy(update={"max_steps": self.budget.steps})  # what the schedule spans
        self.step = TrainStep.build(self.drafter, self.target, train_cfg, self.num_anchors, self.anchor_gen,
                                    self.vocab_subset, self.ctx, model=self.model)
        self.optimizer, self.scheduler = self.step.optimizer, self.step.scheduler
        # train.compile: one compiled graph shared by the layers (the mask and anchor code around them stays
        # eager); train.activation_checkpointing: each layer recomputed in the backward (model/drafter.py)
        self.drafter.prepare_for_training(compile=cfg.train.compile,
                                          activation_checkpointing=cfg.train.activation_checkpointing)

    # ------------------------------------------------------------------ checkpoint state
    def _rng_generators(self) -> dict[str, torch.Generator]:
        return {"anchors": self.anchor_gen}

    def _checkpoint_payload(self) -> tuple[dict, dict, dict]:
        tensors, objects = checkpoint_payload(self.drafter, self.optimizer, self.scheduler, self.state, self.ctx,
                                              self._rng_generators(), recipe_of(self.cfg.train))
        return tensors, objects, checkpoint_meta(self.state, self.cfg, self.drafter_cfg, self.ctx.world_size)

    def _resume(self) -> None:
        """The checkpoint preflight chose, put back (train/resume.py); a fresh start sets older files aside."""
        state = resume_run(self.plan, self.cfg, self.drafter_cfg, self.step, self.ctx, self._rng_generators(),
                           self.run_dir, self.resume_arg, self.budget.steps)
        self.state = state or self.state

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        threading.current_thread().name = "trainer"  # what py-spy / profile show for this stage
        # a stop signal is handled from the start (once run.json names this pid, `stop` may send one)
        stopper = StopController()
        stopper.install()
        self.ckpt = None
        self.record = None
        exit_code = 0
        try:
            # order: checks that write nothing first, so a refused start changes nothing on disk
            check_run_dir(self.run_dir)
            self._setup_logging()
            if self.is_leader:
                refuse_busy(self.run_dir)
            self.plan = preflight(self.cfg, self.run_dir, self.resume_arg, check_target=self._given_target is None)
            self._setup_run_dir()
            self._build()
            self._resume()
            if self.is_leader:
                self.ckpt = CheckpointManager(
                    RunDir(self.run_dir).checkpoints, keep_last=self.cfg.checkpoint.keep_last,
                    async_save=self.cfg.checkpoint.async_save, log=log.info,
                    on_commit=self._on_commit,
                )
            else:
                self.ckpt = FollowerCheckpoints()
            stopper.set_on_abandon(self.ckpt.abandon)
            if self.record is not None:  # resumed_step: what deploy's health check reads (0: a fresh start)
                self.faults.view(self.record.path, self.record.update, step=self.state.step,
                                 last_checkpoint=self._last_ckpt_name(), resumed_step=self.state.step)
            exit_code = self._loop(stopper)
        except AbortRun:
            log.warning("second signal: abandoned the checkpoint in progress, exiting 130")
            exit_code = 130
        finally:
            if self.ckpt is not None and exit_code != 130:
                self.ckpt.wait()
            if self.record is not None:  # a refused write leaves run.json live with a dead pid: `status` says not live
                self.faults.view(self.record.path, self.record.release, last_checkpoint=self._last_ckpt_name(),
                                 step=self.state.step, stop_reason=self.stop_reason)
            if exit_code != 130:  # after an abort, keep the handler: a third signal still exits 130 at once
                stopper.uninstall()
        return exit_code

    def _on_policy_step(self) -> bool:
        t = self.cfg.train
        return t.anchors == "on_policy" and self.state.step >= int(t.on_policy_start * self.budget.steps)

    def _on_commit(self, step: int, path: Path) -> None:
        if self.record is not None:  # writer thread; RunRecord.update is thread-safe
            self.faults.view(self.record.path, self.record.update, last_checkpoint=Path(path).name)

    def _last_ckpt_name(self) -> str | None:
        step = self.ckpt.last_committed_step if self.ckpt else None
        return step_dir_name(step) if step is not None else None

    def _save(self, reason: str) -> None:
        """Checkpoint this step; a refused write (this one, or an earlier one still being
        reported) stops the run at the next step boundary instead (train/faults.py)."""
        try:
            if self._metrics is not None:
                self._metrics.ensure_written()  # never a checkpoint ahead of metrics.jsonl
            tensors, objects, meta = self._checkpoint_payload()
            meta["reason"] = reason
            self.ckpt.save(self.state.step, tensors, objects, meta)
        except StorageError as e:
            self.faults.stop_with(e)
            return
        self._last_saved = self.state.step

    def _checkpoints_ok(self, wait: bool = False) -> bool:
        """False once a checkpoint write failed (kept in self.faults); `wait`: for the one in flight."""
        try:
            if wait:
                self.ckpt.wait()
            else:
                self.ckpt.raise_failure()
        except CheckpointWriteError as e:
            self.faults.stop_with(e)
        return self.faults.fatal is None

    def _pipeline(self):
        return trainer_pipeline(self.ctx, self.cfg, self.data, self.target, self.drafter_cfg.target_layer_ids,
                                self.state.order_state, self.device)

    def _loop(self, stopper) -> int:
        """Steps until a stop; logging, eval and checkpoints each decide their own timing."""
        metrics = self._metrics = MetricsLogger(self.run_dir, self.budget.steps, self.state.step,
                                                self.cfg.logging.tensorboard, self.cfg.logging.progress,
                                                enabled=self.is_leader)
        pipe = self._pipeline()
        interval = IntervalMeter(self.drafter_cfg.block_size, self.device)
        t_start, stop_reason, self._step_times, self._last_saved = time.time(), None, [], self.state.step
        voted = self.ctx.agree_stop(self._wants_stop(stopper, t_start))  # asked for during set-up: before step 1
        try:
            while (stop_reason := self._stop_reason(stopper, t_start, voted)) is None:
                res = self.step(pipe.get, on_policy=self._on_policy_step(),
                                stop_vote=lambda: self._wants_stop(stopper, t_start))
                voted = res.stop
                self._account(res, interval, pipe.stats)
                metrics.advance(self.state.step)
                give_up = self.state.consecutive_skips >= self.cfg.train.max_consecutive_skips
                self._maybe_log(res, interval, metrics, pipe.stats, force=give_up)
                if give_up:
                    log.error("%d consecutive non-finite steps: stopping with the last good state",
                              self.state.consecutive_skips)
                    stop_reason = "non-finite"
                    break
                self._maybe_eval(interval, metrics)
                self._maybe_checkpoint()
        finally:
            pipe.close()
            metrics.close()
        log.info("stopping at step %d (%s)", self.state.step, stop_reason)
        self.stop_reason = stop_reason  # run.json says why the run ended (compare resumes what did not finish)
        if self.faults.fatal is None and self.state.step != self._last_saved and self.state.step > 0:
            self._save(stop_reason or "stop")
        if not self._checkpoints_ok(wait=True):
            self.stop_reason = "storage fault"
            raise self.faults.final_error(self.state.step, self._last_ckpt_name())
        return 1 if stop_reason == "non-finite" else 0

    def _wants_stop(self, stopper, t_start: float) -> bool:
        """This rank's stop vote, asked at the end of each step: a signal, the time budget, or a
        failed checkpoint write (train/faults.py)."""
        t = self.cfg.train
        faulty = not self._checkpoints_ok()
        return faulty or stopper.stop_requested or (t.max_seconds > 0 and time.time() - t_start >= t.max_seconds)

    def _stop_reason(self, stopper, t_start: float, voted: bool) -> str | None:
        """At a step boundary: every rank stops after the same step. `voted`: some rank voted to stop
        during the last step (the vote rides on the step's all-reduce); alone, the vote is asked now."""
        t = self.cfg.train
        if voted or (not self.ctx.distributed and self._wants_stop(stopper, t_start)):
            if self.faults.fatal is not None:
                return "storage fault"
            return stopper.signal_name or ("time budget" if t.max_seconds else "peer rank")
        # "max_steps" also when train.epochs set the count: compare reads it as a finished run
        return "max_steps" if self.state.step >= self.budget.steps else None

    def _account(self, res, interval: IntervalMeter, stats) -> None:
        """The step's result into the run's state, the interval meter and the stage timers."""
        self.state.step += 1
        self.state.order_state = res.batches[-1].order_state
        if res.finite:
            self.state.consecutive_skips = 0
        else:
            self.state.consecutive_skips += 1
            self.state.skipped_total += 1
            log.warning("step %d: non-finite loss (%s) or grad norm (%s): step skipped (%d in a row)",
                        self.state.step, float(res.loss), float(res.grad_norm), self.state.consecutive_skips)
        self.state.tokens += res.num_tokens
        self.state.samples += res.num_samples
        for out in res.micro:
            interval.add_micro(out)
        interval.add_step(res.loss, res.finite, res.num_tokens, res.num_samples)
        stats.add("trainer", busy=res.busy_s)
        self._step_times.append(res.seconds)

    def _maybe_log(self, res, interval: IntervalMeter, metrics, stats, force: bool = False) -> None:
        if self.state.step % self.cfg.logging.every_steps and not force:
            return
        rec = interval.record(self.state.step, res.loss, self.scheduler.get_last_lr()[0], res.grad_norm,
                              self.state.tokens, self.state.skipped_total)
        rec.update(stats.snapshot_and_reset())
        metrics.log(rec)
        self._logged += 1
        if self.is_leader and self._logged == 2:  # past warm-up: the layout rule with this run's rates
            gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "8"))
            if line := layout_advice(rec, self.ctx.colocated, self.ctx.num_trainers, gpus):
                log.info("%s", line)
        if self.record is not None:
            self.faults.view(self.record.path, self.record.update, step=self.state.step,
                             tokens_per_s=rec["tokens_per_s"], loss=rec["loss"])

    def _maybe_eval(self, interval: IntervalMeter, metrics) -> None:
        if self.evals.due(self.state.step):
            t_eval = time.perf_counter()
            self._in_training_eval(metrics)
            interval.exclude(time.perf_counter() - t_eval)  # eval time is not training time

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.checkpoint.every_steps
        if self.state.step % every == 0 and self.state.step != self._last_saved:
            self._save("periodic")
            if len(self._step_times) == every or len(self._step_times) >= 3:
                self._grace_check(self._step_times)

    def _grace_check(self, step_times: list[float]) -> None:
        last = self.ckpt.last_stats
        step_s, save_s = float(np.median(step_times[-20:])), last.total_seconds if last is not None else 0.0
        log.info("timing: step %.3fs, checkpoint snapshot %.3fs, grace %.0fs", step_s, save_s,
                 self.cfg.checkpoint.grace_seconds)
        if msg := grace_warning(step_s, save_s, self.cfg.checkpoint.grace_seconds):
            log.warning(msg)

    def _in_training_eval(self, metrics) -> None:
        """Every rank takes part (the `best` decision is broadcast); the leader evaluates."""
        tau = self.evals.run(self.state.step, self.drafter, self.target, metrics)
        improved = tau is not None and (self.state.best_tau is None or tau > self.state.best_tau)
        if improved:
            self.state.best_tau = tau
        if not self.ctx.broadcast_flag(improved):
            return
        if self._last_saved != self.state.step:
            self._save("best")
        if not self._checkpoints_ok(wait=True):
            return  # the run stops at the next step boundary; `best` stays where it was
        if self.is_leader:
            try:
                with writing(RunDir(self.run_dir).checkpoints / BEST, error=CheckpointWriteError):
                    self.ckpt.mark_best(self.state.step)
            except StorageError as e:
                self.faults.stop_with(e)
