"""DFlash 2: the DFlash drafter plus block-local dynamic convolutions and a candidate selector.

Numerically the same as the reference `dflash.model.DFlash2DraftModel` (PyPI dflash
0.1.0), see tests/test_model_dflash2.py. On top of the DFlash backbone (drafter.py):

- `GroupedDynamicCausalConv` before and after each attention and MLP sublayer:
  out[t] = sum_j (base[j] + delta[t, j, group]) * x[t - j], j < conv_kernel_size, where
  delta comes from one projection of the sublayer's (normed) input. It mixes a block
  position with its predecessors. At inference the drafter only ever sees one block,
  so in training, where many blocks are packed in one row, it runs on each block alone
  (the row is viewed as [rows * blocks, bs, H]; taps never cross a block boundary).
  Initialised as the identity, so a fresh DFlash 2 drafter computes what the DFlash 1
  drafter of the same seed computes.
- `CandidateSelector`: per block position t the unary top-k candidates b (logits U_t(b))
  are re-scored S_t(a, b) = U_t(b) + <A(a) * Hp(h_t), B(b)> given the predecessor a, and
  the path is chosen left to right from the anchor token (argmax at T = 0, sampled from
  softmax(S / T) otherwise; those rows are the q of rejection sampling).

State dict names are the reference's: layers.{i}.{attention,mlp}_conv.{base_kernel,
kernel_projection.weight}, candidate_selector.{predecessor,successor}_codebook.weight,
candidate_selector.hidden_projection.weight (export.py drops the codebooks' ".weight",
as the reference checkpoints store them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.model.drafter import DFlashDrafter, DrafterConfig, Layer
from dflash_train.model.drafter_config import DFLASH2_KEYS
from dflash_train.model.hf_config import is_dflash2

DFLASH2 = "dflash2"


def grouped_dynamic_causal_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [N, L, H] (one block per row), delta [N, L, kernel, groups], base [kernel, H] -> [N, L, H].

    Tap j multiplies x[t - j] (zero before the row start) by base[j] + delta[t, j] (one delta per group)."""
    N, L, H = x.shape
    groups = H // group_size
    xg = x.view(N, L, groups, group_size)
    out = torch.zeros_like(xg)
    for j in range(base.shape[0]):
        shifted = xg if j == 0 else F.pad(xg[:, :-j], (0, 0, 0, 0, j, 0))
        w = base[j].view(1, 1, groups, group_size).to(x.dtype) + delta[:, :, j, :, None]
        out = out + w * shifted
    return out.view(N, L, H)


class GroupedDynamicCausalConv(nn.Module):
    """Tap 0 of `base_kernel` (and half of the projection) runs before a sublayer (`prepare`),
    tap 1 after it (`finish`); both deltas come from the sublayer's input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of conv_group_size {group_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, Q, H] (Q a multiple of block_len) -> (conv_pre(h), the post-sublayer delta)."""
        B, Q, H = h.shape
        hb = h.reshape(B * (Q // block_len), block_len, H)
        delta = self.kernel_projection(hb).view(hb.shape[0], block_len, 2, self.kernel_size, self.groups)
        out = grouped_dynamic_causal_conv(hb, delta[:, :, 0], self.base_kernel[0], self.group_size)
        return out.view(B, Q, H), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        B, Q, H = y.shape
        yb = y.reshape(delta.shape[0], delta.shape[1], H)
        return grouped_dynamic_causal_conv(yb, delta, self.base_kernel[1], self.group_size).view(B, Q, H)


class DFlash2Layer(Layer):
    def __init__(self, cfg: DrafterConfig, layer_type: str):
        super().__init__(cfg, layer_type)
        self.block_size = cfg.block_size
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, q_rope, kv_rope, ctx_kv, mask):
        # training: Q = A * bs (many blocks); inference: one block of n <= bs tokens
        Q = x.shape[1]
        L = min(Q, self.block_size)
        if Q % L:
            raise ValueError(f"{Q} block tokens are not whole blocks of {self.block_size}")
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), L)
        q = self.self_attn.q(h, *q_rope)
        kb, vb = self.self_attn.kv(h, *kv_rope)
        k = torch.cat([ctx_kv[0], kb], dim=2)
        v = torch.cat([ctx_kv[1], vb], dim=2)
        x = x + self.attention_conv.finish(self.self_attn.attend(q, k, v, mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), L)
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        if not cfg.vocab_size:
            raise ValueError("the DFlash 2 selector needs vocab_size")
        self.top_k = int(cfg.selector_top_k)
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def pair_scores(self, projected: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """<A(a) * Hp(h), B(b)>: projected [..., r], predecessor [...], candidates [..., K] -> [..., K] (fp32)."""
        ctx = (self.predecessor_codebook(predecessor) * projected).float()
        return torch.einsum("...r,...kr->...k", ctx, self.successor_codebook(candidates).float())

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, temperature: float,
               generator: torch.Generator | None = None):
        """hidden [B, n, H], logits [B, n, V] of block positions 1..n, anchor_ids [B] ->
        (path [B, n], candidates [B, n, K], q [B, n, K] or None at T = 0).

        With the same logits and the same random draws (torch.multinomial, `generator` or the
        global one) it picks what the reference `CandidateSelector.select` picks."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        predecessor = anchor_ids
        path, q_rows = [], []
        for t in range(hidden.shape[1]):
            scores = unary[:, t].float() + self.pair_scores(projected[:, t], predecessor, candidates[:, t])
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[:, 0]
                q_rows.append(q)
            else:
                index = scores.argmax(-1)
            predecessor = candidates[:, t].gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        q = torch.stack(q_rows, dim=1) if q_rows else None
        return torch.stack(path, dim=1), candidates, q


class DFlash2Drafter(DFlashDrafter):
    layer_class = DFlash2Layer

    def selector_loss(self, h, anchor_ids, labels, weights, supervised, head, chunk_rows,
                      vocab_subset=None, subset_labels=None):
        """See the module-level selector_loss (model/loss.py calls it for DFlash 2 drafters)."""
        return selector_loss(self.candidate_selector, h, anchor_ids, labels, weights, supervised, head, chunk_rows,
                             vocab_subset, subset_labels)

    def build_extra_modules(self, cfg: DrafterConfig) -> None:
        self.candidate_selector = CandidateSelector(cfg)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """The backbone exactly as DFlash 1 draws it for the same generator (the convolutions
        take no draws and start as the identity); then the selector (registered last), drawn
        N(0, init_std): its pair term starts tiny, so the first path is ~ the unary argmax path."""
        for name, p in self.named_parameters():
            if "_conv." in name:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, self.cfg.init_std, generator=generator))
        for layer in self.layers:
            layer.attention_conv.reset_to_identity()
            layer.mlp_conv.reset_to_identity()


ARCHITECTURE_NAMES = {"dflash": "DFlash 1", DFLASH2: "DFlash 2"}


def architecture_mismatch(saved: dict, now: DrafterConfig, where) -> str | None:
    """The refusal line when a checkpoint's drafter (its manifest's drafter_config; older
    manifests, without the key, hold DFlash 1) is another architecture than this run's."""
    old = saved.get("architecture", "dflash")
    if old == now.architecture:
        return None
    return (f"checkpoint {where} holds a {ARCHITECTURE_NAMES.get(old, old)} drafter (model.architecture: {old}) "
            f"but this run builds a {ARCHITECTURE_NAMES.get(now.architecture, now.architecture)} drafter "
            f"(model.architecture: {now.architecture}); resuming one as the other is refused: "
            f"set model.architecture: {old} to resume it, or train {now.architecture} in a new --run-dir")


def build_drafter(cfg: DrafterConfig, seed: int | None = 0, generator: torch.Generator | None = None) -> DFlashDrafter:
    """The drafter `cfg.architecture` names: DFlashDrafter ("dflash") or DFlash2Drafter ("dflash2")."""
    cls = DFlash2Drafter if cfg.architecture == DFLASH2 else DFlashDrafter
    return cls(cfg, seed=seed, generator=generator)



# --------------------------------------------------------------------------- training the selector

# sums returned by selector_loss, accumulated over steps as device tensors and turned into
# ratios only when a metrics line is written (selector_metrics)
SELECTOR_SUMS = ("sel_loss", "sel_weight", "sel_rows", "sel_topk_hits", "sel_correct", "sel_blocks",
                 "sel_path_accepted", "sel_argmax_accepted")


@torch.no_grad()
def unary_topk(h: torch.Tensor, labels: torch.Tensor, head, k: int, chunk_rows: int):
    """(top-k logits sorted best first, their ids, the gold token's logit) of rows h [N, H]; chunk by
    chunk as the DFlash loss, so [N, V] logits never exist at once. head = (W, mult, cap) of loss._head."""
    W, mult, cap = head
    N = h.shape[0]
    values = torch.empty((N, k), dtype=torch.float32, device=h.device)
    ids = torch.empty((N, k), dtype=torch.long, device=h.device)
    gold = torch.empty((N,), dtype=torch.float32, device=h.device)
    for s in range(0, N, chunk_rows):
        e = min(N, s + chunk_rows)
        z = F.linear(h[s:e].detach().to(W.dtype), W).float() * mult
        if cap is not None:
            z = torch.tanh(z / cap) * cap
        values[s:e], ids[s:e] = torch.topk(z, k, dim=-1)
        gold[s:e] = z.gather(1, labels[s:e, None])[:, 0]
    return values, ids, gold


def selector_loss(selector: CandidateSelector, h: torch.Tensor, anchor_ids: torch.Tensor, labels: torch.Tensor,
                  weights: torch.Tensor, supervised: torch.Tensor, head, chunk_rows: int,
                  vocab_subset: torch.Tensor | None = None, subset_labels: torch.Tensor | None = None):
    """The selector's K-way cross-entropy, teacher-forced, and its metrics (device tensors, no host sync).

    h [B*A*n, H] drafter hidden of block positions 1..n (n = bs-1, grad flows through Hp(h));
    anchor_ids [B, A]; labels / supervised [B, A, n]; weights [B*A*n] (the DFlash loss weights).
    Row t of a block: candidates = the unary top-k (detached logits U); when the gold token is
    missing it replaces the weakest candidate in the LOSS set only; predecessor = the gold token
    before t (the anchor token for t = 1); loss = sum_w CE(U + pair, gold) / sum_w.
    Metrics keep serving semantics (strict top-k): top-k recall, teacher-forced accuracy, and the
    accepted length of the path the selector walks from the anchor vs the unary argmax path.
    With train.vocab_subset the head holds only the subset's rows (loss._head): the top-k is taken
    among them (subset_labels = labels as subset indices, -1 outside; those rows weigh 0) and the
    candidates mapped back to token ids.
    """
    B, A, n = labels.shape
    y = labels.reshape(-1)
    sup = supervised.reshape(-1)
    pred = torch.cat([anchor_ids[:, :, None], labels[:, :, :-1]], dim=2).reshape(-1)
    if vocab_subset is None:
        unary, cand, gold = unary_topk(h, y, head, selector.top_k, chunk_rows)
    else:
        unary, cand, gold = unary_topk(h, subset_labels.clamp(min=0), head, selector.top_k, chunk_rows)
        cand = vocab_subset[cand]
    hit = (cand == y[:, None]).any(-1)
    cand_loss = cand.clone()
    cand_loss[:, -1] = torch.where(hit, cand[:, -1], y)
    unary_loss = unary.clone()
    unary_loss[:, -1] = torch.where(hit, unary[:, -1], gold)
    projected = selector.hidden_projection(h)
    scores = unary_loss + selector.pair_scores(projected, pred, cand_loss)
    gold_index = (cand_loss == y[:, None]).int().argmax(-1)
    ce = F.cross_entropy(scores, gold_index, reduction="none")
    loss_sum = (ce * weights).sum()
    weight_sum = weights.sum()
    loss = loss_sum / weight_sum.clamp(min=1e-12)
    with torch.no_grad():
        proj = projected.detach()
        strict = unary + selector.pair_scores(proj, pred, cand)
        correct = (cand.gather(1, strict.argmax(-1, keepdim=True))[:, 0] == y) & sup
        # self-conditioned walk from the anchor token, per block (what serving does at T = 0)
        u3, c3, p3 = unary.view(B * A, n, -1), cand.view(B * A, n, -1), proj.view(B * A, n, -1)
        y2, s2 = y.view(B * A, n), sup.view(B * A, n)
        prev = anchor_ids.reshape(-1)
        ok = []
        for t in range(n):
            st = u3[:, t] + selector.pair_scores(p3[:, t], prev, c3[:, t])
            prev = c3[:, t].gather(1, st.argmax(-1, keepdim=True))[:, 0]
            ok.append((prev == y2[:, t]) & s2[:, t])
        path_ok = torch.stack(ok, dim=1)
        argmax_ok = (c3[:, :, 0] == y2) & s2
        sums = {
            "sel_loss": loss_sum.detach(), "sel_weight": weight_sum.detach(),
            "sel_rows": sup.sum(), "sel_topk_hits": (hit & sup).sum(), "sel_correct": correct.sum(),
            "sel_blocks": supervised.any(-1).sum(),
            "sel_path_accepted": path_ok.long().cumprod(1).sum(), "sel_argmax_accepted": argmax_ok.long().cumprod(1).sum(),
        }
    return loss, sums


def selector_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Ratios of accumulated selector sums (one host read): the metrics.jsonl fields of a DFlash 2 run."""
    if "sel_loss" not in sums:  # not a DFlash 2 run (the trainer's sums may hold others' keys)
        return {}
    v = dict(zip(SELECTOR_SUMS, torch.stack([sums[k].double() for k in SELECTOR_SUMS]).tolist()))
    rows, blocks = max(v["sel_rows"], 1.0), max(v["sel_blocks"], 1.0)
    return {
        "selector_loss": v["sel_loss"] / max(v["sel_weight"], 1e-12),
        "selector_topk_recall": v["sel_topk_hits"] / rows,
        "selector_accuracy": v["sel_correct"] / rows,
        # accepted drafts + the bonus token per block, teacher-forced context, serving's walk
        "selector_path_tau": 1.0 + v["sel_path_accepted"] / blocks,
        "argmax_path_tau": 1.0 + v["sel_argmax_accepted"] / blocks,
    }


# --------------------------------------------------------------------------- export names

# the published DFlash 2 checkpoints store the codebooks without ".weight" (the reference's
# from_pretrained maps them back with key_mapping); export writes them so, reading accepts both
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def to_export_names(sd: dict) -> dict:
    return {(k[: -len(".weight")] if k[: -len(".weight")] in _CODEBOOKS and k.endswith(".weight") else k): v
            for k, v in sd.items()}


def from_export_names(sd: dict) -> dict:
    return {(k + ".weight" if k in _CODEBOOKS else k): v for k, v in sd.items()}


def export_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the DFlash 2 additions for an exported config.json dict `c`
    (empty for a DFlash 1 config)."""
    if not is_dflash2(c):
        return {}
    dfc = c.get("dflash_config") or {}
    H, V = int(c["hidden_size"]), int(c["vocab_size"])
    kernel, group = int(dfc["conv_kernel_size"]), int(dfc["conv_group_size"])
    rank = int(dfc["selector_rank"])
    out: dict[str, tuple[int, ...]] = {}
    for i in range(int(c["num_hidden_layers"])):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, kernel, H)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * kernel * (H // group), H)
    out.update({_CODEBOOKS[0]: (V, rank), _CODEBOOKS[1]: (V, rank),
                "candidate_selector.hidden_projection.weight": (rank, H)})
    return out


def config_problems(c: dict) -> list[str]:
    """What an engine's DFlash 2 loader would refuse in config.json dict `c` (none for DFlash 1)."""
    if not is_dflash2(c):
        return []
    dfc = c.get("dflash_config") or {}
    P = []
    for k in DFLASH2_KEYS:
        v = dfc.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            P.append(f"dflash_config.{k} is {v!r}, not a positive integer (DFlash2DraftModel needs it)")
    g = dfc.get("conv_group_size")
    if not P and int(c["hidden_size"]) % g:
        P.append(f"hidden_size {c['hidden_size']} is not a multiple of dflash_config.conv_group_size {g}")
    return P


# the model card's DFlash 2 section (report.model_card); engine status from their merged pull
# requests (read August 2026), not from a serving run of ours
SERVING_NOTE = [
    "This is a **DFlash 2** drafter (`architectures: [\"DFlash2DraftModel\"]`): the DFlash backbone plus",
    "block-local dynamic convolutions and a candidate selector (`conv_kernel_size`, `conv_group_size`,",
    "`selector_rank`, `selector_top_k` in `dflash_config`). Engines switch DFlash 2 on from this config,",
    "with the same flags as DFlash (below):",
    "",
    "- SGLang: builds containing sgl-project/sglang PR #35371 (merged 2026-08-18), `--speculative-algorithm DFLASH`;",
    "- vLLM: builds containing vllm-project/vllm PR #52816 (merged 2026-08-21; not yet in a stable release when",
    "  last checked), method `dflash`, `num_speculative_tokens` = block size - 1;",
    "- llama.cpp: PR #27342 (merged), `--spec-type draft-dflash` after GGUF conversion.",
    "",
    "Older engine releases know only `DFlashDraftModel` and refuse this checkpoint. dflash-train has not run",
    "these engines itself; the reference `dflash.DFlash2DraftModel` loads this directory (tested).",
]
