"""`dflash-train train`: set up a run directory, build target / data / drafter,
resume, run the loop, stop safely.

Single process (CPU or one GPU) runs the threaded pipeline in-process. Under
torchrun the ranks take roles (train/distributed.py): target ranks serve
batches, trainer ranks run this loop with DDP.
"""
from __future__ import annotations

import json
import logging
import os
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dflash_train.config import RunConfig, save_config
from dflash_train.rundir import RunDirBusy, RunRecord, check_not_busy
from dflash_train.train.state import TrainState, check_recipe, checkpoint_payload, recipe_of, restore_payload
from dflash_train.model.dflash2 import selector_metrics
from dflash_train.model.on_policy import on_policy_metrics
from dflash_train.train.step import clip_gradients, loss_and_backward, make_optimizer, normalise_gradients
from dflash_train.utils import code_version, resolve_device

log = logging.getLogger("dflash_train")



from dflash_train.errors import UserError  # noqa: E402


class TrainError(UserError):
    """A run cannot start or continue for a reason the user can act on."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def vocab_subset_from_rows(input_ids: torch.Tensor, loss_mask: torch.Tensor, k: int) -> torch.Tensor | None:
    """The k most frequent supervised tokens (ties broken by id): a deterministic
    function of the training rows, so it needs no checkpointing."""
    if k <= 0:
        return None
    sup = input_ids[loss_mask.bool()]
    counts = torch.bincount(sup, minlength=int(input_ids.max()) + 1)
    k = min(k, int((counts > 0).sum()))
    # stable: sort by (-count, id)
    order = torch.argsort(-counts.double() + torch.arange(len(counts), dtype=torch.double) / (len(counts) + 1))
    return torch.sort(order[:k]).values


def _to_log_file(level: int, msg: str, exc_info: bool = False) -> None:
    """Write one record to the run's log FILE handlers only (stderr already gets the
    CLI's one line, or Python's traceback)."""
    root = logging.getLogger("dflash_train")
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return
    rec = root.makeRecord(root.name, level, __file__, 0, msg, (), sys.exc_info() if exc_info else None)
    for h in files:
        try:
            h.handle(rec)
        except Exception:  # noqa: BLE001 - logging must not mask the real error
            pass


def run_training(cfg: RunConfig, run_dir: Path, resume: str = "auto", argv: list[str] | None = None,
                 target=None, config_origin: str | None = None, evaluator=None) -> int:
    """Train; returns the process exit code. `target`: an already loaded Target to reuse (demo).
    `config_origin`: where `cfg` came from, for the log. `evaluator`: the in-training eval run
    every eval.every_steps (eval.in_training.HeldoutEval: pick_prompts + measure); without
    one, eval.every_steps only logs that there is none."""
    from dflash_train.config import ConfigError
    from dflash_train.train import distributed as dd

    ctx = dd.DistContext.from_env(cfg)
    try:
        if ctx.is_target_rank:
            return dd.serve_target_rank(cfg, Path(run_dir), ctx)
        code = Trainer(cfg, Path(run_dir), resume, argv or sys.argv, ctx, target, config_origin, evaluator).run()
    except (ConfigError, UserError, FileNotFoundError) as e:
        # a user mistake: the CLI prints it as one line; the run's log keeps it too
        _to_log_file(logging.ERROR, f"error: {e}")
        raise
    except Exception:
        # an internal error: its traceback goes to logs/train.log as well as stderr
        _to_log_file(logging.ERROR, "internal error (a bug, not a mistake of yours): traceback follows", exc_info=True)
        raise
    finally:
        ctx.shutdown()
    if code == 130:
        # aborted by a second signal: leave now. Interpreter finalisation would
        # reset signal handlers, and a third signal must still mean "exit 130 at once".
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return code


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume: str, argv: list[str], ctx, target=None,
                 config_origin: str | None = None, evaluator=None) -> None:
        self.cfg = cfg
        self.evaluator = evaluator
        self.stop_reason: str | None = None  # max_steps, time budget, SIGTERM, ... (run.json at release)
        self.config_origin = config_origin
        self.num_anchors = cfg.train.num_anchors
        self._resume_path: Path | None = None
        self._resume_config: dict | None = None  # the config recorded with the checkpoint resumed from
        self._eval_disabled: str | None = None
        self._given_target = target
        self.run_dir = run_dir
        self.resume_arg = resume
        self.argv = argv
        self.ctx = ctx
        self.is_leader = ctx.is_leader
        self.state = TrainState()
        self._eval_prompts: list[str] | None = None
        # prompt-lookup baseline tau on the eval prompts: does not change with training, measured once
        self._tau_ngram: float | None = None
        self._ngram_measured = False

    # ------------------------------------------------------------------ set-up
    def _check_run_dir(self) -> None:
        """The run dir (and what the trainer writes in it) is a writable directory; one line if not."""
        rd = self.run_dir
        for p in (rd, rd / "checkpoints", rd / "logs"):
            if p.exists() and not p.is_dir():
                raise TrainError(f"--run-dir {rd}: {p} is a file, not a directory")
        base = rd
        while not base.exists() and base != base.parent:
            base = base.parent
        if not base.is_dir():
            raise TrainError(f"--run-dir {rd}: {base} is not a directory")
        for p in (base, rd / "checkpoints", rd / "logs"):
            if p.is_dir() and not _writable(p):
                raise TrainError(f"--run-dir {rd}: {p} is not writable (read-only file system or permissions)")

    def _setup_logging(self) -> None:
        from dflash_train.train.metrics import setup_logging

        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "checkpoints").mkdir(exist_ok=True)
            setup_logging(self.run_dir, self.ctx.rank, self.is_leader)
        except OSError as e:
            raise TrainError(f"--run-dir {self.run_dir}: cannot write there: {e.strerror or e} "
                             f"({e.filename or self.run_dir})") from None
        if self.config_origin:
            log.info("config: %s", self.config_origin)

    def _check_not_busy(self) -> None:
        """Read-only: refuse a run dir a live trainer holds before looking at anything else."""
        try:
            check_not_busy(self.run_dir)
        except RunDirBusy as e:
            raise TrainError(str(e)) from None

    def _preflight(self) -> None:
        """Everything that can be checked before loading data or the target, and that
        writes nothing: device, the checkpoint to resume from, THE resume rule (see
        config.RESUME_MAY_CHANGE), the target's files, layer ids / mask token against
        the target's config.json."""
        from dflash_train.config import ConfigError, check_resume_config
        from dflash_train.targets import check_target_files

        cfg = self.cfg
        for key, dev in (("train.device", cfg.train.device), ("target.device", cfg.target.device)):
            if dev == "cuda" and not torch.cuda.is_available():
                raise ConfigError(f"{key}=cuda but no CUDA GPU is available here (torch.cuda.is_available() is "
                                  f"False); use {key}=auto or cpu")
        self._resume_path = self._choose_checkpoint()
        if self._resume_path is not None:
            old = self._recorded_config(self._resume_path)
            if old is None:
                log.warning("checkpoint %s records no config (written by an older version): config changes on "
                            "resume cannot be checked", self._resume_path)
            else:
                self._resume_config = old
                for line in check_resume_config(old, cfg, f"checkpoint {self._resume_path}"):
                    log.info("%s", line)
        d = cfg.data
        data_paths = [("data.source", d.source, d.source[len(k):]) for k in ("jsonl:", "prepared:", "precomputed:")
                      if d.source.startswith(k)]
        if d.regenerated:
            data_paths.append(("data.regenerated", d.regenerated, d.regenerated))
        for key, spec, path in data_paths:
            if not Path(path).expanduser().exists():
                raise ConfigError(f"{key}={spec}: {Path(path).expanduser()} not found")
        if self._given_target is None:
            shape = check_target_files(cfg.target)
            if shape:
                self._check_target_fit(shape.get("num_layers"), shape.get("vocab_size"), ConfigError)

    def _check_target_fit(self, num_layers: int | None, vocab_size: int | None, err=None) -> None:
        err = err or TrainError
        m = self.cfg.model
        where = f"target {self.cfg.target.path}"
        if num_layers and m.target_layer_ids is not None:
            bad = [i for i in m.target_layer_ids if not 0 <= i < num_layers]
            if bad:
                raise err(f"model.target_layer_ids={m.target_layer_ids}: {bad} out of range for {where} with "
                          f"{num_layers} layers (valid ids 0..{num_layers - 1})")
        if vocab_size and m.mask_token_id is not None and m.mask_token_id >= vocab_size:
            raise err(f"model.mask_token_id={m.mask_token_id} out of range: {where} has {vocab_size} embedding rows "
                      f"(valid ids 0..{vocab_size - 1})")

    def _choose_checkpoint(self) -> Path | None:
        """The checkpoint this start resumes from (verified), or None for a fresh start."""
        from dflash_train.checkpoint import CheckpointError, find_resumable, resolve_checkpoint_path, verify_checkpoint

        if self.resume_arg == "never":
            return None
        if self.resume_arg == "auto":
            return find_resumable(self.run_dir / "checkpoints", log=log.warning)
        given = Path(self.resume_arg)
        if not given.exists():
            raise TrainError(f"--resume {given}: no such checkpoint (give auto, never, or a checkpoint directory)")
        if not given.is_dir():
            raise TrainError(f"--resume {given} is a file; give a checkpoint directory (RUN/checkpoints/step-N), "
                             f"a run dir, auto or never")
        try:
            path = resolve_checkpoint_path(given)
        except CheckpointError as e:
            raise TrainError(f"--resume {given}: {e}") from None
        problems = verify_checkpoint(path)
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            raise TrainError(f"--resume {path}: not a valid checkpoint: {problems[0]}{more}")
        return path

    def _recorded_config(self, ckpt: Path) -> dict | None:
        """The full config recorded in the checkpoint's manifest; for checkpoints written
        before manifests carried it, RUN/config.yaml when its hash matches the manifest's."""
        from dflash_train.checkpoint import read_manifest
        from dflash_train.config import ConfigError, RunConfig, load_config

        man = read_manifest(ckpt)
        cfg = (man.get("meta") or {}).get("config")
        if isinstance(cfg, dict):
            return cfg
        own = self.run_dir / "config.yaml"
        try:
            old = load_config(own) if own.is_file() else None
        except ConfigError:
            old = None
        if isinstance(old, RunConfig) and old.hash() == man.get("config_hash"):
            return old.to_dict()
        return None

    def _setup_run_dir(self) -> None:
        self.record = None
        if self.is_leader:
            self.record = RunRecord(self.run_dir)
            try:
                self.record.acquire(argv=self.argv, code_version=code_version(), config_hash=self.cfg.hash())
            except RunDirBusy as e:
                raise TrainError(str(e)) from None
            save_config(self.cfg, self.run_dir / "config.yaml")
        log.info("run dir %s, code %s, config %s", self.run_dir, code_version(), self.cfg.hash())

    def _build(self) -> None:
        from types import SimpleNamespace

        from dflash_train.data import load_prepared
        from dflash_train.model.dflash2 import build_drafter
        from dflash_train.model.drafter import DrafterConfig
        from dflash_train.targets import load_target, load_tokenizer

        cfg = self.cfg
        self.device = self.ctx.trainer_device(resolve_device(cfg.train.device))
        seed_everything(cfg.train.seed)
        online = not cfg.data.source.startswith("precomputed:")
        tokenizer = None
        if online:
            # data first (tokenizer only): a data mistake shows before the target's weights load
            if self._given_target is not None:
                tokenizer, family = self._given_target.tokenizer, self._given_target.family
            else:
                tokenizer, family = load_tokenizer(cfg.target)
            self.data = load_prepared(cfg, tokenizer, family)
            log.info("data: %s", self.data.stats)
            self._cap_anchors(int(self.data.input_ids.shape[1]))
            self._pick_eval_prompts(SimpleNamespace(tokenizer=tokenizer, family=family))
        t0 = time.perf_counter()
        # under torchrun: the embedding / lm_head / final norm only (the target ranks run the decoder)
        self.target = self._given_target or self.ctx.load_trainer_target(
            cfg, self.ctx.target_device(self.device), tokenizer, load_target)
        self._check_target_fit(self.target.num_layers, self.target.vocab_size)
        log.info("target %s loaded in %.1fs: %d layers, hidden %d, vocab %d, mask token %d",
                 cfg.target.path, time.perf_counter() - t0, self.target.num_layers, self.target.hidden_size,
                 self.target.vocab_size, self.target.mask_token_id)
        self.drafter_cfg = DrafterConfig.from_target(cfg.model, self.target)
        torch.manual_seed(cfg.train.seed)
        self.drafter = build_drafter(self.drafter_cfg, seed=cfg.train.seed).to(self.device)
        n_params = sum(p.numel() for p in self.drafter.parameters())
        log.info("drafter: %d layers, %.2fM params, target layers %s, block size %d",
                 self.drafter_cfg.num_layers, n_params / 1e6, self.drafter_cfg.target_layer_ids,
                 self.drafter_cfg.block_size)
        self.precomputed = None
        if not online:
            self.data = self._open_precomputed(cfg.data.source[len("precomputed:"):])
            log.info("data: %s", self.data.stats)
            self._cap_anchors(int(self.data.input_ids.shape[1]))
            self._pick_eval_prompts(self.target)
        rows = (self.data.input_ids, self.data.loss_mask, self.data.document_ids)
        self.vocab_subset = vocab_subset_from_rows(self.data.input_ids, self.data.loss_mask, cfg.train.vocab_subset)
        if self.vocab_subset is not None:
            self.vocab_subset = self.vocab_subset.to(self.device)
        self.rows = rows
        # wrap before the optimizer exists: FSDP2 replaces the parameters with sharded ones
        self.model = self.ctx.wrap_model(self.drafter)
        if self.ctx.fsdp and cfg.eval.every_steps:
            # the leader alone would run the sharded drafter's forward: its collectives would hang
            raise TrainError("eval.every_steps with train.sharding=fsdp2 is not supported yet: set eval.every_steps=0 "
                             "and run `dflash-train eval` on the checkpoints")
        self.optimizer = make_optimizer(self.drafter, cfg.train)
        from dflash_train.model.objectives import Objective

        self.objective = Objective.from_train_config(cfg.train)
        from dflash_train.train.schedule import make_scheduler

        self.scheduler = make_scheduler(self.optimizer, cfg.train.max_steps, cfg.train.warmup_fraction,
                                        cfg.train.min_lr_ratio)
        self.anchor_gen = torch.Generator(device="cpu").manual_seed(cfg.train.seed + 1_000_003 * self.ctx.trainer_index)
        if cfg.train.compile:
            # per decoder layer, in place (as torchtitan does): the mask and anchor code
            # around the layers is data-dependent and stays eager; parameter names are unchanged
            for layer in self.drafter.layers:
                layer.compile()

    def _cap_anchors(self, row_len: int) -> None:
        """A row of T tokens has at most T-1 anchor positions: more anchors only add
        padding blocks (weight 0) that cost time, so the count is capped (same losses)."""
        most = max(1, row_len - 1)
        if self.cfg.train.num_anchors > most:
            self.num_anchors = most
            log.warning("train.num_anchors=%d capped to %d: a row of %d tokens has at most %d anchor positions "
                        "(more only add empty blocks; the losses are the same)", self.cfg.train.num_anchors, most,
                        row_len, most)

    def _pick_eval_prompts(self, tok_source) -> None:
        """At start-up: the held-out prompts of the in-training eval. None usable -> the
        eval is disabled with a warning (never an error: it must not end a run)."""
        cfg = self.cfg
        if not (self.is_leader and cfg.eval.every_steps):
            return
        if self.evaluator is None:
            self._eval_disabled = "no evaluator was given to run_training"
            log.warning("in-training eval disabled: %s", self._eval_disabled)
            return
        try:
            prompts = self.evaluator.pick_prompts(self.data.heldout, tok_source, cfg.data.max_tokens)
        except Exception as e:  # noqa: BLE001 - eval problems never end a run
            prompts = []
            why = f"cannot format held-out prompts ({type(e).__name__}: {e})"
        else:
            why = (f"no held-out conversation (data.heldout_fraction={cfg.data.heldout_fraction}, "
                   f"{len(self.data.heldout)} held out) has a prompt that fits data.max_tokens={cfg.data.max_tokens}")
        if not prompts:
            self._eval_disabled = why
            log.warning("in-training eval disabled: %s; training continues without it "
                        "(run `dflash-train eval --drafter RUN --prompts FILE.jsonl` on the checkpoints)", why)
            return
        if len(prompts) < cfg.eval.num_prompts:
            log.warning("in-training eval: only %d held-out prompts fit data.max_tokens=%d (eval.num_prompts=%d)",
                        len(prompts), cfg.data.max_tokens, cfg.eval.num_prompts)
        self._eval_prompts = prompts

    def _open_precomputed(self, path: str):
        from types import SimpleNamespace

        from dflash_train.pipeline.precompute import PrecomputedFeatures, PrecomputeError

        from dflash_train.model.objectives import Objective, capture_layer_ids

        pre = PrecomputedFeatures(Path(path))
        drafter_ids = list(self.drafter_cfg.target_layer_ids)
        want = capture_layer_ids(drafter_ids, self.target.num_layers, Objective.from_train_config(self.cfg.train))
        if pre.layer_ids[:len(drafter_ids)] != drafter_ids:
            raise PrecomputeError(
                f"{path} holds target layers {pre.layer_ids} but this drafter reads {drafter_ids}; "
                f"set model.target_layer_ids={pre.layer_ids}")
        if pre.layer_ids != want:
            has_final = pre.layer_ids == drafter_ids + [self.target.num_layers]
            raise PrecomputeError(
                f"{path} holds target layers {pre.layer_ids}, train.loss={self.cfg.train.loss} reads {want}: "
                + ("the features hold the final hidden state, which this objective does not read; precompute "
                   "again without it" if has_final else
                   "this objective needs the target's final hidden state; run `dflash-train precompute` with "
                   f"train.loss={self.cfg.train.loss}"))
        if pre.index["hidden_size"] != self.target.hidden_size:
            raise PrecomputeError(f"{path} was captured from a target with hidden size {pre.index['hidden_size']}, "
                                  f"not {self.target.hidden_size}")
        if self.ctx.distributed:
            raise PrecomputeError("precomputed features are read by single-process training; "
                                  "under torchrun use pipeline.target_ranks with an online source")
        self.precomputed = pre
        stats = dict(pre.index.get("data_stats", {}), source=f"precomputed:{path}", rows=len(pre.input_ids))
        return SimpleNamespace(input_ids=pre.input_ids, loss_mask=pre.loss_mask, document_ids=pre.document_ids,
                               heldout=pre.heldout(), stats=stats)

    # ------------------------------------------------------------------ checkpoint state
    def _rng_generators(self) -> dict[str, torch.Generator]:
        return {"anchors": self.anchor_gen}

    def _checkpoint_payload(self) -> tuple[dict, dict, dict]:
        tensors, objects = checkpoint_payload(self.drafter, self.optimizer, self.scheduler, self.state, self.ctx,
                                              self._rng_generators(), recipe_of(self.cfg.train))
        meta = {
            "step": self.state.step,
            "config_hash": self.cfg.hash(),
            "config": self.cfg.to_dict(),  # the full resolved config: what the resume rule compares against
            "code_version": code_version(),
            "drafter_config": self.drafter_cfg.to_dict(),
            "target_path": self.cfg.target.path,
            "tokens": self.state.tokens,
            "world_size": self.ctx.world_size,
        }
        return tensors, objects, meta

    def _restore(self, path: Path) -> None:
        from dflash_train.checkpoint import CheckpointError, load_checkpoint

        try:
            tensors, objects, manifest = load_checkpoint(path)
        except CheckpointError as e:
            raise TrainError(f"cannot resume: {e}") from None
        saved = (manifest.get("meta") or {}).get("drafter_config")
        if isinstance(saved, dict):
            from dflash_train.model.dflash2 import architecture_mismatch

            refused = architecture_mismatch(saved, self.drafter_cfg, path)
            if refused:
                raise TrainError(refused)
            now = self.drafter_cfg.to_dict()
            from dflash_train.model.drafter import SERVING_ONLY_FIELDS

            diff = [k for k in now if k in saved and k not in SERVING_ONLY_FIELDS
                    and json.dumps(saved[k], sort_keys=True) != json.dumps(now[k], sort_keys=True)]
            if diff:
                k = diff[0]
                raise TrainError(f"checkpoint {path} does not fit this drafter: {k} was {json.dumps(saved[k])}, "
                                 f"now {json.dumps(now[k])} (target {self.cfg.target.path} differs from the one "
                                 f"the run was trained against?)" + (f"; also {diff[1:]}" if diff[1:] else ""))
        try:
            check_recipe(path, objects, self.cfg.train)
            self.state = restore_payload(path, tensors, objects, self.drafter, self.optimizer, self.scheduler,
                                         self.ctx, self._rng_generators(), log)
        except UserError as e:
            raise TrainError(str(e)) from None
        self._apply_schedule_changes()
        log.info("resumed from %s at step %d (%d tokens trained)", path, self.state.step, self.state.tokens)

    def _apply_schedule_changes(self) -> None:
        """THE resume rule for the lr schedule: lr(step) = train.lr * lr_factor(step; max_steps,
        warmup_fraction, min_lr_ratio) with the CURRENT values. The restored scheduler keeps
        its step count; when a schedule key changed, its base lr becomes the new train.lr and
        the lr of the next step is recomputed (unchanged config: restored as saved, bit-exact)."""
        from dflash_train.config import LR_SCHEDULE_KEYS, config_changes
        from dflash_train.train.schedule import lr_factor

        if self._resume_config is None:
            return
        if not any(k in LR_SCHEDULE_KEYS for k, _, _ in config_changes(self._resume_config, self.cfg)):
            return
        t = self.cfg.train
        s = self.scheduler.last_epoch
        # lr_mult: Muon's groups run at train.lr * muon_lr_mult (train/optim.py)
        self.scheduler.base_lrs = [t.lr * g.get("lr_mult", 1.0) for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["initial_lr"] = t.lr * g.get("lr_mult", 1.0)
            g["lr"] = g["initial_lr"] * lr_factor(s, t.max_steps, t.warmup_fraction, t.min_lr_ratio)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        log.info("resume: lr schedule recomputed at step %d: lr %.3g (train.lr %.3g, max_steps %d)", s,
                 self.optimizer.param_groups[0]["lr"], t.lr, t.max_steps)

    def _resume(self) -> None:
        path = self._resume_path  # chosen and verified by _preflight
        if path is None:
            if self.is_leader:  # fresh start: keep, never delete, what an earlier start left (checkpoint/aside.py)
                from dflash_train.checkpoint.aside import set_aside_for_fresh_start

                set_aside_for_fresh_start(self.run_dir, self.resume_arg, log.warning)
            return
        self._restore(path)
        if self.is_leader:
            from dflash_train.checkpoint.aside import set_aside_newer
            from dflash_train.train.metrics import truncate_metrics

            # the choice of checkpoint is on disk before training: newer ones (an abandoned
            # timeline, or ones that do not verify) are moved aside now, not at the first save
            set_aside_newer(self.run_dir / "checkpoints", path, self.state.step, log.warning,
                            self.run_dir / "metrics.jsonl")

            dropped = truncate_metrics(self.run_dir / "metrics.jsonl", self.state.step)
            if dropped:
                log.info("metrics.jsonl: dropped %d lines logged after step %d (they are produced again)",
                         dropped, self.state.step)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        from dflash_train.checkpoint import CheckpointManager
        from dflash_train.control.signals import AbortRun, StopController

        threading.current_thread().name = "trainer"  # what py-spy / profile show for this stage
        # a stop signal is handled from the start (once run.json names this pid, `stop` may send one)
        stopper = StopController()
        stopper.install()
        self.ckpt = None
        self.record = None
        exit_code = 0
        try:
            # order: checks that write nothing first, so a refused start changes nothing on disk
            self._check_run_dir()
            self._setup_logging()
            if self.is_leader:
                self._check_not_busy()
            self._preflight()
            self._setup_run_dir()
            self._build()
            self._resume()
            if self.is_leader:
                self.ckpt = CheckpointManager(
                    self.run_dir / "checkpoints", keep_last=self.cfg.checkpoint.keep_last,
                    async_save=self.cfg.checkpoint.async_save, log=log.info,
                    on_commit=self._on_commit,
                )
            else:
                self.ckpt = _FollowerCheckpoints()
            stopper.set_on_abandon(self.ckpt.abandon)
            if self.record is not None:
                self.record.update(step=self.state.step, last_checkpoint=self._last_ckpt_name())
            exit_code = self._loop(stopper)
        except AbortRun:
            log.warning("second signal: abandoned the checkpoint in progress, exiting 130")
            exit_code = 130
        finally:
            if self.ckpt is not None and exit_code != 130:
                self.ckpt.wait()
            if self.record is not None:
                self.record.release(last_checkpoint=self._last_ckpt_name(), step=self.state.step,
                                    stop_reason=self.stop_reason)
            if exit_code != 130:  # after an abort, keep the handler: a third signal still exits 130 at once
                stopper.uninstall()
        return exit_code

    def _on_policy_step(self) -> bool:
        t = self.cfg.train
        return t.anchors == "on_policy" and self.state.step >= int(t.on_policy_start * t.max_steps)

    def _on_commit(self, step: int, path: Path) -> None:
        if self.record is not None:  # writer thread; RunRecord.update is thread-safe
            self.record.update(last_checkpoint=Path(path).name)

    def _last_ckpt_name(self) -> str | None:
        step = getattr(self.ckpt, "last_committed_step", None) if self.ckpt else None
        return f"step-{step:08d}" if step is not None else None

    def _save(self, reason: str) -> None:
        tensors, objects, meta = self._checkpoint_payload()
        meta["reason"] = reason
        self.ckpt.save(self.state.step, tensors, objects, meta)
        self._last_saved = self.state.step

    def _pipeline(self):
        return self.ctx.make_pipeline(self)

    def _loop(self, stopper) -> int:
        from dflash_train.model.loss import expected_acceptance_length
        from dflash_train.train.metrics import MetricsLogger

        cfg = self.cfg
        bs = self.drafter_cfg.block_size
        metrics = MetricsLogger(self.run_dir, cfg.train.max_steps, self.state.step, cfg.logging.tensorboard,
                                cfg.logging.progress, enabled=self.is_leader)
        pipe = self._pipeline()
        stats = pipe.stats
        autocast = self._autocast()
        t_start = time.time()
        interval_t0 = time.perf_counter()
        interval_tokens = interval_samples = 0
        step_times: list[float] = []
        acc_correct = torch.zeros(bs - 1, device=self.device)
        acc_count = torch.zeros(bs - 1, device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        loss_n = 0
        selector_sums: dict[str, torch.Tensor] = {}  # DFlash 2 (model/dflash2.py), on device until logged
        stop_reason = None
        self._last_saved = self.state.step
        try:
            while True:
                # ---- step boundary: every rank agrees to stop at the same step
                local_stop = stopper.stop_requested or (
                    cfg.train.max_seconds > 0 and time.time() - t_start >= cfg.train.max_seconds)
                if self.ctx.agree_stop(local_stop):
                    stop_reason = stopper.signal_name or ("time budget" if cfg.train.max_seconds else "peer rank")
                    break
                if self.state.step >= cfg.train.max_steps:
                    stop_reason = "max_steps"
                    break
                t_step = time.perf_counter()
                self.model.train()
                self.optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), device=self.device)
                step_weight = torch.zeros((), device=self.device)
                batches = []
                for micro in range(cfg.train.grad_accum):
                    batch = pipe.get().to(self.device)
                    batches.append(batch)
                    t_busy = time.perf_counter()
                    sync_ctx = self.ctx.no_sync(self.model) if micro < cfg.train.grad_accum - 1 else _null()
                    with sync_ctx, autocast:
                        out = loss_and_backward(self.model, self.target, batch, cfg.train, self.num_anchors,
                                                self.anchor_gen, self.vocab_subset, cfg.train.grad_accum,
                                                self.objective, on_policy=self._on_policy_step())
                    step_loss += out.loss.detach() / cfg.train.grad_accum
                    step_weight += out.weight_sum
                    acc_correct += out.correct.detach().float()
                    acc_count += out.count.detach().float()
                    for k, v in out.extra.items():
                        selector_sums[k] = selector_sums[k] + v if k in selector_sums else v.clone()
                    stats.add("trainer", busy=time.perf_counter() - t_busy)
                t_busy = time.perf_counter()
                # one normaliser for the whole step: every micro-batch and trainer rank (train/step.py)
                normalise_gradients(self.drafter, step_weight, self.ctx)
                grad_norm = clip_gradients(self.drafter, cfg.train.grad_clip)
                # one host sync per step: the skip decision must agree on every rank
                finite = bool(torch.isfinite(step_loss) & torch.isfinite(grad_norm))
                finite = self.ctx.agree_all(finite)
                self.state.step += 1
                self.state.order_state = batches[-1].order_state
                n_tok = sum(b.num_tokens for b in batches) * self.ctx.num_trainers
                n_samp = sum(b.input_ids.shape[0] for b in batches) * self.ctx.num_trainers
                if finite:
                    self.optimizer.step()
                    self.state.consecutive_skips = 0
                    loss_sum += step_loss
                    loss_n += 1
                else:
                    self.optimizer.zero_grad(set_to_none=True)
                    self.state.consecutive_skips += 1
                    self.state.skipped_total += 1
                    log.warning("step %d: non-finite loss (%s) or grad norm (%s): step skipped (%d in a row)",
                                self.state.step, float(step_loss), float(grad_norm), self.state.consecutive_skips)
                self.scheduler.step()
                self.state.tokens += n_tok
                self.state.samples += n_samp
                interval_tokens += n_tok
                interval_samples += n_samp
                stats.add("trainer", busy=time.perf_counter() - t_busy)
                step_times.append(time.perf_counter() - t_step)
                metrics.advance(self.state.step)

                give_up = self.state.consecutive_skips >= cfg.train.max_consecutive_skips
                if self.state.step % cfg.logging.every_steps == 0 or give_up:
                    now = time.perf_counter()
                    dt = max(now - interval_t0, 1e-9)
                    acc = (acc_correct / acc_count.clamp_min(1)).tolist()  # the interval's one read
                    rec = {
                        "step": self.state.step,
                        "loss": float(step_loss),
                        "loss_mean": float(loss_sum / max(loss_n, 1)),
                        "lr": self.scheduler.get_last_lr()[0],
                        "grad_norm": float(grad_norm),
                        "expected_tau": float(expected_acceptance_length(torch.tensor(acc))),
                        "tokens_per_s": interval_tokens / dt,
                        "samples_per_s": interval_samples / dt,
                        "tokens": self.state.tokens,
                        "skipped": self.state.skipped_total,
                        "time": time.time(),
                    }
                    for k, a in enumerate(acc, start=1):
                        rec[f"acc_{k}"] = a
                    rec.update(selector_metrics(selector_sums))
                    rec.update(on_policy_metrics(selector_sums))
                    selector_sums.clear()
                    rec.update(stats.snapshot_and_reset())
                    metrics.log(rec)
                    if self.record is not None:
                        self.record.update(step=self.state.step, tokens_per_s=rec["tokens_per_s"], loss=rec["loss"])
                    acc_correct.zero_(); acc_count.zero_(); loss_sum.zero_()
                    loss_n = interval_tokens = interval_samples = 0
                    interval_t0 = time.perf_counter()

                if give_up:
                    log.error("%d consecutive non-finite steps: stopping with the last good state",
                              self.state.consecutive_skips)
                    stop_reason = "non-finite"
                    break

                if cfg.eval.every_steps and self.state.step % cfg.eval.every_steps == 0:
                    t_eval = time.perf_counter()
                    self._in_training_eval(metrics)
                    interval_t0 += time.perf_counter() - t_eval  # eval time is not training time

                if self.state.step % cfg.checkpoint.every_steps == 0 and self.state.step != self._last_saved:
                    self._save("periodic")
                    if len(step_times) == cfg.checkpoint.every_steps or len(step_times) >= 3:
                        self._grace_check(step_times)
        finally:
            pipe.close()
            metrics.close()
        log.info("stopping at step %d (%s)", self.state.step, stop_reason)
        self.stop_reason = stop_reason  # run.json says why the run ended (compare resumes what did not finish)
        if self.state.step != self._last_saved and self.state.step > 0:
            self._save(stop_reason or "stop")
        self.ckpt.wait()
        if stop_reason == "non-finite":
            return 1
        return 0

    def _grace_check(self, step_times: list[float]) -> None:
        from dflash_train.control.signals import grace_warning

        step_s = float(np.median(step_times[-20:]))
        last = getattr(self.ckpt, "last_stats", None)
        save_s = last.total_seconds if last is not None else 0.0
        msg = grace_warning(step_s, save_s, self.cfg.checkpoint.grace_seconds)
        log.info("timing: step %.3fs, checkpoint snapshot %.3fs, grace %.0fs", step_s, save_s,
                 self.cfg.checkpoint.grace_seconds)
        if msg:
            log.warning(msg)

    def _autocast(self):
        if self.cfg.train.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return _null()

    def _in_training_eval(self, metrics) -> None:
        if not self.is_leader or self._eval_disabled:
            self._mark_best_if(False)
            return
        if self._eval_prompts is None:
            self._pick_eval_prompts(self.target)
            if not self._eval_prompts:
                self._mark_best_if(False)
                return
        prompts = self._eval_prompts
        log.info("eval at step %d: %d held-out prompts", self.state.step, len(prompts))
        self.drafter.eval()
        try:
            res = self.evaluator.measure(self.drafter, self.target, prompts, measure_ngram=not self._ngram_measured)
        except Exception as e:  # noqa: BLE001 - an eval that cannot run never ends the run
            log.warning("eval at step %d could not run and was skipped (training continues): %s: %s",
                        self.state.step, type(e).__name__, e)
            if not isinstance(e, UserError):
                _to_log_file(logging.WARNING, "eval traceback:", exc_info=True)
            self._mark_best_if(False)
            return
        finally:
            self.drafter.train()
        if not self._ngram_measured:
            self._tau_ngram = res["tau_ngram"]  # None at temperature > 0 (prompt lookup is greedy only)
            self._ngram_measured = True
        rec = {"step": self.state.step, "tau": res["tau"], "tau_ngram": self._tau_ngram, "eval": True,
               "time": time.time()}
        metrics.log(rec)
        if self._tau_ngram is not None:
            log.info("eval at step %d: tau %.3f (prompt lookup baseline %.3f)", self.state.step, res["tau"],
                     self._tau_ngram)
        else:
            log.info("eval at step %d: tau %.3f", self.state.step, res["tau"])
        improved = self.state.best_tau is None or res["tau"] > self.state.best_tau
        if improved:
            self.state.best_tau = res["tau"]
        self._mark_best_if(improved)

    def _mark_best_if(self, improved: bool) -> None:
        if not self.ctx.broadcast_flag(improved):
            return
        if self._last_saved != self.state.step:
            self._save("best")
        self.ckpt.wait()
        if self.is_leader:
            self.ckpt.mark_best(self.state.step)


def _writable(d: Path) -> bool:
    """Can this process create a file in directory `d`? (tried, so a read-only mount
    or an immutable dir counts even for root)"""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-probe-"):
            return True
    except OSError:
        return False


class _FollowerCheckpoints:
    """Trainer ranks other than the leader take part in the collectives of a
    save but write nothing."""

    last_committed_step = None
    last_stats = None

    def save(self, *a, **k) -> None:
        pass

    def wait(self, *a, **k) -> bool:
        return True

    def abandon(self, *a, **k) -> None:
        pass

    def mark_best(self, step: int) -> None:
        pass


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
