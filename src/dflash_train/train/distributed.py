"""Process roles: one process, or torchrun with target ranks and trainer ranks.

Under torchrun, ranks 0..T-1 (T = pipeline.target_ranks) run the frozen target
and serve batches; the remaining ranks train the drafter with DDP (gloo on CPU,
NCCL on GPU). Target rank t owns the rows t, t+T, t+2T, ... with its own data
order and serves trainers i with i % T == t, round robin, one batch per request.

Wire protocol (torch.distributed point-to-point on the world group):
  trainer -> target  request: int64[2] = [cmd (1 next, 0 stop), n] + uint8[n] JSON
                     (the first request carries the data-order state to resume from)
  target -> trainer  header: int64[4] = [B, T, F, n] then input_ids int64[B,T],
                     loss_mask uint8[B,T], document_ids int32[B,T], features[B,T,F]
                     (target dtype), uint8[n] JSON {positions, order_state}
Rows have a fixed length, so every message has a known size.

Tensor-parallel target groups (pipeline.target_tp_size = G > 1): ranks [g*G, (g+1)*G) hold
target g sharded (targets/sharded.py); only the leader g*G talks to trainers, as target
rank g above, so "target t" below means target group t and T the number of groups. The
leader broadcasts each capture to its group and stop at the end (GroupLeaderTarget).
Trainer ranks load the target's head only (targets/head_only.py).
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_train.config import ConfigError
from dflash_train.pipeline.batch import TrainBatch
from dflash_train.pipeline.stages import Pipeline, PipelineError, StageStats

log = logging.getLogger("dflash_train")


def _null_ctx():
    import contextlib

    return contextlib.nullcontext()


class DistContext:
    def __init__(self, cfg, world_size: int = 1, rank: int = 0, local_rank: int = 0) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.rank = rank
        self.local_rank = local_rank
        self.distributed = world_size > 1
        self.num_target_ranks = cfg.pipeline.target_ranks if self.distributed else 0
        if self.distributed and not (1 <= self.num_target_ranks < world_size):
            raise ConfigError(
                f"pipeline.target_ranks={self.num_target_ranks} must leave at least one trainer rank "
                f"and be >= 1 (world size {world_size})")
        # tensor-parallel target groups: ranks [g*tp, (g+1)*tp) hold target g; g*tp (the group leader)
        # serves the trainers, exactly as an unsharded target rank g would (same rows, same data order)
        self.target_tp_size = cfg.pipeline.target_tp_size
        if self.target_tp_size > 1 and not self.distributed:
            raise ConfigError(f"pipeline.target_tp_size={self.target_tp_size} shards the target over target ranks "
                              "under torchrun; a single process holds the whole target (set it to 1)")
        if self.distributed and self.num_target_ranks % self.target_tp_size:
            raise ConfigError(f"pipeline.target_ranks={self.num_target_ranks} is not a multiple of "
                              f"pipeline.target_tp_size={self.target_tp_size} (each target group has "
                              f"target_tp_size ranks; world size {world_size})")
        self.num_target_groups = self.num_target_ranks // self.target_tp_size if self.distributed else 0
        self.target_group = None  # this target rank's process group when target_tp_size > 1
        self.target_self_group = None  # this target rank alone (size-1 mesh dims)
        self.is_target_rank = self.distributed and rank < self.num_target_ranks
        self.trainer_ranks = list(range(self.num_target_ranks, world_size)) if self.distributed else [0]
        self.num_trainers = len(self.trainer_ranks)
        self.trainer_index = self.trainer_ranks.index(rank) if rank in self.trainer_ranks else -1
        self.is_leader = (not self.distributed) or rank == self.num_target_ranks
        self.trainer_group = None
        self.fsdp = False  # set by wrap_model when the drafter is sharded

    @classmethod
    def from_env(cls, cfg) -> "DistContext":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(cfg)
        ctx = cls(cfg, world, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")))
        use_cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
        backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(ctx.local_rank)
        dist.init_process_group(backend, timeout=timedelta(minutes=30))
        ctx.trainer_group = dist.new_group(ctx.trainer_ranks)
        if ctx.target_tp_size > 1:
            # new_group is collective over the world: every rank creates every target group, and a
            # one-rank group per target rank (the size-1 dims of transformers' TP mesh), in order
            for g in range(ctx.num_target_groups):
                ranks = list(range(g * ctx.target_tp_size, (g + 1) * ctx.target_tp_size))
                group = dist.new_group(ranks)
                if ctx.rank in ranks:
                    ctx.target_group = group
            for r in range(ctx.num_target_ranks):
                alone = dist.new_group([r])
                if r == ctx.rank:
                    ctx.target_self_group = alone
        return ctx

    def load_trainer_target(self, cfg, device: torch.device, tokenizer, load_target):
        """The target a trainer rank needs: alone, the whole model (it captures); under torchrun the
        embedding, lm_head and final norm only, except on the leader when the in-training eval runs
        (speculative decoding needs the whole target there)."""
        if self.distributed and not (self.is_leader and cfg.eval.every_steps):
            from dflash_train.targets.head_only import load_head_only_target

            return load_head_only_target(cfg.target, device, tokenizer)
        return load_target(cfg.target, device=device, tokenizer=tokenizer)

    # ------------------------------------------------------------------ devices
    def trainer_device(self, default: torch.device) -> torch.device:
        if self.distributed and default.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return default

    def target_device(self, trainer_device: torch.device) -> torch.device:
        from dflash_train.utils import resolve_device

        if self.distributed:
            return trainer_device  # each rank uses its own GPU (or the CPU)
        want = resolve_device(self.cfg.target.device)
        return want

    # ------------------------------------------------------------------ collectives (no-ops alone)
    def _reduce(self, value: float, op) -> float:
        if not self.distributed:
            return value
        dev = torch.device("cuda", self.local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([float(value)], device=dev)
        dist.all_reduce(t, op=op, group=self.trainer_group)
        return float(t.item())

    def sum_over_trainers(self, value: float) -> float:
        return self._reduce(value, dist.ReduceOp.SUM if self.distributed else None)

    def agree_stop(self, local: bool) -> bool:
        return self._reduce(1.0 if local else 0.0, dist.ReduceOp.MAX if self.distributed else None) > 0

    def agree_all(self, ok: bool) -> bool:
        return self._reduce(1.0 if ok else 0.0, dist.ReduceOp.MIN if self.distributed else None) > 0

    def broadcast_flag(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        return self._reduce(1.0 if (flag and self.is_leader) else 0.0, dist.ReduceOp.MAX) > 0

    def gather_objects(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.num_trainers
        dist.all_gather_object(out, obj, group=self.trainer_group)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.trainer_group)

    def no_sync(self, model):
        return model.no_sync() if hasattr(model, "no_sync") else _null_ctx()

    def wrap_model(self, drafter: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed or self.num_trainers == 1:
            return drafter
        dev = next(drafter.parameters()).device
        if self.cfg.train.sharding == "fsdp2":
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            # a mesh over the trainer ranks only (the target ranks never join its collectives).
            # One FSDP unit for the whole drafter: its forward projects the context through
            # every layer's k/v weights before running the layers, so per-layer units would
            # be used outside their own forward. Parameters, gradients and optimizer state
            # stay sharded between steps; the full weights exist only inside forward/backward.
            mesh = DeviceMesh.from_group(self.trainer_group, dev.type)
            fully_shard(drafter, mesh=mesh)
            self.fsdp = True
            return drafter
        return _DDP(drafter, device_ids=[dev.index] if dev.type == "cuda" else None,
                   process_group=self.trainer_group)

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ data
    def target_for(self, trainer_index: int) -> int:
        """The target (group) index serving trainer `trainer_index`; its leader's rank is `leader_of`."""
        return trainer_index % self.num_target_groups

    def leader_of(self, target_index: int) -> int:
        return target_index * self.target_tp_size

    def make_pipeline(self, trainer):
        """The trainer's stream of batches: in-process pipeline, or a remote target rank."""
        cfg = self.cfg
        if not self.distributed:
            from dflash_train.data import DataOrder
            from dflash_train.pipeline.source import TargetBatchSource

            order = DataOrder(len(trainer.rows[0]), cfg.train.seed)
            if trainer.state.order_state:
                order.load_state_dict(trainer.state.order_state)
            if trainer.precomputed is not None:
                from dflash_train.pipeline.precompute import PrecomputedBatchSource

                source = PrecomputedBatchSource(trainer.precomputed, order, cfg.train.batch_size, trainer.target.dtype)
            else:
                source = TargetBatchSource(trainer.rows, order, trainer.target,
                                           _capture_ids(cfg, trainer.drafter_cfg.target_layer_ids, trainer.target),
                                           cfg.train.batch_size, cfg.pipeline.cache_features)
            return Pipeline(source, cfg.pipeline.queue_depth, trainer.device,
                            num_workers=cfg.pipeline.num_target_workers).start()
        states = trainer.state.order_state.get("per_target") if trainer.state.order_state else None
        resume_state = states.get(str(self.target_for(self.trainer_index))) if states else None
        return RemotePipeline(self, trainer, resume_state).start()

    def combine_order_states(self, local_state: dict) -> dict:
        """Under torchrun: {"per_target": {t: state after the last batch any of t's trainers consumed}}."""
        if not self.distributed:
            return local_state
        all_states = self.gather_objects(local_state)
        per_target: dict[str, dict] = {}
        for i, st in enumerate(all_states):
            per_target[str(self.target_for(i))] = st  # later trainers of a target hold its latest state
        return {"per_target": per_target}


# ---------------------------------------------------------------------- trainer side


def _capture_ids(cfg, layer_ids, target) -> list[int]:
    """The drafter's target layers, plus the final hidden state when the objective reads it."""
    from dflash_train.model.objectives import Objective, capture_layer_ids

    return capture_layer_ids(layer_ids, target.num_layers, Objective.from_train_config(cfg.train))


class _DDP(torch.nn.parallel.DistributedDataParallel):
    """DDP whose forward syncs gradients, and which answers attribute reads
    (cfg, fc, ...) from the drafter it wraps, so the loss code takes either."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)



def _send_bytes(obj, dst: int, cmd: int) -> None:
    data = json.dumps(obj).encode() if obj is not None else b""
    dist.send(torch.tensor([cmd, len(data)], dtype=torch.int64), dst)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def _recv_bytes(src: int, n: int):
    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src)
    return json.loads(bytes(buf.tolist()).decode())


class RemotePipeline:
    """Trainer-side stand-in for `Pipeline`: a thread requests batches from the
    target rank and keeps up to queue_depth of them ready (gloo: CPU tensors)."""

    def __init__(self, ctx: DistContext, trainer, resume_state) -> None:
        self.ctx = ctx
        self.src = ctx.leader_of(ctx.target_for(ctx.trainer_index))
        self.device = trainer.device
        self.feature_dtype = trainer.target.dtype
        self.stats = StageStats()
        self.q: queue.Queue = queue.Queue(maxsize=ctx.cfg.pipeline.queue_depth)
        self._stop = threading.Event()
        self._resume_state = resume_state
        self._thread = threading.Thread(target=self._loop, name="postprocess-0", daemon=True)
        self._error: BaseException | None = None

    def start(self) -> "RemotePipeline":
        self._thread.start()
        return self

    def _loop(self) -> None:
        first = True
        try:
            while not self._stop.is_set():
                _send_bytes({"resume": self._resume_state} if first else None, self.src, 1)
                first = False
                header = torch.empty(4, dtype=torch.int64)
                dist.recv(header, self.src)
                b, t, f, n = header.tolist()
                ids = torch.empty(b, t, dtype=torch.int64); dist.recv(ids, self.src)
                mask = torch.empty(b, t, dtype=torch.uint8); dist.recv(mask, self.src)
                docs = torch.empty(b, t, dtype=torch.int32); dist.recv(docs, self.src)
                feats = torch.empty(b, t, f, dtype=self.feature_dtype); dist.recv(feats, self.src)
                meta = _recv_bytes(self.src, n)
                batch = TrainBatch(ids, mask.bool(), docs, feats, meta["positions"], meta["order_state"])
                while not self._stop.is_set():
                    try:
                        self.q.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001
            self._error = e
        finally:
            try:
                _send_bytes(None, self.src, 0)  # tell the target rank this trainer is done
            except Exception:  # noqa: BLE001
                pass

    def get(self) -> TrainBatch:
        import time

        t0 = time.perf_counter()
        while True:
            if self._error is not None:
                raise PipelineError(f"receiving from target rank {self.src} failed: {self._error!r}")
            try:
                batch = self.q.get(timeout=0.1)
                break
            except queue.Empty:
                continue
        self.stats.sample_queue(self.q.qsize(), self.q.maxsize)
        self.stats.add("trainer", wait=time.perf_counter() - t0)
        return batch

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self.q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=60)


# ---------------------------------------------------------------------- target side


def serve_target_rank(cfg, run_dir: Path, ctx: DistContext) -> int:
    """A target rank: run the in-process pipeline over this rank's rows and
    answer trainer requests round robin until every trainer said stop."""
    import signal

    from dflash_train.data import DataOrder, load_prepared
    from dflash_train.model.drafter import DrafterConfig
    from dflash_train.pipeline.source import TargetBatchSource
    from dflash_train.targets import load_target
    from dflash_train.train.metrics import setup_logging
    from dflash_train.utils import resolve_device

    # shutdown is owned by the trainers: they agree on a step and tell us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(run_dir, ctx.rank, leader=False)
    device = ctx.trainer_device(resolve_device(cfg.train.device))
    group = ctx.target_group  # None: this rank holds the whole target
    if group is None:
        target = load_target(cfg.target, device=device)
    else:
        from dflash_train.targets.sharded import follow_group_leader, load_sharded_target

        target = load_sharded_target(cfg.target, group, ctx.target_self_group, device)
        leader = ctx.leader_of(ctx.rank // ctx.target_tp_size)
        if ctx.rank != leader:
            n = follow_group_leader(target, group, leader)
            log.info("target rank %d: %d captures for group leader %d, done", ctx.rank, n, leader)
            return 0
    layer_ids = DrafterConfig.from_target(cfg.model, target).target_layer_ids
    data = load_prepared(cfg, target.tokenizer, target.family)
    # the target (group) index and count: a group of target_tp_size ranks is ONE target here
    t, T = ctx.rank // ctx.target_tp_size, ctx.num_target_groups
    rows = tuple(x[t::T] for x in (data.input_ids, data.loss_mask, data.document_ids))
    my_trainers = [r for i, r in enumerate(ctx.trainer_ranks) if i % T == t]
    log.info("target rank %d: %d rows, serving trainer ranks %s", ctx.rank, len(rows[0]), my_trainers)

    # the first request of the first trainer carries the resume state
    pending_first: dict[int, tuple[int, int]] = {}
    for r in my_trainers:
        hdr = torch.empty(2, dtype=torch.int64)
        dist.recv(hdr, r)
        pending_first[r] = (int(hdr[0]), int(hdr[1]))
    first_meta = _recv_bytes(my_trainers[0], pending_first[my_trainers[0]][1]) if pending_first[my_trainers[0]][1] else {}
    for r in my_trainers[1:]:
        if pending_first[r][1]:
            _recv_bytes(r, pending_first[r][1])
    order = DataOrder(len(rows[0]), cfg.train.seed + 7919 * t)
    if first_meta.get("resume"):
        order.load_state_dict(first_meta["resume"])
    capture_ids = _capture_ids(cfg, layer_ids, target)
    if group is not None:
        from dflash_train.targets.sharded import GroupLeaderTarget

        target = GroupLeaderTarget(target, group, ctx.rank)
    source = TargetBatchSource(rows, order, target, capture_ids, cfg.train.batch_size, cfg.pipeline.cache_features)
    pipe = Pipeline(source, cfg.pipeline.queue_depth, torch.device("cpu") if device.type == "cpu" else device,
                    num_workers=cfg.pipeline.num_target_workers).start()
    active = {r: pending_first[r][0] == 1 for r in my_trainers}
    first_round = True
    try:
        while any(active.values()):
            for r in my_trainers:
                if not active[r]:
                    continue
                if not first_round:
                    hdr = torch.empty(2, dtype=torch.int64)
                    dist.recv(hdr, r)
                    if int(hdr[1]):
                        _recv_bytes(r, int(hdr[1]))
                    if int(hdr[0]) == 0:
                        active[r] = False
                        continue
                batch = pipe.get()
                b, tt = batch.input_ids.shape
                meta = json.dumps({"positions": batch.positions, "order_state": batch.order_state}).encode()
                dist.send(torch.tensor([b, tt, batch.features.shape[-1], len(meta)], dtype=torch.int64), r)
                dist.send(batch.input_ids.contiguous(), r)
                dist.send(batch.loss_mask.to(torch.uint8).contiguous(), r)
                dist.send(batch.document_ids.to(torch.int32).contiguous(), r)
                dist.send(batch.features.contiguous(), r)
                dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), r)
            first_round = False
    finally:
        pipe.close()
        if group is not None:
            target.stop()  # the group's other ranks leave follow_group_leader
    log.info("target rank %d: all trainers done", ctx.rank)
    return 0
