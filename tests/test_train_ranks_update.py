"""Issue 16: under DDP the loss is normalised so that N trainer ranks give the same update as
one rank holding the whole batch, whatever each rank's share of supervised positions (the
fixed batch's rows differ: one has a hole in its loss mask, the other one document)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dflash_train.model import dflash_loss
from dflash_train.model.objectives import Objective
from test_model_objectives import H, setup
from trainrun import REPO, env


def whole_batch_gradients(kind: str) -> dict[str, torch.Tensor]:
    """One rank, the whole batch in one micro-batch: the gradient of the weighted mean."""
    t, d, ids, lm, docs, feats, anchors = setup()
    obj = Objective(kind)
    out = dflash_loss(d, t, ids, lm, docs, feats if obj.needs_teacher else feats[..., :2 * H], 9, None,
                      gamma=3.0, chunk_blocks=2, anchors=anchors, objective=obj)
    out.loss.backward()
    return {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["ce_decay", "dpace", "distill"])
def test_two_ddp_trainer_ranks_give_the_update_of_one_rank(kind, tmp_path):
    from ranks_update_worker import step_gradients

    want = whole_batch_gradients(kind)
    # one rank, the rows as two accumulated micro-batches: the same update
    for n, g in step_gradients(None, kind, [0, 1]).items():
        torch.testing.assert_close(g, want[n], atol=1e-6, rtol=1e-5, msg=f"accumulation {n}")
    # torchrun, gloo: a target rank and two DDP trainer ranks, one row each
    out = tmp_path / "grads.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(REPO / "tests" / "ranks_update_worker.py"), kind, str(out)]
    e = env()
    e["PYTHONPATH"] = f"{REPO / 'tests'}:{e.get('PYTHONPATH', '')}"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=e, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = torch.load(out)
    assert set(got) == set(want)
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], atol=1e-6, rtol=1e-5, msg=f"2 ranks {n}")
    # the rows' supervised weights differ, so a mean of per-rank means would NOT match
    t, d, ids, lm, docs, feats, anchors = setup()
    w = [float(dflash_loss(d, t, ids[r:r + 1], lm[r:r + 1], docs[r:r + 1], feats[r:r + 1, :, :2 * H], 9, None,
                           gamma=3.0, anchors=(anchors[0][r:r + 1], anchors[1][r:r + 1])).weight_sum)
         for r in (0, 1)]
    assert abs(w[0] - w[1]) > 0.5, w
