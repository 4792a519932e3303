"""Time and peak memory of one drafter training step (dflash_loss forward + backward).

A random drafter and a random stand-in target (embedding + lm_head of the given
vocab; no real target is loaded) at a stated shape. CPU always; CUDA too when
present. Peak memory: CUDA max_memory_allocated; CPU the peak process RSS above
the pre-step baseline, sampled by a psutil thread every 2 ms.

    .venv/bin/python bench/drafter_step.py                       # Gemma-270M-sized, <1 min on 2 cores
    .venv/bin/python bench/drafter_step.py --vocab-subset 8192   # the CPU speed lever
"""
from __future__ import annotations

import argparse
import resource
import shlex
import sys
import threading
import time

import psutil
import torch
import torch.nn.functional as F

from dflash_train.model import DFlashDrafter, DrafterConfig, default_target_layer_ids, dflash_loss


class RandomTarget:
    """The Target interface subset that dflash_loss uses."""

    def __init__(self, vocab, hidden, device, dtype, softcap=None):
        g = torch.Generator().manual_seed(0)
        self.embed_weight = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype)
        self.lm_head_weight = self.embed_weight  # tied, like Gemma
        self.embed_scale = hidden**0.5
        self.output_multiplier = 1.0
        self.final_logit_softcapping = softcap

    def embed(self, ids):
        return F.embedding(ids, self.embed_weight) * self.embed_scale

    def logits(self, hidden):
        z = F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)
        if self.final_logit_softcapping:
            z = torch.tanh(z / self.final_logit_softcapping) * self.final_logit_softcapping
        return z


class RssPeak:
    """Peak RSS above the baseline while the `with` block runs (sampling thread)."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def delta_mib(self):
        return (self.peak - self.base) / 2**20


def run(args, device: str) -> dict:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    H, L = args.hidden, args.target_layers
    K = len(default_target_layer_ids(L, args.layers))
    cfg = DrafterConfig(
        hidden_size=H, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.head_dim, intermediate_size=args.intermediate,
        layer_types=[args.layer_type] * args.layers, sliding_window=args.sliding_window,
        block_size=args.block_size, mask_token_id=args.vocab - 1,
        target_layer_ids=default_target_layer_ids(L, args.layers), num_target_layers=L, vocab_size=args.vocab,
    )
    drafter = DFlashDrafter(cfg).to(device, dtype)
    target = RandomTarget(args.vocab, H, device, dtype)
    g = torch.Generator().manual_seed(0)
    B, T = args.batch, args.seq
    ids = torch.randint(0, args.vocab - 1, (B, T), generator=g).to(device)
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).to(device)
    docs = (torch.arange(T) * args.docs // T).expand(B, T).contiguous().to(device)
    feats = torch.randn(B, T, K * H, generator=g).to(device, dtype)
    subset = torch.arange(args.vocab_subset, device=device) if args.vocab_subset else None
    anchor_gen = torch.Generator().manual_seed(1)

    def step():
        drafter.zero_grad(set_to_none=True)
        out = dflash_loss(drafter, target, ids, loss_mask, docs, feats, args.anchors, anchor_gen,
                          chunk_blocks=args.chunk_blocks, vocab_subset=subset, backend=args.backend)
        out.loss.backward()
        return out

    cuda = device.startswith("cuda")
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    with RssPeak() as rss:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            out = step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / args.steps
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else rss.delta_mib
    return {
        "device": device, "step_s": min(times), "cpu_s": cpu_s, "loss": out.loss.item(),
        "positions": B * args.anchors * (args.block_size - 1), "peak_mib": peak,
        "mem_kind": "max_memory_allocated - base" if cuda else "peak RSS - base",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--docs", type=int, default=2, help="documents per row")
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layer-type", default="full_attention", choices=["full_attention", "sliding_attention"])
    p.add_argument("--sliding-window", type=int, default=None)
    p.add_argument("--target-layers", type=int, default=18)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--vocab-subset", type=int, default=0, help="restrict the softmax to the first N ids (0 = full)")
    p.add_argument("--chunk-blocks", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backend", default=None, choices=[None, "sdpa", "flex"], help="default: flex on CUDA, sdpa on CPU")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--devices", default="auto", help="auto (cpu + cuda if present) | cpu | cuda")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = p.parse_args(argv)
    if args.layer_type == "sliding_attention" and args.sliding_window is None:
        args.sliding_window = 128
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if args.devices == "auto" else [args.devices]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]

    print("command:", " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]))
    print(f"shape: batch {args.batch} x seq {args.seq}, {args.anchors} anchors x bs {args.block_size}, "
          f"drafter {args.layers}L H{args.hidden} heads {args.heads}/{args.kv_heads}x{args.head_dim} "
          f"I{args.intermediate} {args.layer_type}, vocab {args.vocab}"
          f"{f' (subset {args.vocab_subset})' if args.vocab_subset else ''}, {args.dtype}, "
          f"chunk {args.chunk_blocks} blocks, torch threads {torch.get_num_threads()}")
    rows = [run(args, d) for d in devices]
    # cpu s = process CPU seconds per step (all threads): steadier than wall time on a shared machine
    print(f"{'device':<8}{'step (s)':>10}{'cpu s':>8}{'pos/s':>10}{'peak MiB':>10}  memory measure")
    for r in rows:
        print(f"{r['device']:<8}{r['step_s']:>10.3f}{r['cpu_s']:>8.2f}{r['positions'] / r['step_s']:>10.0f}"
              f"{r['peak_mib']:>10.0f}  {r['mem_kind']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
