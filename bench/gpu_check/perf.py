"""Checks 4 and 5: peak memory of a training step at the shipped 8B config's shape (and whether
it fits the card beside the target, computed rather than loaded), and the trainer's MFU from
`dflash-train bench` at the 8b shape."""
from __future__ import annotations

import dataclasses
import os
import resource
from pathlib import Path

import torch

from dflash_train import bench
from dflash_train.config import load_config
from dflash_train.model.dflash2 import build_drafter
from dflash_train.model.drafter import DrafterConfig
from dflash_train.pipeline.batch import TrainBatch
from dflash_train.train.step import TrainStep

from .common import Result, device, sync

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "configs" / "gpu-8b.yaml"
SMOKE_SHAPE = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512,
                   draft_layers=2, seq=128, batch=1, anchors=16, block=4)
MFU_BEFORE, MFU_GOAL = 0.40, 0.55  # measured on an H200 before this check existed; the goal


def target_bytes(shape: dict, layers: int, bytes_per: int = 2) -> int:
    """Weights of a Qwen3-shaped target (untied embedding and lm_head, q/k norms)."""
    H, D = shape["hidden"], shape["head_dim"]
    attn = H * shape["heads"] * D * 2 + H * shape["kv_heads"] * D * 2 + 2 * D
    layer = attn + 3 * H * shape["inter"] + 2 * H
    return bytes_per * (2 * shape["vocab"] * H + layers * layer + H)


def _card_bytes(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _peak(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_memory(smoke: bool, work) -> Result:
    dev = device(smoke)
    cfg = load_config(SHIPPED, ["train.device=cpu", "target.device=cpu", "train.dtype=float32", "train.compile=false"] if smoke else [])
    base = SMOKE_SHAPE if smoke else bench.SHAPES["8b"]
    shape = dict(base, draft_layers=cfg.model.num_layers, block=cfg.model.block_size, anchors=cfg.train.num_anchors,
                 seq=cfg.data.max_tokens, batch=cfg.train.batch_size)
    if smoke:  # the shipped 512 anchors x 3072 tokens, scaled to a CPU
        shape.update(anchors=SMOKE_SHAPE["anchors"], seq=SMOKE_SHAPE["seq"], block=SMOKE_SHAPE["block"])
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.train.dtype]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    # a one-layer target: the embedding and lm_head the step uses are real; the other 35 decoder
    # layers never run in a step given its features, so they are counted, not loaded
    target = bench.random_target(dict(shape, layers=1), dev, dtype)
    target.num_layers = shape["layers"]  # the drafter reads the 36-layer target's layer ids
    dcfg = DrafterConfig.from_target(cfg.model, target)
    drafter = build_drafter(dcfg, seed=0).to(dev)
    if cfg.train.compile:  # as train/run.py does
        for layer in drafter.layers:
            layer.compile()
    step = TrainStep.build(drafter, target, cfg.train, shape["anchors"], torch.Generator().manual_seed(1))
    B, T = shape["batch"], shape["seq"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"] - 2, (B, T), generator=g).to(dev)
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    docs = torch.zeros(B, T, dtype=torch.int32, device=dev)
    feats = torch.randn(B, T, len(dcfg.target_layer_ids) * shape["hidden"], generator=g).to(dev, dtype)
    for _ in range(2):  # the second step holds the optimizer state the first one creates
        step(lambda: TrainBatch(ids, mask, docs, feats, [0], {}))
    sync(dev)
    peak = _peak(dev)
    rest_of_target = target_bytes(shape, shape["layers"]) - target_bytes(shape, 1)
    queue = cfg.pipeline.queue_depth * feats.numel() * feats.element_size()  # batches wait on the trainer's device
    # the target's own forward at T tokens: a few [T, intermediate] bf16 activations live at once
    target_activations = 4 * B * T * shape["inter"] * 2
    need = peak + rest_of_target + queue + target_activations
    card = _card_bytes(dev)
    gib = 2 ** 30
    figure = (f"step peak {peak / gib:.1f} GiB ({cfg.model.num_layers} layers, {shape['anchors']}x{shape['block']}, "
              f"{T} tok, {cfg.train.dtype}, compile {cfg.train.compile}) + target {rest_of_target / gib:.1f} + queue "
              f"{cfg.pipeline.queue_depth}x{feats.numel() * feats.element_size() / gib:.2f} = {need / gib:.1f} of "
              f"{card / gib:.1f} GiB: {'fits' if need <= card else 'DOES NOT FIT'}")
    return Result(need <= card, figure, {"shape": shape, "step_peak_bytes": peak,
                                         "target_rest_bytes": rest_of_target, "queue_bytes": queue,
                                         "target_activation_bytes_estimate": target_activations,
                                         "needed_bytes": need, "card_bytes": card,
                                         "full_target_bytes": target_bytes(shape, shape["layers"])})


def check_mfu(smoke: bool, work) -> Result:
    dev = device(smoke)
    if smoke:
        # a CPU-sized entry beside bench's shapes: the same code path, a tiny model
        bench.SHAPES.setdefault("gpu-check-smoke", SMOKE_SHAPE)
        r = bench.run_bench(str(dev), "gpu-check-smoke", steps=2, dtype_name="float32", log=lambda m: None)
    else:
        r = bench.run_bench(str(dev), "8b", steps=3, dtype_name="bfloat16", log=lambda m: print(m, flush=True))
    mfu = r.trainer_mfu
    figure = (f"MFU {mfu * 100:.1f} % (H200 before: {MFU_BEFORE * 100:.0f} %, goal {MFU_GOAL * 100:.0f} %: "
              f"{'reached' if mfu >= MFU_GOAL else 'below'}); trainer {r.trainer_tok_s:,.0f} tok/s, "
              f"matmul peak {r.matmul_peak_flops / 1e12:.3g} TFLOP/s, pipeline eff {r.pipeline_efficiency:.2f}")
    # reported, not judged: ok when the bench ran and its numbers are finite
    ok = all(x == x and x > 0 for x in (mfu, r.trainer_tok_s, r.matmul_peak_flops))
    return Result(ok, figure, dataclasses.asdict(r))
