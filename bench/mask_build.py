"""Block-mask build at the 8B recipe's shape (1 row of 3,072 tokens, 3 documents + padding, 512 anchors x 16):
eager vs compiled create_block_mask, their times and equality, full and sliding (window 1024).
Runs on the CPU (inductor) or CUDA: python bench/mask_build.py [cpu|cuda]."""
import sys
import time

import torch

from dflash_train.model import masks as M
from dflash_train.model.loss import sample_anchors

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
torch.manual_seed(0)
B, T, A, bs = 1, 3072, 512, 16
docs = torch.zeros(B, T, dtype=torch.long); docs[:, 1000:2000] = 1; docs[:, 2000:3000] = 2; docs[:, 3000:] = -1
lm = torch.ones(B, T, dtype=torch.bool)
docs, lm = docs.to(dev), lm.to(dev)
anc, valid = sample_anchors(lm, docs, A, bs, torch.Generator().manual_seed(0))
for lt, W in (("full_attention", None), ("sliding_attention", 1024)):
    mod = M.dflash_mask_mod(anc, valid, docs, bs, lt, W, T)
    q, kv = A * bs, T + A * bs
    t0 = time.perf_counter(); e = M.flex_block_mask(mod, B, q, kv, compile=False, device=dev); te = time.perf_counter() - t0
    t0 = time.perf_counter(); e2 = M.flex_block_mask(mod, B, q, kv, compile=False, device=dev); te2 = time.perf_counter() - t0
    t0 = time.perf_counter(); c = M.flex_block_mask(mod, B, q, kv, compile=True, device=dev); tc = time.perf_counter() - t0
    t0 = time.perf_counter(); c2 = M.flex_block_mask(mod, B, q, kv, compile=True, device=dev); tc2 = time.perf_counter() - t0
    same = all(torch.equal(getattr(e, f), getattr(c, f)) for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"))
    print(f"{lt}: q {q} kv {kv} ({q*kv/1e6:.0f}M entries): eager {te:.2f}s / {te2:.2f}s, compiled first {tc:.1f}s then {tc2:.3f}s, equal {same}")
