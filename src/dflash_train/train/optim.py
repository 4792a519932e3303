"""The drafter's optimizer (`train.optimizer`).

adamw: AdamW over everything, weight decay on matrices only.
muon:  torch.optim.Muon (Newton-Schulz orthogonalised momentum, Keller Jordan's Muon) for
       the 2-D weight matrices, at train.lr * train.muon_lr_mult (vLLM speculators'
       best-practice default: 10x), and AdamW at train.lr for the rest (norm weights,
       biases, degenerate [1, N] matrices). The drafter has no embedding or lm_head of
       its own (it shares the target's, frozen), so every real matrix goes to Muon.

Both are ONE torch Optimizer to the trainer (`MuonWithAdamW`): the lr scheduler, zero_grad,
the checkpoint's state_dict and the resume rule see one object. Every param group carries
`lr_mult` (1 for AdamW groups), so lr(step) = train.lr * lr_mult * factor(step).
"""
from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "muon")


def _is_matrix(p: torch.Tensor) -> bool:
    return p.ndim == 2 and min(p.shape) > 1


def make_optimizer(drafter: torch.nn.Module, train_cfg) -> torch.optim.Optimizer:
    kind = train_cfg.optimizer
    params = [p for p in drafter.parameters() if p.requires_grad]
    adamw_kw = dict(lr=train_cfg.lr, betas=tuple(train_cfg.betas), eps=1e-8)
    if kind == "adamw":
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": train_cfg.weight_decay, "lr_mult": 1.0},
             {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0}], **adamw_kw)
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r}; one of {', '.join(OPTIMIZERS)}")
    mult = float(train_cfg.muon_lr_mult)
    matrices = [p for p in params if _is_matrix(p)]
    rest = [p for p in params if not _is_matrix(p)]
    muon = torch.optim.Muon(
        [{"params": matrices, "lr": train_cfg.lr * mult, "lr_mult": mult}],
        lr=train_cfg.lr * mult, weight_decay=train_cfg.weight_decay, momentum=float(train_cfg.muon_momentum),
        nesterov=True, adjust_lr_fn=train_cfg.muon_adjust_lr)
    adamw = torch.optim.AdamW([{"params": rest, "weight_decay": 0.0, "lr_mult": 1.0}], **adamw_kw)
    return MuonWithAdamW(muon, adamw)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped together as one Optimizer. Its param_groups are the inner
    optimizers' own group dicts (the same objects), so a scheduler setting group["lr"]
    here sets it for the optimizer that uses it."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, defaults={})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict:
        return {"kind": "muon+adamw", "muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("kind") != "muon+adamw":
            raise ValueError("optimizer state is not a muon+adamw state (written with another train.optimizer)")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # load_state_dict gives the inner optimizers new group dicts: share those again
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

