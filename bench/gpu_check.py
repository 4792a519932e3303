"""One GPU check (single H200, < 8 minutes): compiled FlexAttention vs SDPA,
bench at the 8b shape in bf16, and a 50-step CUDA training run.
Run through bench/gpu_check.sh; prints one summary table, writes JSON to $OUT."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
rows: list[tuple[str, str, str]] = []
result: dict = {}


def check_flex_vs_sdpa() -> None:
    from dflash_train.config import ModelConfig
    from dflash_train.model.drafter import DFlashDrafter, DrafterConfig
    from dflash_train.model.loss import sample_anchors

    dev = torch.device("cuda")
    for lt in ("full_attention", "sliding_attention"):
        cfg = DrafterConfig(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                            intermediate_size=1024, layer_types=[lt, lt], sliding_window=64, block_size=16,
                            mask_token_id=0, target_layer_ids=[1, 5], num_target_layers=8, rms_norm_eps=1e-6,
                            rope_theta=1e6, max_position_embeddings=4096, vocab_size=1000,
                            input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=None)
        d = DFlashDrafter(cfg, seed=0).to(dev)
        B, T, A = 2, 512, 32
        g = torch.Generator().manual_seed(0)
        docs = torch.zeros(B, T, dtype=torch.int32)
        docs[:, T // 2:] = 1
        mask = torch.rand(B, T, generator=g) > 0.3
        anc, valid = sample_anchors(mask, docs, A, 16, g)
        feats = torch.randn(B, T, 2 * 512, generator=g).to(dev)
        emb = torch.randn(B, A * 16, 512, generator=g).to(dev)
        outs = {}
        for backend in ("sdpa", "flex"):
            d.zero_grad()
            h = d(emb, anc.to(dev), valid.to(dev), docs.to(dev), features=feats, backend=backend)
            h.float().pow(2).mean().backward()
            outs[backend] = (h.detach(), d.fc.weight.grad.clone())
        live = valid.to(dev).repeat_interleave(16, dim=1)
        diff = (outs["sdpa"][0] - outs["flex"][0]).abs()[live].max().item()
        gdiff = (outs["sdpa"][1] - outs["flex"][1]).abs().max().item()
        ok = diff < 1e-3 and gdiff < 1e-3
        rows.append((f"flex vs sdpa ({lt})", f"fwd {diff:.2e}, grad {gdiff:.2e}", "ok" if ok else "FAIL"))
        result[f"flex_vs_sdpa_{lt}"] = {"forward_max_abs": diff, "grad_max_abs": gdiff, "ok": ok}


def check_bench() -> None:
    from dflash_train.bench import run_bench

    r = run_bench("cuda", "8b", steps=3, dtype_name="bfloat16", log=lambda m: print(m, flush=True))
    result["bench_8b_bf16"] = r.__dict__
    rows.append(("matmul peak bf16", f"{r.matmul_peak_flops / 1e12:.0f} TFLOP/s", ""))
    rows.append(("target fwd (8b)", f"{r.target_tok_s:,.0f} tok/s", ""))
    rows.append(("trainer (8b, 5 layers)", f"{r.trainer_tok_s:,.0f} tok/s, MFU {r.trainer_mfu * 100:.1f}%", ""))
    rows.append(("pipeline", f"{r.pipeline_tok_s:,.0f} tok/s, eff {r.pipeline_efficiency:.3f}", ""))
    rows.append(("peak memory", f"{r.peak_memory_bytes / 2**30:.1f} GiB", ""))


def check_training() -> None:
    from conftest import write_tiny_jsonl

    from tiny_target import make_tiny_target

    work = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_check"
    target = make_tiny_target(work / "target", family="qwen3", num_layers=4, hidden_size=256)
    jsonl = write_tiny_jsonl(work / "conv.jsonl", n=200)
    rd = work / "run"
    over = [f"target.path={target}", f"data.source=jsonl:{jsonl}", "data.limit=200", "data.max_tokens=256",
            f"data.cache_dir={work / 'cache'}", "model.num_layers=2", "model.block_size=16",
            "train.max_steps=50", "train.batch_size=4", "train.num_anchors=64", "train.lr=2e-3",
            "train.device=cuda", "train.dtype=bfloat16", "target.device=cuda", "target.dtype=bfloat16",
            "logging.every_steps=1", "logging.progress=plain", "checkpoint.every_steps=25"]
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "dflash_train.cli", "train", "--run-dir", str(rd), *over],
                         capture_output=True, text=True, cwd=REPO)
    losses = [json.loads(l)["loss"] for l in (rd / "metrics.jsonl").read_text().splitlines()] if (rd / "metrics.jsonl").exists() else []
    finite = bool(losses) and all(isinstance(x, float) and math.isfinite(x) for x in losses)
    dec = finite and len(losses) == 50 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    ok = res.returncode == 0 and dec
    if not ok:
        print(res.stdout[-2000:], res.stderr[-4000:])
    result["train_50_steps"] = {"rc": res.returncode, "first5": losses[:5], "last5": losses[-5:],
                                "seconds": time.time() - t0, "ok": ok}
    rows.append(("50-step CUDA training", f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no metrics",
                 "ok" if ok else "FAIL"))


def main() -> int:
    assert torch.cuda.is_available(), "gpu_check needs CUDA"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for fn in (check_flex_vs_sdpa, check_bench, check_training):
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report every check
            rows.append((fn.__name__, f"{type(e).__name__}: {e}"[:120], "FAIL"))
            result[fn.__name__] = {"error": repr(e)}
        print(f"{fn.__name__}: {time.time() - t0:.0f}s", flush=True)
    from rich.console import Console
    from rich.table import Table

    t = Table(title="dflash-train GPU check")
    for c in ("check", "figure", "status"):
        t.add_column(c)
    for r in rows:
        t.add_row(*r)
    Console().print(t)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    return 0 if all(r[2] != "FAIL" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
