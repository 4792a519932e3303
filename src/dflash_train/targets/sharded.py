"""One target held by a group of ranks, tensor parallel (pipeline.target_tp_size > 1 under torchrun).

Sharding is transformers' own: the model's tensor-parallel plan (``base_model_tp_plan`` /
``_tp_plan``: q/k/v/gate/up colwise, o/down rowwise, embedding rowwise, lm_head colwise)
applied as DTensors on a ``DeviceMesh`` of the group. `load_sharded_target` (HF safetensors
directories) loads with ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=G))``,
so each rank reads only its own shards from the files. transformers builds that mesh over the
WHOLE world (it refuses a world size other than the mesh size), while here only the G ranks of
one group form it and the trainer ranks stay outside: the model class is subclassed for the load
with ``prepare_distribute_model`` returning the group's mesh (`group_meshes`: the 4-D
(pp, dp_replicate, fsdp, tp) mesh transformers expects, built with ``DeviceMesh.from_group`` from
process groups every rank created in the same order, so no collective is left unmatched).
MoE targets with an expert-parallel plan also get ``ep_size=G`` (each rank holds 1/G of the
experts; the dense plan alone replicates them).
Targets that are not such a directory (GGUF, VLM checkpoints) load whole on the CPU and are
sharded in place by `shard_target` (``apply_tensor_parallelism`` with the same plan; each rank
slices its own copy, ``distribute_tensor(src_data_rank=None)``).

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
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from dflash_train.errors import first_line
from dflash_train.targets.gguf import gguf_path_of
from dflash_train.targets.loading import load_target, load_tokenizer, resolve_dtype, serving_dtype_of
from dflash_train.targets.model import Target, TargetError

log = logging.getLogger(__name__)

_CAPTURE, _STOP = 1, 0


def _comm_device(group, target: Target) -> torch.device:
    """Where broadcast tensors live: the GPU for NCCL, the CPU for gloo."""
    return target.device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _check_heads(hc, size: int, source: str) -> None:
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(hc, key, None)
        if n and n % size:
            raise TargetError(f"pipeline.target_tp_size={size} does not divide the target's {key}={n} "
                              f"({source}); pick a divisor")


def group_meshes(group, self_group, device_type: str, expert_parallel: bool = False):
    """transformers' mesh pair for one TP group: dense (pp, dp_replicate, fsdp, tp) = (1, 1, 1, G) and
    expert (pp, dp_replicate, efsdp, ep) = (1, 1, G, 1), or (1, 1, 1, G) with expert parallelism (MoE:
    each rank holds num_experts / G experts). `self_group`: this rank alone (size-1 dims)."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.utils import TransformersDeviceMesh

    ranks = torch.tensor(dist.get_process_group_ranks(group))
    g = len(ranks)
    dense = DeviceMesh.from_group([self_group, self_group, self_group, group], device_type,
                                  mesh=ranks.view(1, 1, 1, g), mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    if expert_parallel:
        expert = DeviceMesh.from_group([self_group, self_group, self_group, group], device_type,
                                       mesh=ranks.view(1, 1, 1, g), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    else:
        expert = DeviceMesh.from_group([self_group, self_group, group, self_group], device_type,
                                       mesh=ranks.view(1, 1, g, 1), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return TransformersDeviceMesh(dense, expert)


def load_sharded_target(cfg, group, self_group, device: torch.device, tokenizer=None) -> Target:
    """The target of `cfg` sharded over `group`, each rank reading only its shards (see the module docstring)."""
    import time

    from transformers import AutoConfig
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    size = dist.get_world_size(group)
    spec = cfg.path
    base = None
    if gguf_path_of(spec) is None:
        path = str(Path(spec).expanduser())
        try:
            hf_cfg = AutoConfig.from_pretrained(path)
        except Exception as e:  # noqa: BLE001
            raise TargetError(f"{path}: cannot read the target's config ({first_line(e)})") from None
        base = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_cfg), None)
    if base is None:
        log.info("%s: not a causal-LM safetensors directory; loading it whole, then sharding", spec)
        return shard_target(load_target(cfg, device="cpu", tokenizer=tokenizer), group, device)
    text = hf_cfg.get_text_config()
    _check_heads(text, size, spec)
    # MoE: the dense plan replicates the experts; the model's expert-parallel plan shards them
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or getattr(text, "n_routed_experts", None)
    expert_parallel = bool(getattr(text, "base_model_ep_plan", None)) and bool(experts) and experts % size == 0
    meshes = group_meshes(group, self_group, device.type, expert_parallel)

    class _GroupSharded(base):  # the load only: hands transformers this group's mesh
        @classmethod
        def prepare_distribute_model(cls, distributed_config, device_map=None):
            return distributed_config, device, meshes

    t0 = time.perf_counter()
    dc = DistributedConfig(tp_size=size, ep_size=size if expert_parallel else None)
    kw = dict(dtype=resolve_dtype(cfg.dtype, device), distributed_config=dc)
    try:
        try:
            model = _GroupSharded.from_pretrained(path, attn_implementation="sdpa", **kw)
        except ValueError as e:
            if "sdpa" not in str(e) and "scaled_dot_product_attention" not in str(e):
                raise
            model = _GroupSharded.from_pretrained(path, attn_implementation="eager", **kw)
    except TargetError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's broken file: one line naming it
        raise TargetError(f"{path}: cannot load the target sharded over {size} ranks ({first_line(e)})") from None
    model.eval()
    model.requires_grad_(False)
    if tokenizer is None:
        tokenizer, _ = load_tokenizer(cfg)
    target = Target(model, tokenizer, source=str(spec))
    target.serving_dtype = serving_dtype_of(cfg)
    log.info("target sharded over %d ranks (tensor parallel%s, read shard by shard) in %.1fs: %.1fM parameters "
             "on this rank", size, " + expert parallel" if expert_parallel else "", time.perf_counter() - t0,
             _local_params(model) / 1e6)
    return target


def _local_params(model) -> int:
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())


def shard_target(target: Target, group, device: torch.device) -> Target:
    """Shard `target.model` across `group` with the model's own tensor-parallel plan (in place)."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    from transformers.distributed.utils import TransformersDeviceMesh

    model = target.model
    size = dist.get_world_size(group)
    _check_heads(target.hf_config, size, target.source)
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
    log.info("target sharded over %d ranks (tensor parallel, loaded whole then sliced, %d plan rules): %.1fM "
             "parameters on this rank", size, len(tp_plan), _local_params(model) / 1e6)
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
