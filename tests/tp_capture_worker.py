"""Run under torchrun (2 ranks, gloo): one tiny target sharded over both ranks (pipeline.target_tp_size=2).
Rank 0 leads the group (GroupLeaderTarget) and compares its captures of packed rows (several documents,
padding) with the unsharded target's; rank 1 follows. Both ways of sharding: read shard by shard from the files (load_sharded_target) and loaded whole
then sliced (shard_target). Rank 0 writes {"DIR:how": {max_abs_diff, ...}} to argv[1].

usage: torchrun --nproc-per-node 2 tests/tp_capture_worker.py OUT.json TARGET_DIR[,TARGET_DIR...]
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dflash_train.config import TargetConfig
from dflash_train.targets import load_target
from dflash_train.targets.sharded import (GroupLeaderTarget, follow_group_leader, load_sharded_target,
                                         shard_target)


def packed_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(vocab, 400), (2, 24), generator=g)
    docs = torch.tensor([[0] * 9 + [1] * 11 + [-1] * 4, [0] * 24], dtype=torch.int32)
    return ids, docs


def main() -> None:
    out, dirs = sys.argv[1], sys.argv[2].split(",")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    alone = {r: dist.new_group([r]) for r in (0, 1)}
    report = {}
    cpu = torch.device("cpu")
    for d, how in [(d, how) for d in dirs for how in ("from_files", "whole_then_sliced")]:
        cfg = TargetConfig(path=d)
        if how == "from_files":  # each rank reads its shards (what target ranks do with a HF directory)
            sharded = load_sharded_target(cfg, group, alone[rank], cpu)
        else:  # the fallback for GGUF / VLM targets
            sharded = shard_target(load_target(cfg, device="cpu"), group, cpu)
        layers = dict(sharded.model.named_parameters())
        local = {n: tuple(p.to_local().shape) for n, p in layers.items() if hasattr(p, "to_local")}
        if rank == 1:
            follow_group_leader(sharded, group, 0)
            continue
        leader = GroupLeaderTarget(sharded, group, 0)
        ids, docs = packed_rows(sharded.vocab_size)
        layer_ids = [0, 2, sharded.num_layers - 1]
        got = leader.capture(ids, docs, layer_ids)
        single = leader.capture(ids[1:], docs[1:], [1])  # a second capture with another shape and layer set
        leader.stop()
        full = load_target(cfg, device="cpu")
        want = full.capture(ids, docs, layer_ids)
        want_single = full.capture(ids[1:], docs[1:], [1])
        report[f"{d}:{how}"] = {
            "max_abs_diff": max(float((got - want).abs().max()), float((single - want_single).abs().max())),
            "max_abs": float(want.abs().max()),
            "shape_ok": got.shape == want.shape and single.shape == want_single.shape,
            "q_proj_local": local.get("model.layers.0.self_attn.q_proj.weight"),
            "q_proj_full": tuple(full.model.model.layers[0].self_attn.q_proj.weight.shape),
            "params_local": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                                for p in sharded.model.parameters()),
            "params_full": sum(p.numel() for p in full.model.parameters()),
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()  # nobody tears its process groups down while the other rank still works
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
