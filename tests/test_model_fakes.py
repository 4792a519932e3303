"""Tiny stand-ins shared by the tests/test_model_*.py files (no tests here).

FakeTarget implements the declared Target interface (model/target.py `TargetHead`) with a
random nn.Embedding and lm_head; it does not depend on src/dflash_train/targets/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.model.target import TargetHead


@dataclass
class FakeTarget(TargetHead):
    vocab_size: int = 50
    hidden_size: int = 32
    num_layers: int = 8
    embed_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    mask_token_id: int = 49
    seed: int = 0
    trainable: bool = False  # True only to prove no gradient reaches it
    serving_dtype: str | None = None
    hf_config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64))

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        self.embedding = nn.Embedding(self.vocab_size, self.hidden_size)
        with torch.no_grad():
            self.embedding.weight.copy_(torch.randn(self.vocab_size, self.hidden_size, generator=g))
        self.head = nn.Parameter(torch.randn(self.vocab_size, self.hidden_size, generator=g) * 0.5)
        self.embedding.weight.requires_grad_(self.trainable)
        self.head.requires_grad_(self.trainable)
        self.family = "fake"
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def embed(self, ids):
        return self.embedding(ids) * self.embed_scale

    @property
    def lm_head_weight(self):
        return self.head

    def logits(self, hidden):
        z = F.linear(hidden.to(self.head.dtype), self.head) * self.output_multiplier
        if self.final_logit_softcapping:
            z = torch.tanh(z / self.final_logit_softcapping) * self.final_logit_softcapping
        return z


def tiny_config(layer_types=("full_attention",), num_layers=None, sliding_window=None, block_size=4,
                target_layer_ids=(1, 5), hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=50, **kw) -> DrafterConfig:
    layer_types = list(layer_types)
    num_layers = num_layers or len(layer_types)
    return DrafterConfig(
        hidden_size=hidden, num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=64, layer_types=layer_types, sliding_window=sliding_window, block_size=block_size,
        mask_token_id=vocab - 1, target_layer_ids=list(target_layer_ids), num_target_layers=8,
        vocab_size=vocab, **kw,
    )


def tiny_drafter(seed=0, std=0.2, **kw) -> DFlashDrafter:
    """Random weights large enough (std 0.2, norms != 1) that a wrong mask or position shows."""
    d = DFlashDrafter(tiny_config(init_std=std, **kw), seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return d


def packed_row(lengths, T, seed=0, vocab=50, p_loss=0.8):
    """input_ids [T], loss_mask [T], document_ids [T] (-1 padding) for documents of the given lengths."""
    from dflash_train.model import document_ids_from_lengths

    g = torch.Generator().manual_seed(seed)
    docs = document_ids_from_lengths(torch.tensor(lengths), T)
    ids = torch.randint(0, vocab - 1, (T,), generator=g)
    lm = (torch.rand(T, generator=g) < p_loss) & (docs >= 0)
    return ids, lm, docs


def batch(rows):
    ids, lm, docs = zip(*rows)
    return torch.stack(ids), torch.stack(lm), torch.stack(docs)
