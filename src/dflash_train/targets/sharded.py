"""One target held by a group of ranks, tensor parallel (pipeline.target_tp_size > 1 under torchrun).

Sharding is transformers' own: the model's tensor-parallel plan (``base_model_tp_plan`` /
``_tp_plan``: q/k/v/gate/up colwise, o/down rowwise, embedding rowwise) is
resolved by ``PreTrainedModel._resolve_parallel_plans`` and applied by
``transformers.distributed.tensor_parallel.apply_tensor_parallelism`` as DTensors on a
``DeviceMesh`` built from the group's process group. We do not call ``from_pretrained(...,
distributed_config=...)`` because it builds its mesh over the WHOLE world (it refuses a world
size other than the mesh size), while here only the target ranks of one group form the mesh
and the trainer ranks never join it. Consequence: every group rank first loads the whole
target into host memory (CPU, or a GPU's host RAM), then keeps only its shards
(``distribute_tensor(src_data_rank=None)``: each rank slices its own copy, no scatter).

A rowwise layer ends with an all-reduce, so every decoder layer's OUTPUT is the full,
replicated hidden state on every group rank: the forward hooks of `Target.capture` see
full tensors, no gather is needed. Features equal the unsharded target's up to float
rounding (the all-reduce sums partial products in another order).

Collectives need every group rank in the same forward. The group leader serves the
trainers as an unsharded target rank would; `GroupLeaderTarget.capture` first broadcasts
the batch (ids, document ids, layer ids) to the group, then runs its share of the forward;
the other ranks sit in `follow_group_leader`, run the same capture on what they receive,
and leave when the leader broadcasts stop. Captures are serialised by a lock (several
pipeline workers on the leader would otherwise interleave collectives).
"""
from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from dflash_train.targets.model import Target, TargetError

log = logging.getLogger(__name__)

_CAPTURE, _STOP = 1, 0


def _comm_device(group, target: Target) -> torch.device:
    """Where broadcast tensors live: the GPU for NCCL, the CPU for gloo."""
    return target.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def shard_target(target: Target, group, device: torch.device) -> Target:
    """Shard `target.model` across `group` with the model's own tensor-parallel plan (in place)."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    from transformers.distributed.utils import TransformersDeviceMesh

    model = target.model
    size = dist.get_world_size(group)
    hc = target.hf_config
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(hc, key, None)
        if n and n % size:
            raise TargetError(f"pipeline.target_tp_size={size} does not divide the target's {key}={n} "
                              f"({target.source}); pick a divisor")
    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))
    model._mesh_manager = TransformersDeviceMesh(mesh, mesh)
    try:
        tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=size))
    except ValueError as e:  # no tp plan for this architecture
        raise TargetError(f"{target.source}: cannot shard this target over {size} ranks ({e})") from None
    # the group never computes logits (capture stops after the deepest selected layer): no lm_head rule,
    # and its weight is dropped (for an untied head: vocab x hidden less on every group rank)
    tp_plan = {k: v for k, v in tp_plan.items() if not k.startswith("lm_head")}
    head = model.get_output_embeddings()
    if head is not None:
        head.register_parameter("weight", None)
    apply_tensor_parallelism(model, mesh, tp_plan)
    model.to(device)  # what the plan left whole (norms, rotary buffers)
    target.device = device
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    log.info("target sharded over %d ranks (tensor parallel, %d plan rules): %.1fM parameters on this rank",
             size, len(tp_plan), local / 1e6)
    return target


class GroupLeaderTarget:
    """The leader's view of a sharded target for the pipeline: `capture` drives the whole group."""

    def __init__(self, target: Target, group, leader: int) -> None:
        self.target = target
        self.group = group
        self.leader = leader
        self.device = target.device
        self.dtype = target.dtype
        self._lock = threading.Lock()

    def capture(self, input_ids: torch.Tensor, document_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
        with self._lock:
            dev = _comm_device(self.group, self.target)
            ids = input_ids.to(dev, torch.int64).contiguous()
            docs = document_ids.to(dev, torch.int64).contiguous()
            lids = torch.tensor([int(i) for i in layer_ids], dtype=torch.int64, device=dev)
            header = torch.tensor([_CAPTURE, *ids.shape, len(lids)], dtype=torch.int64, device=dev)
            for t in (header, ids, docs, lids):
                dist.broadcast(t, self.leader, group=self.group)
            return self.target.capture(input_ids, document_ids, layer_ids)

    def stop(self) -> None:
        with self._lock:
            stop = torch.tensor([_STOP, 0, 0, 0], dtype=torch.int64, device=_comm_device(self.group, self.target))
            dist.broadcast(stop, self.leader, group=self.group)


def follow_group_leader(target: Target, group, leader: int) -> int:
    """A non-leader rank of a target group: run every capture the leader broadcasts; returns the count."""
    n = 0
    dev = _comm_device(group, target)
    while True:
        header = torch.empty(4, dtype=torch.int64, device=dev)
        dist.broadcast(header, leader, group=group)
        cmd, b, t, k = header.tolist()
        if cmd == _STOP:
            return n
        ids = torch.empty(b, t, dtype=torch.int64, device=dev)
        docs = torch.empty(b, t, dtype=torch.int64, device=dev)
        lids = torch.empty(k, dtype=torch.int64, device=dev)
        for x in (ids, docs, lids):
            dist.broadcast(x, leader, group=group)
        target.capture(ids, docs, lids.tolist())
        n += 1
