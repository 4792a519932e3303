"""The training objectives (`train.loss`), one row of logits at a time.

Every objective is a per-position term t_i with a per-position weight w_i, and
loss = sum_i w_i * t_i / sum_i w_i (the trainer divides by the sum over ALL micro-batches
and trainer ranks of a step, train/step.py). The chunked loss (model/loss.py) calls
`chunk_terms` on a few rows at a time: it returns each row's term and the gradient of
that term with respect to the row's drafter hidden state, UNWEIGHTED, so weights that
depend on other rows' results (D-PACE) are applied after the whole block is known,
without a second pass over the lm_head.

Notation: z = draft logits (through the target's lm_head, multiplier and soft-cap),
p = softmax(z), y = the label (the token at that position), p_t = the target's own
next-token distribution at that position (teacher), computed here from the target's
final hidden state through the same head.

  ce_decay   t = -log p_y,                    w = exp(-(k-1)/gamma)       (DFlash, today's default)
  dpace      t = -log p_y,                    w = D-PACE weight (below)   (arXiv 2605.18810)
  distill    t = KL(p_t || p)                 w = decay                   (logit distillation)
  lk_alpha   t = -log(alpha), alpha = sum_v min(p_v, p_t,v)     w = decay (LK^alpha, arXiv 2602.23881)
  lk_lambda  t = lam * KL(p_t || p) + (1 - lam) * TV(p, p_t),   lam = exp(-eta * alpha) held constant
             (LK^lambda: KL while acceptance is low, total variation = 1 - alpha as it rises)

`train.loss_ce_weight` = c mixes the hard-label cross-entropy into the teacher objectives:
t = (1 - c) * t + c * (-log p_y) (the usual hard + soft label distillation blend).

D-PACE (dynamic position-aware CE): with q_k = p(y_k) at block position k (held constant),
the expected accepted length of a block is sum_m prod_{j<=m} q_j; its gradient gives
position k the weight w_k = sum_{m>=k} prod_{j<=m} s_j, s_j = (1 - a) q_j + a (the paper's
smoothing a = `loss_dpace_alpha`, so early in training, when every q is ~0, later positions
still learn). Unsupervised positions are 1 inside the products and 0 in the sums. The
paper divides the weighted sum by the batch size; here it is normalised by sum w like
every other objective, so lr and grad clipping mean the same for all of them (with AdamW
only the relative weights matter).

Gradients (all with respect to z; the chain through soft-cap and multiplier follows):
  CE: p - onehot(y)        KL: p - p_t
  TV: -p * (1[p <= p_t] - s), s = sum of p over {p <= p_t}   (alpha = 1 - TV)
  -log alpha: dTV / alpha  (0 where alpha is below 1e-5, where the loss is clamped)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

OBJECTIVES = ("ce_decay", "dpace", "distill", "lk_alpha", "lk_lambda")
TEACHER_OBJECTIVES = ("distill", "lk_alpha", "lk_lambda")
LK_EPS = 1e-5  # alpha floor of -log(alpha), as in the LK reference implementation


@dataclass(frozen=True)
class Objective:
    kind: str = "ce_decay"
    ce_weight: float = 0.0
    dpace_alpha: float = 0.5
    lk_eta: float = 3.0

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.kind!r}; one of {', '.join(OBJECTIVES)}")

    @property
    def needs_teacher(self) -> bool:
        """True when the loss reads the target's own distribution (its final hidden state)."""
        return self.kind in TEACHER_OBJECTIVES

    @property
    def decay_weights(self) -> bool:
        return self.kind != "dpace"

    @classmethod
    def from_train_config(cls, train_cfg) -> "Objective":
        return cls(kind=train_cfg.loss, ce_weight=float(train_cfg.loss_ce_weight),
                   dpace_alpha=float(train_cfg.loss_dpace_alpha), lk_eta=float(train_cfg.loss_lk_eta))


def head_logits(h: torch.Tensor, W: torch.Tensor, mult: float, cap: float | None):
    """fp32 logits softcap(mult * h @ W^T) and tanh(z / cap) (None without soft-cap)."""
    z = F.linear(h.to(W.dtype), W).float()
    if mult != 1.0:
        z.mul_(mult)
    t = None
    if cap is not None:
        t = torch.tanh(z / cap)
        z = t * cap
    return z, t


def chunk_terms(h, teacher_h, W, labels, objective: Objective, mult: float, cap: float | None, need_grad: bool):
    """One chunk of rows: (term [n] fp32, d term / d h [n, H] or None, argmax [n]).

    labels < 0 (outside a vocab subset) give a finite placeholder term; their weight is 0."""
    z, t = head_logits(h, W, mult, cap)
    lab = labels.clamp(min=0)[:, None]
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(1, lab)[:, 0]
    pred = z.argmax(-1)
    kind = objective.kind
    if kind in ("ce_decay", "dpace"):
        term = ce
        g = None
        if need_grad:
            g = z.sub_(lse[:, None]).exp_()  # softmax, in place in the logits buffer
            g.scatter_add_(1, lab, torch.full_like(lab, -1.0, dtype=g.dtype))
    else:
        zt, _ = head_logits(teacher_h, W, mult, cap)
        logp_t = torch.log_softmax(zt, dim=-1)
        del zt
        logp = z.sub_(lse[:, None])  # log p, in place
        p = logp.exp()
        p_t = logp_t.exp()
        if kind == "distill":
            term = (p_t * (logp_t - logp)).sum(-1)
            g = p - p_t if need_grad else None
        else:
            alpha = torch.minimum(p, p_t).sum(-1)
            inside = p <= p_t
            s = (p * inside).sum(-1)
            dtv = p * (s[:, None] - inside.to(p.dtype)) if need_grad else None
            if kind == "lk_alpha":
                term = -torch.log(alpha.clamp_min(LK_EPS))
                g = dtv * (alpha >= LK_EPS).to(p.dtype)[:, None] / alpha.clamp_min(LK_EPS)[:, None] if need_grad else None
            else:  # lk_lambda
                lam = torch.exp(-objective.lk_eta * alpha)
                kl = (p_t * (logp_t - logp)).sum(-1)
                term = lam * kl + (1.0 - lam) * (1.0 - alpha)
                g = lam[:, None] * (p - p_t) + (1.0 - lam)[:, None] * dtv if need_grad else None
        del logp_t, p_t
        c = objective.ce_weight
        if c > 0:
            term = (1.0 - c) * term + c * ce
            if need_grad:
                g.mul_(1.0 - c).add_(p, alpha=c)
                g.scatter_add_(1, lab, torch.full_like(lab, -c, dtype=g.dtype))
    grad = None
    if need_grad:
        if t is not None:
            g.mul_(1.0 - t * t)
        if mult != 1.0:
            g.mul_(mult)
        grad = (g.to(W.dtype) @ W).to(h.dtype)
    return term, grad, pred


def dpace_weights(q: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [M, K] from q [M, K] (probability of the label at block position k,
    no gradient) and the supervised mask [M, K]: w_k = sum_{m>=k} prod_{j<=m} s_j over
    supervised m, s_j = (1 - alpha) q_j + alpha (1 where not supervised); 0 where not supervised."""
    sup = supervised.to(q.dtype)
    smooth = torch.where(supervised, (1.0 - alpha) * q + alpha, torch.ones_like(q))
    prefix = torch.cumprod(smooth, dim=-1)
    suffix = torch.flip(torch.cumsum(torch.flip(prefix * sup, dims=[-1]), dim=-1), dims=[-1])
    return suffix * sup


def capture_layer_ids(layer_ids, num_target_layers: int, objective: Objective) -> list[int]:
    """The target layers to capture for this objective: the drafter's, plus the final hidden
    state (layer id == num_target_layers: after the final norm, what the lm_head reads) when
    the loss needs the target's distribution. Its H channels come last in the features."""
    ids = [int(i) for i in layer_ids]
    return ids + [int(num_target_layers)] if objective.needs_teacher else ids
