"""`dflash-train bench`: throughput and MFU against this machine's own matmul peak.

Figures (JSON keys):
  matmul_peak_flops   best of several large square matmuls in the training dtype
  target_tok_s        target forward (layer capture only) tokens/s
  trainer_tok_s       the training step `train` runs (train/step.py TrainStep: forward +
                      chunked loss + backward, normalisation, clipping, optimizer and
                      lr schedule) tokens/s, with features given (no target)
  trainer_mfu         train-step FLOP/s / matmul_peak_flops (FLOP formula below)
  pipeline_tok_s      the real threaded pipeline: target worker -> queue -> trainer
  pipeline_efficiency pipeline_tok_s / what the stages allow: one device ->
                      1 / (1/target + 1/trainer); separate devices -> min(target, trainer)
  peak_memory_bytes   CUDA max_memory_allocated, or the process's peak RSS on CPU

Train-step FLOPs (per step, "useful" FLOPs: masked attention scores not counted):
  N = rows * anchors * block_size block tokens, C = rows * seq context tokens,
  per drafter layer: dense(x) = 2 * x * params of the projections it passes
    block tokens:   q, k, v, o projections + SwiGLU MLP         -> 2*N*(P_attn + P_mlp)
    context tokens: k, v projections                            -> 2*C*P_kv
    attention:      4 * N * heads * head_dim * (seq/2 + block_size)  (QK^T and AV over
                    the visible keys: on average half the row before the anchor + the block)
  fc: 2 * C * K*H*H;  lm_head: 2 * N * H * V_eff (V_eff = vocab, or the subset)
  backward = 2 x forward for trainable layers (grad of inputs and weights), 1 x for
  the frozen lm_head (grad of its input only) and the fc (grad of its weight only):
  total = 3 * (layers + attention) + 2 * fc + 2 * lm_head.
"""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.config import ModelConfig
from dflash_train.config_sections import TrainConfig
from dflash_train.errors import UserError
from dflash_train.model.dflash2 import build_drafter
from dflash_train.model.drafter import DrafterConfig
from dflash_train.pipeline.batch import TrainBatch
from dflash_train.pipeline.stages import Pipeline
from dflash_train.targets import Target
from dflash_train.train.step import TrainStep

SHAPES = {
    # Gemma-3-270M-like target (18 layers, hidden 640, vocab 262144); 1-layer drafter
    "small": dict(hidden=640, layers=18, heads=4, kv_heads=1, head_dim=256, inter=2048, vocab=262144,
                  draft_layers=1, seq=256, batch=2, anchors=16, block=16),
    # Qwen3-8B-shaped target; the public recipe's 5-layer drafter, 512 anchors, 3072 tokens
    "8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, inter=12288, vocab=151936,
               draft_layers=5, seq=3072, batch=1, anchors=512, block=16),
}


@dataclass
class BenchResult:
    device: str
    dtype: str
    shape: str
    matmul_peak_flops: float
    target_tok_s: float
    trainer_tok_s: float
    trainer_mfu: float
    trainer_flops_per_step: float
    pipeline_tok_s: float
    pipeline_efficiency: float
    peak_memory_bytes: int


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_matmul_peak(dev: torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 5) -> float:
    n = n or (8192 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(dev)
    best = float("inf")
    inner = 10 if dev.type == "cuda" else 3
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            a @ b
        _sync(dev)
        best = min(best, (time.perf_counter() - t0) / inner)
    return 2 * n**3 / best


def random_target(shape: dict, dev: torch.device, dtype: torch.dtype):
    """A randomly initialised Qwen3-shaped target (no weights needed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                      max_position_embeddings=max(4096, shape["seq"] * 2), tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.eval().requires_grad_(False)
    target = Target(model, None, family="qwen3", source=f"random:{shape}")
    target._mask_token_id = shape["vocab"] - 1
    return target


def train_step_flops(shape: dict, drafter_cfg, vocab_eff: int) -> float:
    H, L = shape["hidden"], drafter_cfg.num_layers
    nh, nkv, hd, inter = drafter_cfg.num_heads, drafter_cfg.num_kv_heads, drafter_cfg.head_dim, drafter_cfg.intermediate_size
    N = shape["batch"] * shape["anchors"] * shape["block"]
    C = shape["batch"] * shape["seq"]
    K = len(drafter_cfg.target_layer_ids)
    p_attn = H * nh * hd * 2 + H * nkv * hd * 2
    p_mlp = 3 * H * inter
    p_kv = 2 * H * nkv * hd
    layers = L * (2 * N * (p_attn + p_mlp) + 2 * C * p_kv + 4 * N * nh * hd * (shape["seq"] / 2 + shape["block"]))
    fc = 2 * C * K * H * H
    head = 2 * N * H * vocab_eff
    return 3 * layers + 2 * fc + 2 * head


def bench_step(drafter, target, train_cfg, num_anchors: int, anchor_gen: torch.Generator) -> TrainStep:
    """The step bench times: the Trainer's own (train/step.py `TrainStep.build`), one process."""
    return TrainStep.build(drafter, target, train_cfg, num_anchors, anchor_gen)


def _peak_memory(dev: torch.device) -> int:
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def run_bench(device: str = "cpu", shape_name: str = "small", steps: int = 3, dtype_name: str | None = None,
              log=print) -> BenchResult:
    if shape_name not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    dtype_name = dtype_name or ("bfloat16" if dev.type == "cuda" else "float32")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    shape = dict(SHAPES[shape_name])
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    log(f"bench: device {dev}, dtype {dtype_name}, shape {shape_name} {shape}")
    peak = measure_matmul_peak(dev, dtype)
    log(f"matmul peak: {peak / 1e12:.3f} TFLOP/s")

    target = random_target(shape, dev, dtype)
    mcfg = ModelConfig(num_layers=shape["draft_layers"], block_size=shape["block"])
    dcfg = DrafterConfig.from_target(mcfg, target)
    drafter = build_drafter(dcfg, seed=0).to(dev)
    tcfg = TrainConfig(dtype=dtype_name)  # the step training runs, with the default loss / optimizer settings
    B, T = shape["batch"], shape["seq"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"] - 2, (B, T), generator=g).to(dev)
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    docs = torch.zeros(B, T, dtype=torch.int32, device=dev)
    tokens = B * T

    # ---- target alone
    def capture():
        with torch.inference_mode():
            out = target.capture(ids, docs, dcfg.target_layer_ids)
        return out.clone()  # outside inference mode: a normal tensor autograd may save

    feats = capture()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        feats = capture()
    _sync(dev)
    target_tok_s = tokens * steps / (time.perf_counter() - t0)
    feats = feats.clone()
    log(f"target forward: {target_tok_s:,.0f} tok/s")

    # ---- trainer alone
    step = bench_step(drafter, target, tcfg, shape["anchors"], torch.Generator().manual_seed(1))

    def train_step(batch_feats):
        return step(lambda: TrainBatch(ids, mask, docs, batch_feats, [0], {}))

    train_step(feats)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(feats)
    _sync(dev)
    step_s = (time.perf_counter() - t0) / steps
    trainer_tok_s = tokens / step_s
    flops = train_step_flops(shape, dcfg, shape["vocab"])
    mfu = flops / step_s / peak
    log(f"trainer step: {step_s * 1e3:.1f} ms, {trainer_tok_s:,.0f} tok/s, MFU {mfu * 100:.1f}%")

    # ---- the real pipeline: a target worker thread feeding the trainer
    class _Source:
        device = dev

        def __init__(self):
            self.n = 0

        def next_positions(self):
            self.n += 1
            return [self.n], {"position": self.n}

        def make_batch(self, positions, state):
            return TrainBatch(ids, mask, docs, capture(), positions, state)

    n_pipe = steps + 1
    with Pipeline(_Source(), 4, dev, max_batches=n_pipe) as pipe:
        first = pipe.get()
        train_step(first.features)  # warm-up outside the timing
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            train_step(pipe.get().features)
        _sync(dev)
        pipeline_tok_s = tokens * steps / (time.perf_counter() - t0)
    allowed = 1.0 / (1.0 / target_tok_s + 1.0 / trainer_tok_s)  # both stages share one device
    eff = pipeline_tok_s / allowed
    log(f"pipeline: {pipeline_tok_s:,.0f} tok/s, efficiency {eff:.3f} (stages allow {allowed:,.0f} tok/s)")
    return BenchResult(str(dev), dtype_name, shape_name, peak, target_tok_s, trainer_tok_s, mfu, flops,
                       pipeline_tok_s, eff, _peak_memory(dev))


def bench_command(device: str, shape: str, out: Path | None, steps: int, dtype: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    # a mistake on the command line is one `error:` line and exit 2 (cli._guard), not a traceback
    if shape not in SHAPES:
        raise UserError(f"--shape {shape}: must be one of {', '.join(SHAPES)}")
    if dtype not in (None, "float32", "bfloat16"):
        raise UserError(f"--dtype {dtype}: must be float32 or bfloat16")
    try:
        torch.device(device)
    except RuntimeError as e:
        raise UserError(f"--device {device}: {e}") from None
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    console = Console(stderr=True)
    res = run_bench(device, shape, steps, dtype, log=lambda m: console.print(m))
    table = Table(title=f"dflash-train bench ({res.device}, {res.dtype}, shape {res.shape})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("matmul peak", f"{res.matmul_peak_flops / 1e12:.3f} TFLOP/s")
    table.add_row("target forward", f"{res.target_tok_s:,.0f} tok/s")
    table.add_row("trainer step", f"{res.trainer_tok_s:,.0f} tok/s")
    table.add_row("trainer MFU", f"{res.trainer_mfu * 100:.1f} %")
    table.add_row("pipeline", f"{res.pipeline_tok_s:,.0f} tok/s")
    table.add_row("pipeline efficiency", f"{res.pipeline_efficiency:.3f}")
    table.add_row("peak memory", f"{res.peak_memory_bytes / 2**30:.2f} GiB")
    Console().print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res.__dict__, indent=2) + "\n")
        console.print(f"wrote {out}")
