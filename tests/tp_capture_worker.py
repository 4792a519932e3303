"""Run under torchrun (2 ranks, gloo): one tiny target sharded over both ranks (pipeline.target_tp_size=2).
Rank 0 leads the group (GroupLeaderTarget) and compares its captures of packed rows (several documents,
padding) with the unsharded target's; rank 1 follows. Rank 0 writes {family: max_abs_diff, ...} to argv[1].

usage: torchrun --nproc-per-node 2 tests/tp_capture_worker.py OUT.json TARGET_DIR[,TARGET_DIR...]
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dflash_train.config import TargetConfig
from dflash_train.targets import load_target
from dflash_train.targets.sharded import GroupLeaderTarget, follow_group_leader, shard_target


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
    report = {}
    for d in dirs:
        cfg = TargetConfig(path=d)
        sharded = shard_target(load_target(cfg, device="cpu"), group, torch.device("cpu"))
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
        report[d] = {
            "max_abs_diff": max(float((got - want).abs().max()), float((single - want_single).abs().max())),
            "max_abs": float(want.abs().max()),
            "shape_ok": got.shape == want.shape and single.shape == want_single.shape,
            "q_proj_local": local.get("model.layers.0.self_attn.q_proj.weight"),
            "q_proj_full": tuple(full.model.model.layers[0].self_attn.q_proj.weight.shape),
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
