"""One rank of tests/test_train_ranks_update.py (run with torchrun, gloo): rank 0 stands for the
target rank, ranks 1..N-1 are trainers; each trainer takes its share of the rows of a fixed batch
(anchors fixed beforehand), runs the training step's forward/backward through DDP and
`scale_gradients` over the all-reduced weight, and rank 1 saves the resulting gradients."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from dflash_train.config import load_config
from dflash_train.model import dflash_loss
from dflash_train.model.objectives import Objective
from dflash_train.train.distributed import DistContext
from dflash_train.train.step import scale_gradients
from test_model_objectives import H, setup


def step_gradients(ctx, kind: str, rows: list[int]) -> dict[str, torch.Tensor]:
    """The gradients of one training step over `rows` of the fixed batch, as the trainer makes them."""
    t, d, ids, lm, docs, feats, anchors = setup()
    model = ctx.wrap_model(d) if ctx is not None else d
    obj = Objective(kind)
    feats = feats if obj.needs_teacher else feats[..., :2 * H]
    total_weight = torch.zeros(())
    for r in rows:  # one micro-batch per row: accumulation is part of what must not change the update
        sl = slice(r, r + 1)
        out = dflash_loss(model, t, ids[sl], lm[sl], docs[sl], feats[sl], num_anchors=9, generator=None,
                          gamma=3.0, chunk_blocks=2, anchors=(anchors[0][sl], anchors[1][sl]), objective=obj)
        out.total.backward()
        total_weight += out.weight_sum
    total = total_weight.reshape(1).clone()
    if ctx is not None:
        ctx.all_reduce_sum_(total)  # the step's weight over every trainer rank, as TrainStep reduces it
    scale_gradients(d, total[0], ctx.num_trainers if ctx is not None else 1)
    return {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    cfg = load_config(None, ["pipeline.target_ranks=1"])
    ctx = DistContext.from_env(cfg)
    if ctx.is_target_rank:
        dist.barrier()
        return ctx.shutdown()
    # 2 rows in the fixed batch (tests/test_model_objectives.py setup): trainer i takes row i
    grads = step_gradients(ctx, kind, [ctx.trainer_index])
    if ctx.is_leader:
        torch.save(grads, out)
    dist.barrier()
    ctx.shutdown()


if __name__ == "__main__":
    main()
