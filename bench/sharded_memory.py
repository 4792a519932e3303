"""Resident memory of one rank of a tensor-parallel target group (pipeline.target_tp_size = world size).

Every rank loads the target sharded over the G ranks, either reading only its shards from the files
(`load_sharded_target`, what target ranks do with a HF directory: HOW=from_files) or loading it whole
on the CPU and slicing (`shard_target`, the GGUF fallback: HOW=whole_then_sliced), reads each of its
local weights once, and reports psutil's RSS minus the RSS after the tokenizer, plus its local
parameter bytes; anon_mb is the same without file-backed pages (the memory-mapped safetensors
pages that were read, which the page cache shares and can drop); rank 0 prints one JSON line per rank.

usage: torchrun --standalone --nproc-per-node G bench/sharded_memory.py TARGET [HOW]
"""
from __future__ import annotations

import gc
import json
import sys

import psutil
import torch
import torch.distributed as dist

from dflash_train.config import TargetConfig
from dflash_train.targets import load_target, load_tokenizer
from dflash_train.targets.sharded import load_sharded_target, shard_target


def _anon(m) -> float:
    return (m.rss - m.shared) / 2**20


def main() -> None:
    dist.init_process_group("gloo")
    cfg = TargetConfig(path=sys.argv[1])
    tok, _ = load_tokenizer(cfg)
    gc.collect()
    m0 = psutil.Process().memory_info()
    how = sys.argv[2] if len(sys.argv) > 2 else "from_files"
    group, cpu = dist.new_group(), torch.device("cpu")
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    if how == "from_files":
        t = load_sharded_target(cfg, group, alone, cpu, tokenizer=tok)
    else:
        t = shard_target(load_target(cfg, device="cpu", tokenizer=tok), group, cpu)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in t.model.parameters()]
    with torch.no_grad():
        for p in local:
            p.sum()
    gc.collect()
    row = {"rank": dist.get_rank(), "ranks": dist.get_world_size(), "target": cfg.path, "how": how,
           "rss_mb": round((psutil.Process().memory_info().rss - m0.rss) / 2**20, 1),
           # RSS less its file-backed part (memory-mapped safetensors pages: page cache, shared, reclaimable)
           "anon_mb": round(_anon(psutil.Process().memory_info()) - _anon(m0), 1),
           "local_param_mb": round(sum(p.numel() * p.element_size() for p in local) / 2**20, 1)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
