"""Process roles under torchrun, the process groups, the collectives the trainer needs (no-ops
alone), and the drafter's wrapping (DDP or FSDP2). One key picks the layout, `pipeline.layout`:

* colocated: every rank holds the whole target AND a drafter replica and runs the one-process
  pipeline (target thread -> bounded queue -> trainer) over its slice of each global batch
  (data/order.py RankSlice); the drafters train data-parallel over the world group. SpecForge's
  and ModelOpt's default; torchrun with one process also takes this path (a world of one).
* split: ranks 0..T-1 (T = pipeline.target_ranks) run the frozen target and serve batches; the
  remaining ranks train. Target rank t owns the rows t, t+T, ... and serves trainers i with
  i % T == t (`target_for`). The batches travel on `wire_group`, a gloo group made for them, as
  host tensors (pipeline/remote.py): under CUDA the world is NCCL, which carries CUDA tensors only,
  and the same rule then runs on CPU CI as it is. Tensor-parallel target groups
  (pipeline.target_tp_size = G > 1): ranks [g*G, (g+1)*G) hold target g (targets/sharded.py); the
  leader g*G (`leader_of`) talks to trainers as target rank g above.

Which device a collective's tensors sit on follows the group's backend (`collective_device`):
NCCL takes CUDA tensors only, gloo takes host tensors.
"""
from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from dflash_train.config import ConfigError
from dflash_train.utils import resolve_device

log = logging.getLogger("dflash_train")


def launched_by_torchrun() -> bool:
    """torchrun (or any launcher of torch.distributed's env:// rendezvous) set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def collective_device(backend: str, local_rank: int) -> torch.device:
    """Where a tensor handed to a collective of `backend` must sit: NCCL refuses host tensors
    ("No backend type associated with device type cpu"), gloo's point-to-point refuses CUDA ones."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


class DistContext:
    def __init__(self, cfg, world_size: int = 1, rank: int = 0, local_rank: int = 0,
                 distributed: bool | None = None) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.rank = rank
        self.local_rank = local_rank
        # a process group exists: world > 1, or torchrun's world of one in the colocated layout
        self.distributed = world_size > 1 if distributed is None else distributed
        # every rank captures its own features (colocated, or a single process)
        self.colocated = not self.distributed or cfg.pipeline.layout == "colocated"
        split = not self.colocated
        self.num_target_ranks = cfg.pipeline.target_ranks if split else 0
        if split and not (1 <= self.num_target_ranks < world_size):
            raise ConfigError(
                f"pipeline.target_ranks={self.num_target_ranks} must leave at least one trainer rank "
                f"and be >= 1 (world size {world_size}); or pipeline.layout=colocated")
        # tensor-parallel target groups: ranks [g*tp, (g+1)*tp) hold target g; g*tp (the group leader)
        # serves the trainers, exactly as an unsharded target rank g would (same rows, same data order)
        self.target_tp_size = cfg.pipeline.target_tp_size
        if self.target_tp_size > 1 and not split:
            raise ConfigError(f"pipeline.target_tp_size={self.target_tp_size} shards the target over the target "
                              "ranks of pipeline.layout=split under torchrun; a colocated rank or a single "
                              "process holds the whole target (set it to 1)")
        if split and self.num_target_ranks % self.target_tp_size:
            raise ConfigError(f"pipeline.target_ranks={self.num_target_ranks} is not a multiple of "
                              f"pipeline.target_tp_size={self.target_tp_size} (each target group has "
                              f"target_tp_size ranks; world size {world_size})")
        self.num_target_groups = self.num_target_ranks // self.target_tp_size
        self.target_group = None  # this target rank's process group when target_tp_size > 1
        self.target_self_group = None  # this target rank alone (size-1 mesh dims)
        self.is_target_rank = split and rank < self.num_target_ranks
        self.trainer_ranks = list(range(self.num_target_ranks, world_size)) if self.distributed else [0]
        self.num_trainers = len(self.trainer_ranks)
        if split and self.num_target_groups > self.num_trainers:
            raise ConfigError(f"pipeline.target_ranks={self.num_target_ranks} makes {self.num_target_groups} "
                              f"targets for {self.num_trainers} trainer rank(s): a target with no trainer "
                              f"would wait forever; use at most {self.num_trainers} target groups")
        self.trainer_index = self.trainer_ranks.index(rank) if rank in self.trainer_ranks else -1
        self.is_leader = (not self.distributed) or rank == self.num_target_ranks
        self.trainer_group = None
        self.wire_group = None  # split: the gloo group the batches travel on (pipeline/remote.py)
        self.backend = "none"
        self.fsdp = False  # set by wrap_model when the drafter is sharded

    @classmethod
    def from_env(cls, cfg) -> "DistContext":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        colocated_one = world == 1 and launched_by_torchrun() and cfg.pipeline.layout == "colocated"
        if world <= 1 and not colocated_one:
            return cls(cfg)
        ctx = cls(cfg, world, int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), distributed=True)
        use_cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
        ctx.backend = "nccl" if use_cuda else "gloo"
        if use_cuda:
            torch.cuda.set_device(ctx.local_rank)
        dist.init_process_group(ctx.backend, timeout=timedelta(minutes=30))
        # new_group is collective over the world: every rank creates every group, in the same order
        ctx.trainer_group = dist.new_group(ctx.trainer_ranks)
        if not ctx.colocated:
            ctx.wire_group = dist.new_group(backend="gloo")
        if ctx.target_tp_size > 1:
            # every target group, and a one-rank group per target rank (the size-1 dims of
            # transformers' TP mesh), in order
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

    # ------------------------------------------------------------------ devices
    def trainer_device(self, default: torch.device) -> torch.device:
        if self.distributed and default.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return default

    def target_device(self, trainer_device: torch.device) -> torch.device:
        if self.distributed:
            return trainer_device  # each rank uses its own GPU (or the CPU)
        return resolve_device(self.cfg.target.device)

    # ------------------------------------------------------------------ collectives (no-ops alone)
    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the trainer ranks in place, without a host read (it stays on its device:
        the training device, which is CUDA under NCCL)."""
        if self.distributed and self.num_trainers > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.trainer_group)
        return t

    def _reduce(self, value: float, op) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([float(value)], device=collective_device(self.backend, self.local_rank))
        dist.all_reduce(t, op=op, group=self.trainer_group)
        return float(t.item())

    def agree_stop(self, local: bool) -> bool:
        return self._reduce(1.0 if local else 0.0, dist.ReduceOp.MAX if self.distributed else None) > 0

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

    def no_sync(self, model):
        return model.no_sync() if isinstance(model, _DDP) else contextlib.nullcontext()

    def wrap_model(self, drafter: torch.nn.Module) -> torch.nn.Module:
        if not self.distributed or self.num_trainers == 1:
            return drafter
        dev = next(drafter.parameters()).device
        if self.cfg.train.sharding == "fsdp2":
            # a mesh over the trainer ranks only (split: the target ranks never join its collectives).
            # One FSDP unit for the whole drafter: its forward projects the context through
            # every layer's k/v weights before running the layers, so per-layer units would
            # be used outside their own forward. Parameters, gradients and optimizer state
            # stay sharded between steps; the full weights exist only inside forward/backward.
            mesh = DeviceMesh.from_group(self.trainer_group, dev.type)
            fully_shard(drafter, mesh=mesh)
            self.fsdp = True
            return drafter
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets instead of beside
        # them (4.2 GB less at the 8B drafter's 1.05B fp32 parameters)
        return _DDP(drafter, device_ids=[dev.index] if dev.type == "cuda" else None,
                    process_group=self.trainer_group, gradient_as_bucket_view=True)

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ roles
    def target_for(self, trainer_index: int) -> int:
        """split: the target (group) index serving trainer `trainer_index`; its leader's rank is `leader_of`."""
        return trainer_index % self.num_target_groups

    def leader_of(self, target_index: int) -> int:
        return target_index * self.target_tp_size

    def combine_order_states(self, local_state: dict) -> dict:
        """split: {"per_target": {t: state after the last batch any of t's trainers consumed}}.
        Colocated ranks walk one global order (each its slice of a batch): every rank holds the same state."""
        if self.colocated:
            return local_state
        all_states = self.gather_objects(local_state)
        per_target: dict[str, dict] = {}
        for i, st in enumerate(all_states):
            per_target[str(self.target_for(i))] = st  # later trainers of a target hold its latest state
        return {"per_target": per_target}


class _DDP(torch.nn.parallel.DistributedDataParallel):
    """DDP whose forward syncs gradients, and which answers attribute reads
    (cfg, fc, ...) from the drafter it wraps, so the loss code takes either."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
