"""The layout rule (pipeline/layout.py), the start-up refusals, which device a collective's tensors
sit on for which backend, and a colocated rank's slice of the data order."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_train.config import ConfigError, load_config
from dflash_train.data import DataOrder, RankSlice
from dflash_train.pipeline.layout import StageRates, advice, check_layout, check_memory, memory_line
from dflash_train.train.distributed import DistContext, collective_device


def test_node_rule_with_the_h200_figures():
    # docs/benchmarks.md "GPU": target 28,369, trainer 13,181, both on one GPU 11,234 tok/s
    node = StageRates(28_369, 13_181, 11_234).node(8)
    assert node["colocated"] == pytest.approx(89_872)
    # 2 + 6 gives min(56,738, 79,086) = 56,738; 3 + 5 gives min(85,107, 65,905) = 65,905: the best split
    assert node["split_target_ranks"] == 3 and node["split"] == pytest.approx(65_905)
    # a target slower than its trainer: more target ranks win
    assert StageRates(10_000, 30_000, 8_000).node(8)["split_target_ranks"] == 6
    assert "colocated is faster" in StageRates(28_369, 13_181, 11_234).describe(8)
    assert "split is faster" in StageRates(28_369, 13_181, 5_000).describe(8)


def test_advice_reads_an_interval_record():
    rec = {"tokens_per_s": 2000.0, "target_busy": 0.5, "trainer_busy": 0.8}
    line = advice(rec, colocated=True, num_trainers=2, node_gpus=8)
    assert "target 2,000, trainer 1,250, both 1,000 tok/s" in line  # 1,000 tok/s per rank
    assert advice({"trainer_wait": 0.7}, colocated=False, num_trainers=7, node_gpus=8).startswith("layout split")
    assert advice({"trainer_wait": 0.1}, colocated=False, num_trainers=7, node_gpus=8) is None


def test_collectives_put_tensors_where_the_backend_takes_them():
    assert collective_device("nccl", 3) == torch.device("cuda", 3)
    assert collective_device("gloo", 3) == torch.device("cpu")


def test_start_up_refusals_name_the_key():
    cfg = load_config(None, ["train.sharding=fsdp2", "eval.every_steps=100", "pipeline.layout=colocated"])
    with pytest.raises(ConfigError, match="eval.every_steps with train.sharding=fsdp2"):
        check_layout(cfg, world_size=8)
    check_layout(cfg, world_size=1)  # one process: nothing is sharded
    split = load_config(None, ["pipeline.layout=split", "pipeline.target_ranks=5"])
    with pytest.raises(ConfigError, match="5 targets for 3 trainer rank"):
        DistContext(split, world_size=8, rank=0)
    with pytest.raises(ConfigError, match="must leave at least one trainer rank"):
        DistContext(load_config(None, ["pipeline.target_ranks=8"]), world_size=8, rank=0)
    with pytest.raises(ConfigError, match="target_tp_size=2 shards the target"):
        DistContext(load_config(None, ["pipeline.layout=colocated", "pipeline.target_tp_size=2"]), world_size=8)
    with pytest.raises(ConfigError, match="need 16.0 GiB .* but 8.0 GiB are free"):
        check_memory(8 * 2**30, 2**30, "cuda:0")
    check_memory(17 * 2**30, 2**30, "cuda:0")


def test_colocated_roles():
    ctx = DistContext(load_config(None, ["pipeline.layout=colocated"]), world_size=4, rank=2)
    assert ctx.colocated and not ctx.is_target_rank and not ctx.is_leader
    assert ctx.trainer_ranks == [0, 1, 2, 3] and ctx.trainer_index == 2
    assert ctx.combine_order_states({"position": 5}) == {"position": 5}


def test_rank_slices_cover_one_process_batches():
    one = DataOrder(10, seed=3)
    ranks = [RankSlice(DataOrder(10, seed=3), r, 2) for r in range(2)]
    for _ in range(7):  # across epoch boundaries
        whole = one.rows_for(one.next_positions(4))
        parts = [r.rows_for(r.next_positions(2)) for r in ranks]
        assert parts[0] + parts[1] == whole
        assert ranks[0].state_dict() == ranks[1].state_dict() == one.state_dict()
    again = RankSlice(DataOrder(10, seed=3), 1, 2)
    again.load_state_dict(ranks[1].state_dict())
    assert again.next_positions(2) == ranks[1].next_positions(2)


def test_the_gpu_recipe_holds_together_on_one_and_two_nodes():
    """configs/gpu-8b.yaml: every key is one its layout accepts, at the README's world sizes."""
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "gpu-8b.yaml", [])
    assert cfg.pipeline.layout == "colocated"
    for world in (8, 16):
        check_layout(cfg, world)
        for rank in (0, world - 1):
            ctx = DistContext(cfg, world_size=world, rank=rank)
            assert ctx.colocated and ctx.num_trainers == world and not ctx.is_target_rank


def test_start_up_line_says_what_each_rank_holds():
    ctx = DistContext(load_config(None, ["pipeline.layout=colocated"]), world_size=8, rank=0)
    line = memory_line(ctx, 16_400_000_000, 1_050_000_000)
    assert line == ("layout colocated on 8 rank(s): each holds the target's 16,400.0 MB of weights and a drafter "
                    "of 1,050.00M params, 16,800.0 MB with its gradients and AdamW state")
